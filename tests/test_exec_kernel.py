"""``%%ddp_exec`` in a real kernel, 2 gloo ranks of a warm pool: namespaces kept across cells, a model trained
in one cell and evaluated in the next, an exception on rank 1, an interrupt inside a loop, ``--rank 0``, the hang
watchdog, and ``%%ddp_train`` kept apart."""

import os
import time

import pytest
from jupyter_kernel import running_kernel

pytestmark = pytest.mark.kernel
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def kernel():
    with running_kernel(env={"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}) as kernel:
        _ok(kernel.execute("%load_ext flair_nbddp\nfrom flair_nbddp.synthetic import ner_corpus\nlr = 0.5", timeout=60))
        yield kernel
        kernel.execute("%ddp_pool stop", timeout=60)


def _ok(result):
    assert result.error is None, result.error and "\n".join(result.error["traceback"])[-3000:]
    return result


def test_namespaces_are_kept_across_cells_and_values_come_back_per_rank(kernel):
    first = _ok(kernel.execute("%%ddp_exec --reset\nx = rank * 10 + lr\nprint('hello from', rank)\nx", timeout=120))
    assert "[rank 0] hello from 0" in first.stdout and "[rank 1] hello from 1" in first.stdout
    assert "[rank 0] Out: 0.5" in first.stdout and "[rank 1] Out: 10.5" in first.stdout
    _ok(kernel.execute("%%ddp_exec --out values\nx + world_size"))
    assert _ok(kernel.execute("values")).data("text/plain") == ["[2.5, 12.5]"]
    # %%ddp_train runs in fresh globals, and leaves the namespaces alone
    isolated = _ok(kernel.execute("%%ddp_train --no-dashboard\n'x' in globals()", timeout=120))
    assert isolated.data("text/plain") == ["False"]
    assert "[rank 1] Out: 10.5" in _ok(kernel.execute("%%ddp_exec\nx", timeout=120)).stdout
    _ok(kernel.execute("%ddp_exec --reset"))
    assert "[rank 1] Out: False" in _ok(kernel.execute("%%ddp_exec\n'x' in globals()")).stdout


def test_a_model_trained_in_one_cell_is_evaluated_in_the_next_without_leaving_the_workers(kernel, tmp_path):
    _ok(kernel.execute(f"corpus = ner_corpus(n_train=60, n_dev=10, n_test=10)\nbase = {str(tmp_path)!r}"))
    trained = _ok(kernel.execute(
        "%%ddp_exec\nfrom training_jobs import train_ner\nscores = train_ner(corpus, base, epochs=2)\n"
        "tagger = scores['model']\nround(scores['test_score'], 6)", timeout=300,
    ))  # fmt: skip
    outs = [line.split("Out: ")[1] for line in trained.stdout.splitlines() if "Out: " in line]
    assert len(outs) == 2 and outs[0] == outs[1]  # every rank trained the same model (DDP)
    evaluated = _ok(kernel.execute(
        "%%ddp_exec --out test_scores\nround(tagger.evaluate(corpus.test, gold_label_type='ner').main_score, 6)",
        timeout=120,
    ))  # fmt: skip
    assert evaluated.stdout.count("Out: ") == 2
    scores = _ok(kernel.execute("test_scores[0] == test_scores[1], test_scores[0] == float(" + repr(outs[0]) + ")"))
    assert scores.data("text/plain") == ["(True, True)"]
    models = _ok(kernel.execute("%%ddp_exec --out models\ntagger"))
    assert "Out: SequenceTagger(" in models.stdout
    on_cpu = _ok(kernel.execute("[str(next(m.parameters()).device) for m in models], type(models[0]).__name__"))
    assert on_cpu.data("text/plain") == ["(['cpu', 'cpu'], 'SequenceTagger')"]


def test_an_exception_on_rank_one_shows_its_traceback_and_keeps_the_namespaces(kernel):
    _ok(kernel.execute("%%ddp_exec\nkept = 7"))
    failed = kernel.execute("%%ddp_exec\nkept / 0 if rank == 1 else kept", timeout=120)
    assert "[rank 0] Out: 7" in failed.stdout
    assert failed.error["ename"] == "WorkerError" and "ZeroDivisionError" in failed.error["evalue"]
    evalue = failed.error["evalue"]
    assert 'File "<ddp_exec cell>", line 1' in evalue and "ddp_exec.py" not in evalue and "cell_code.py" not in evalue
    assert "[rank 1] Out: 8" in _ok(kernel.execute("%%ddp_exec\nkept + 1", timeout=120)).stdout
    assert "0 recycle(s)" in _ok(kernel.execute("%ddp_pool status")).stdout


def test_an_interrupt_raises_keyboard_interrupt_in_every_ranks_cell_and_keeps_the_namespaces(kernel):
    _ok(kernel.execute("%%ddp_exec\ncounter = 0"))
    msg_id = kernel.submit("%%ddp_exec\nimport time\nprint('looping', flush=True)\nwhile True:\n"
                           "    counter += 1\n    time.sleep(0.01)")  # fmt: skip
    kernel.collect(msg_id, timeout=60, until=lambda: kernel._results[msg_id].stdout.count("looping") >= 2)
    time.sleep(1.0)  # let the loops count: on a busy machine the interrupt could otherwise come within ten ticks
    kernel.interrupt()
    interrupted = kernel.collect(msg_id, timeout=60)
    assert interrupted.error["ename"] == "KeyboardInterrupt"
    assert "interrupting the code on every rank" in interrupted.stdout
    assert "[rank 0] KeyboardInterrupt" in interrupted.stdout and "[rank 1] KeyboardInterrupt" in interrupted.stdout
    after = _ok(kernel.execute("%%ddp_exec\ncounter > 10", timeout=120))
    assert "[rank 0] Out: True" in after.stdout and "[rank 1] Out: True" in after.stdout
    assert "0 recycle(s)" in _ok(kernel.execute("%ddp_pool status")).stdout


def test_one_rank_only_and_a_hang_ends_the_workers_and_says_so(kernel):
    alone = _ok(kernel.execute("%%ddp_exec --rank 0\nrank", timeout=120))
    assert "runs on rank(s) 0 only" in alone.stdout and "[rank 0] Out: 0" in alone.stdout and "[rank 1]" not in alone.stdout
    started = time.monotonic()
    hung = kernel.execute(
        "%%ddp_exec --rank 0 --hang-timeout 5\nimport torch, torch.distributed as dist\ndist.barrier()", timeout=120
    )
    assert hung.error["ename"] == "RunHangError" and time.monotonic() - started < 60
    fresh = _ok(kernel.execute("%%ddp_exec\n'counter' in globals()", timeout=120))
    assert "recycled the pool's workers" in fresh.stdout and "%%ddp_exec namespaces empty" in fresh.stdout
    assert "[rank 0] Out: False" in fresh.stdout
