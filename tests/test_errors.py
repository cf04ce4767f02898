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
