import pickle
import signal

from flair_nbddp.errors import WorkerError, describe_exit


def test_describe_exit_names_signals():
    assert describe_exit(-signal.SIGKILL) == "was killed by signal SIGKILL"
    assert describe_exit(1) == "exited with code 1"


def test_worker_error_names_rank_cause_traceback_and_log():
    error = WorkerError(1, "ValueError", "bad", "Traceback: here", exit_code=1, log_path="/x/rank1.log")
    text = str(error)
    assert text.startswith("rank 1 failed: ValueError: bad")
    assert "Traceback: here" in text and "/x/rank1.log" in text
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.exc_type, copy.message, str(copy)) == (1, "ValueError", "bad", text)


def test_a_cell_shows_the_rank_traceback_and_log_not_the_kit_frames(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.user_ns["error"] = WorkerError(1, "ValueError", "bad", 'File "train.py", line 3\nValueError: bad',
                                             exit_code=1, log_path="/runs/run-1/rank1.log")  # fmt: skip
        shell.run_cell("def wait_for_workers():\n    raise error\nwait_for_workers()")
    finally:
        InteractiveShell.clear_instance()
    shown = capsys.readouterr().out
    assert "WorkerError: rank 1 failed: ValueError: bad" in shown and 'File "train.py", line 3' in shown
    assert "full output of rank 1: /runs/run-1/rank1.log" in shown
    assert "wait_for_workers" not in shown and "Traceback (most recent call last)" not in shown
