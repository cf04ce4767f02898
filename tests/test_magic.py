"""%%ddp_train, %ddp_info and %ddp_devices, driven through an in-process IPython shell (kernel-level tests:
test_kernel.py)."""

import re

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from flair_nbddp.engine.devices import visible_gpu_count
from flair_nbddp.notebook.cell_names import free_names, names_to_ship
from flair_nbddp.worker.cell_code import run_ddp_train_cell


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "flair_nbddp")
    yield shell
    InteractiveShell.clear_instance()


def test_free_names_ignore_what_the_cell_binds():
    source = """
import os
from flair.data import Sentence as S
def helper(x, *rest, key=None):
    return x + offset
for i in range(3):
    total = helper(i)
try:
    pass
except Exception as exc:
    print(exc)
class Local: pass
[w for w in words]
"""
    assert free_names(source) == ["range", "Exception", "print", "words", "offset"]


@pytest.mark.parametrize(
    ("source", "namespace", "shipped"),
    [
        # a name the cell reads before binding it, or binds only inside a function, still comes from the notebook
        ("def make(corpus):\n    return corpus\nmake(corpus)", {"corpus": 1}, {"corpus": 1}),
        ("x = x + 1", {"x": 1}, {"x": 1}),
        ("x += 1", {"x": 1}, {"x": 1}),
        ("[label_type in s for s in corpus]", {"corpus": [], "label_type": "a", "s": 0}, {"corpus": [], "label_type": "a"}),
        ("class C:\n    t = label_type\n    def m(self):\n        return helper(self)", {"label_type": 1, "helper": 2},
         {"label_type": 1, "helper": 2}),
        ("f = lambda y: y * factor\nf(2)", {"factor": 3, "y": 9}, {"factor": 3}),
        # what the cell binds before reading it stays out, even where the notebook has the name too
        ("for model in models:\n    model.fit()", {"models": [], "model": object()}, {"models": []}),
        ("def a():\n    return b()\ndef b():\n    return 1\na()", {"b": "stale"}, {}),
        ("with open(p) as fh:\n    data = fh.read()\ndata", {"p": "x", "data": "old"}, {"p": "x"}),
    ],
)
def test_names_to_ship_follows_scopes_and_order(source, namespace, shipped):
    assert names_to_ship(source, namespace) == (shipped, [])


def test_names_to_ship_splits_known_and_missing():
    shipped, missing = names_to_ship("a + b + len(c)", {"a": 1, "c": [1], "In": []})
    assert shipped == {"a": 1, "c": [1]} and missing == ["b"]


def test_run_ddp_train_cell_returns_last_expression_or_none():
    assert run_ddp_train_cell("x = 2\nx * k", {"k": 21}) == 42
    assert run_ddp_train_cell("x = 2", {}) is None


@pytest.mark.process
def test_corpus_and_helper_from_earlier_cells_train_and_out_holds_the_value(shell, tiny_model_path, tmp_path):
    shell.run_cell(
        f"""
from flair_nbddp.synthetic import sentiment_corpus
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
corpus = sentiment_corpus(n_train=160, n_dev=30, n_test=40, seed=5)
label_type = "sentiment"
unused_big_thing = list(range(10**6))

def make_classifier(corpus):
    return TextClassifier(TransformerDocumentEmbeddings({tiny_model_path!r}, fine_tune=True),
                          label_type=label_type,
                          label_dictionary=corpus.make_label_dictionary(label_type, add_unk=False))
""",
        store_history=True,
    ).raise_error()
    body = f"""
import torch.distributed as dist
scores = ModelTrainer(make_classifier(corpus), corpus).fine_tune(
    {str(tmp_path / "out")!r}, max_epochs=6, mini_batch_size=8, learning_rate=5e-3, multi_gpu=True)
{{"score": scores["test_score"], "world": dist.get_world_size(), "rank": dist.get_rank()}}
"""
    # what travels: the three names the body reads, not the big list nor anything else of the notebook
    assert set(names_to_ship(body, shell.user_ns)[0]) == {"ModelTrainer", "make_classifier", "corpus"}
    value = shell.run_cell_magic("ddp_train", "--processes 2 --device cpu --out scores --no-dashboard --seed 1", body)
    assert value["world"] == 2 and value["rank"] == 0
    assert value["score"] >= 0.75, value
    assert shell.user_ns["scores"] is value


def test_undefined_name_is_reported_before_launch(shell):
    with pytest.raises(UsageError, match="'not_defined_anywhere', not defined in the notebook"):
        shell.run_cell_magic("ddp_train", "--no-dashboard", "not_defined_anywhere + 1")


def test_unpicklable_variable_is_named_with_its_path_and_the_fix(shell):
    shell.run_cell(
        "import threading\nclass Tokenizer:\n    def __init__(self):\n        self.cache = {'guard': threading.Lock()}\n"
        "tok = Tokenizer()"
    ).raise_error()
    with pytest.raises(UsageError) as caught:
        shell.run_cell_magic("ddp_train", "--no-dashboard", "tok")
    message = str(caught.value)
    assert "variable 'tok' (Tokenizer)" in message and "tok.cache['guard'] is a lock" in message
    assert "Build it inside this cell" in message


@pytest.mark.parametrize("line", ["--processes two", "--device tpu", "--bogus", "--out 1abc"])
def test_bad_options_are_usage_errors(shell, line):
    with pytest.raises(UsageError):
        shell.run_cell_magic("ddp_train", line, "1")


def test_impossible_device_request_is_a_usage_error(shell):
    with pytest.raises(UsageError, match="sees no GPU"):
        shell.run_cell_magic("ddp_train", "--device cuda --no-dashboard", "1")


def test_braces_in_the_option_line_are_left_alone(shell):
    with pytest.raises(UsageError, match="'{name}' is not a valid variable name"):
        shell.run_cell_magic("ddp_train", "--out {name}", "1")


def test_help_is_available(shell):
    assert "--processes" in shell.find_cell_magic("ddp_train").__doc__


@pytest.mark.process
def test_ddp_info_lists_devices_versions_and_runs(shell, capsys):
    assert shell.run_cell_magic("ddp_train", "--no-dashboard", "20 + 22") == 42
    shell.run_line_magic("ddp_info", "")
    out = capsys.readouterr().out
    assert f"GPUs visible: {visible_gpu_count()}" in out and "a run would use: 2 × cpu (gloo)" in out
    assert "flair 0.15.1" in out
    assert "runs in this kernel:" in out and "%%ddp_train (ledger #" in out and "): finished" in out
    assert re.search(r"devices in use on this machine: \d+ holders? \(%ddp_devices lists them\)", out)


def test_ddp_devices_shows_every_claim_on_the_machine(shell, monkeypatch, tmp_path):
    from flair_nbddp.engine.claim_files import ClaimDir
    from foreign_claims import ForeignClaim

    monkeypatch.setenv("FLAIR_NBDDP_CLAIMS", str(tmp_path / "claims"))
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda value: shown.append(value))
    shell.run_line_magic("ddp_devices", "")
    assert repr(shown[-1]).startswith("no device of this machine is held by a flair_nbddp run")
    other = ForeignClaim(ClaimDir(), cpu=2, capacity=2)
    shell.run_line_magic("ddp_devices", "")
    html = shown[-1]._repr_html_()
    assert "run #7 &#x27;tagger&#x27; (started 09:00:00)" in html and "alice" in html and "ner/tagger.ipynb" in html
    with pytest.raises(UsageError, match="%ddp_devices takes no arguments"):
        shell.run_line_magic("ddp_devices", "--all")
    other.end()


@pytest.fixture
def launched(monkeypatch):
    """The magic's call to launch, recorded instead of run: ``launched[0]`` is ``(args, kwargs)``."""
    from types import SimpleNamespace

    from flair_nbddp.notebook import magic

    calls = []
    monkeypatch.setattr(magic, "launch", lambda fn, **kwargs: calls.append(kwargs) or SimpleNamespace(value=None))
    return calls


def test_timeouts_seed_and_gpus_reach_launch(shell, launched):
    shell.run_cell_magic("ddp_train", "--gpus 0,2 --stop-timeout 5 --hang-timeout 60 --seed 3 --timeout 9", "1")
    options = launched[0]
    assert options["gpus"] == (0, 2) and options["seed"] == 3 and options["timeout"] == 9
    assert options["stop_timeout"] == 5 and options["hang_timeout"] == 60 and options["distributed_eval"] is True
    shell.run_cell_magic("ddp_train", "--hang-timeout 0 --no-distributed-eval", "1")
    assert launched[1]["hang_timeout"] is None and launched[1]["stop_timeout"] == 30 and launched[1]["gpus"] is None
    assert launched[1]["distributed_eval"] is False


def test_sharing_gpus_reaches_launch_and_the_pool(shell, launched, monkeypatch):
    from flair_nbddp import WorkerPool
    from flair_nbddp.engine import devices
    from flair_nbddp.notebook.magic import current_pool, set_current_pool

    shell.run_cell_magic("ddp_train", "--share-gpus --processes 4", "1")
    assert launched[0]["share_gpus"] is True and launched[0]["processes"] == 4
    shell.run_cell_magic("ddp_train", "", "1")
    assert launched[1]["share_gpus"] is False
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(WorkerPool, "warm_up", lambda pool: None)  # the plan is the point here, not the workers
    shell.run_line_magic("ddp_pool", "start 2 --device cuda --share-gpus")
    try:
        assert str(current_pool().plan) == "2 × cuda sharing GPU 0 (gloo)"
    finally:
        current_pool().close()
        set_current_pool(None)


def test_help_lists_every_option(shell):
    doc = shell.find_cell_magic("ddp_train").__doc__
    for option in ("--processes", "--device", "--gpus", "--out", "--no-dashboard", "--timeout", "--stop-timeout",
                   "--hang-timeout", "--seed", "--no-distributed-eval"):
        assert option in doc, option


@pytest.mark.parametrize("gpus", ["0,two", "0;2", ""])
def test_a_gpu_list_that_is_not_numbers_is_a_usage_error(shell, launched, gpus):
    with pytest.raises(UsageError, match="argument --gpus: '.*' is not a list of GPU numbers: write e.g. --gpus 0,2"):
        shell.run_cell_magic("ddp_train", f"--gpus '{gpus}'", "1")
    assert not launched


def test_gpus_this_machine_does_not_have_are_a_usage_error_naming_them(shell):
    with pytest.raises(UsageError, match=r"gpus=\[0, 2\]: there is no GPU 0, 2"):
        shell.run_cell_magic("ddp_train", "--gpus 0,2 --no-dashboard", "1")


@pytest.mark.parametrize(
    ("cell", "line", "text"),
    [
        ("x = 1\n%time y = x + 1\ny", 2, "%time y = x + 1"),
        ("!nvidia-smi\n1", 1, "!nvidia-smi"),
        ("import os\nfiles = !ls\nfiles", 2, "files = !ls"),
        ("len?", 1, "len?"),
        ("%%time\n1", 1, "%%time"),
    ],
)
def test_ipython_syntax_is_refused_naming_its_line(shell, launched, cell, line, text):
    with pytest.raises(UsageError) as caught:
        shell.run_cell_magic("ddp_train", "--no-dashboard", cell)
    message = str(caught.value)
    assert message.startswith(f"line {line} of the cell, `{text}`, is IPython syntax"), message
    assert "workers cannot run" in message and "subprocess.run" in message
    assert not launched


def test_the_cell_is_transformed_as_ipython_does_before_it_ships(shell, launched):
    shell.run_cell_magic("ddp_train", "--no-dashboard", ">>> x = 20\n>>> x + 22")
    source, shipped = launched[0]["args"]
    assert run_ddp_train_cell(source, shipped) == 42


def test_ddp_info_shows_every_version(shell, capsys):
    import platform

    import torch

    import flair_nbddp

    shell.run_line_magic("ddp_info", "")
    out = capsys.readouterr().out
    versions = next(line for line in out.splitlines() if line.startswith("versions: "))
    assert f"python {platform.python_version()}, torch {torch.__version__}, CUDA " in versions
    assert ", NCCL " in versions and ", flair 0.15.1, transformers " in versions
    assert versions.endswith(f"flair_nbddp {flair_nbddp.__version__}")
    if torch.version.cuda is None:
        assert "CUDA none (a CPU build of torch), NCCL none (not in this torch build)" in versions


def test_windows_is_refused_as_a_usage_error(shell, monkeypatch):
    import os

    monkeypatch.delattr(os, "killpg")  # as on Windows
    with pytest.raises(UsageError, match="needs a POSIX system .* WSL 2"):
        shell.run_cell_magic("ddp_train", "--no-dashboard", "1")
