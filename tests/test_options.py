"""One definition of the run options: every way to start a run takes exactly RunOptions' fields, named and
documented once."""

import dataclasses
import inspect

import pytest

from flair_nbddp import (
    RunOptions,
    TrainingPanel,
    UnknownOptionError,
    WorkerPool,
    launch,
    start,
)
from flair_nbddp.api import _START_DECIDES
from flair_nbddp.notebook.magic import DdpMagics
from flair_nbddp.notebook.panel import _PANEL_DECIDES
from flair_nbddp.options import magic_flags, option_names
from flair_nbddp.pool import _EXEC_DECIDES

FIELDS = {spec.name: spec for spec in dataclasses.fields(RunOptions)}


@pytest.mark.parametrize(
    "takes, left_out",
    [(launch, ()), (start, _START_DECIDES), (WorkerPool.launch, ()), (TrainingPanel, _PANEL_DECIDES),
     (WorkerPool.exec, _EXEC_DECIDES)],
    ids=["launch", "start", "WorkerPool.launch", "TrainingPanel", "WorkerPool.exec"],
)
def test_each_way_to_start_a_run_lists_every_option_with_its_default(takes, left_out):
    parameters = inspect.signature(takes).parameters
    expected = [name for name in option_names() if name not in left_out]
    listed = [name for name in parameters if name in FIELDS]
    assert listed == expected
    assert all(parameters[name].default == FIELDS[name].default for name in listed)
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in listed)
    assert "options" in parameters


@pytest.mark.parametrize("documented", [launch, start, WorkerPool.launch], ids=["launch", "start", "WorkerPool.launch"])
def test_the_docstrings_carry_each_options_one_description(documented):
    doc = " ".join(documented.__doc__.split())
    for name, spec in FIELDS.items():
        if name in _START_DECIDES and documented is start:
            continue
        assert f"{name}: {' '.join(spec.metadata['doc'].split())}" in doc, name
    assert "{run_options}" not in doc


def test_the_magics_flags_come_from_the_options():
    train_parser = DdpMagics.ddp_train.parser
    exec_parser = DdpMagics.ddp_exec.parser
    train = {action.dest: action for action in train_parser._actions}
    with_flag = [name for name, spec in FIELDS.items() if spec.metadata["flag"] is not None]
    assert with_flag == list(option_names())  # every option is a %%ddp_train flag
    assert set(with_flag) <= set(train)
    assert {flag.option for flag in magic_flags(ddp_exec=True)} == {"timeout", "stop_timeout", "hang_timeout"}
    assert {flag.option for flag in magic_flags(ddp_exec=True)} <= {action.dest for action in exec_parser._actions}
    parsed = train_parser.parse_args(["--gpus", "0,2", "--hang-timeout", "0", "--no-lazy-corpus", "--run-dir", "/r"])
    assert (parsed.gpus, parsed.hang_timeout, parsed.lazy_corpus, parsed.run_dir) == ((0, 2), None, False, "/r")
    compiled = [train_parser.parse_args(given).compile_model for given in
                (["--compile-model"], ["--compile-model", "off"], ["--compile-model", "cudagraphs"])]  # fmt: skip
    assert compiled == [True, False, "cudagraphs"]
    defaults = train_parser.parse_args([])
    assert {name: getattr(defaults, name) for name in with_flag} == dataclasses.asdict(RunOptions())


def test_an_unknown_option_is_refused_naming_the_closest_and_every_option():
    with pytest.raises(UnknownOptionError) as caught:
        launch(print, proceses=2)
    message = str(caught.value)
    assert message.startswith("launch(): 'proceses' is not a run option (did you mean 'processes'?)")
    assert message.endswith(", ".join(option_names()))
    assert isinstance(caught.value, TypeError)
    with pytest.raises(UnknownOptionError, match="TrainingPanel\\(\\): 'sed' is not a run option \\(did you mean 'seed'"):
        TrainingPanel(print, sed=1)


def test_keywords_beside_options_win_and_options_are_frozen():
    base = RunOptions(processes=2, seed=1, timeout=60)
    changed = RunOptions.of({"seed": 2}, base)
    assert (changed.processes, changed.seed, changed.timeout) == (2, 2, 60) and base.seed == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.seed = 3
    assert RunOptions(gpus=[0, 2]).gpus == (0, 2)  # a list given is kept as a tuple: the options stay hashable
    assert hash(RunOptions(gpus=[0, 2])) == hash(RunOptions(gpus=(0, 2)))


def test_an_option_the_caller_decides_itself_is_refused_with_the_reason():
    with pytest.raises(UnknownOptionError, match=r"start\(\): dashboard= is not taken here: start\(\) shows nothing"):
        start(print, dashboard=True)
    pool = WorkerPool(2, "cpu")  # no worker starts before the first job: a refused one starts none
    try:
        with pytest.raises(UnknownOptionError, match=r"exec\(\): output= is not taken here: every rank's output"):
            pool.exec("1", output="rank0")
    finally:
        pool.close()
