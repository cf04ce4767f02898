import socket

import pytest

from flair_nbddp.engine import devices
from flair_nbddp.engine.devices import DEVICE_ENV, PROCESSES_ENV, resolve_devices


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.delenv(PROCESSES_ENV, raising=False)


def test_defaults_without_gpu_are_two_gloo_processes(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    plan = resolve_devices()
    assert (plan.device_type, plan.world_size, plan.backend) == ("cpu", 2, "gloo")
    assert plan.device_for(1) == "cpu"


def test_defaults_with_gpus_use_every_gpu_with_nccl(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 4)
    plan = resolve_devices()
    assert (plan.device_type, plan.world_size, plan.backend) == ("cuda", 4, "nccl")
    assert plan.device_for(3) == "cuda:3"


def test_environment_overrides_defaults_and_arguments_override_environment(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    monkeypatch.setenv(PROCESSES_ENV, "3")
    assert resolve_devices() == devices.DevicePlan("cpu", 3, "gloo")
    assert resolve_devices(device="cuda", processes=1) == devices.DevicePlan("cuda", 1, "nccl")


@pytest.mark.parametrize(
    "kwargs, gpus, message",
    [
        ({"device": "cuda"}, 0, "sees no GPU"),
        ({"device": "cuda", "processes": 3}, 2, "only 2 GPU"),
        ({"device": "tpu"}, 0, "not supported"),
        ({"device": "cuda:1"}, 2, "names one GPU"),
        ({"processes": 0}, 0, "positive integer"),
        ({"processes": True}, 0, "positive integer"),
    ],
)
def test_impossible_requests_say_why_and_what_to_do(monkeypatch, kwargs, gpus, message):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: gpus)
    with pytest.raises(ValueError, match=message):
        resolve_devices(**kwargs)


@pytest.mark.parametrize("name, value", [(DEVICE_ENV, "gpu"), (PROCESSES_ENV, "two"), (PROCESSES_ENV, "0")])
def test_bad_environment_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        resolve_devices()


def test_rank_environment_points_at_loopback(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = devices.DevicePlan("cpu", 2, "gloo").rank_environment(1, 4567)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "4567"
    assert (env["RANK"], env["WORLD_SIZE"], env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("1", "2", "lo", "lo")


def test_rendezvous_socket_listens_on_loopback_only():
    with devices.rendezvous_socket() as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection((host, port), timeout=5):
            pass


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 4)
    monkeypatch.setattr(devices, "gpu_names", lambda: [f"{i}: NVIDIA H200" for i in range(4)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_chosen_gpus_get_one_process_each_and_only_they_are_visible_to_the_workers(four_gpus):
    plan = resolve_devices(gpus=[0, 2])
    assert plan == devices.DevicePlan("cuda", 2, "nccl", (0, 2)) and str(plan) == "2 × cuda 0,2 (nccl)"
    assert [plan.rank_environment(rank, 1)["CUDA_VISIBLE_DEVICES"] for rank in (0, 1)] == ["0,2", "0,2"]
    assert [plan.device_for(rank) for rank in (0, 1)] == ["cuda:0", "cuda:1"]  # each sees only 0 and 2, in order
    assert "CUDA_VISIBLE_DEVICES" not in resolve_devices().rank_environment(0, 1)  # no choice: inherited as is


def test_chosen_gpus_are_numbered_as_the_kernel_sees_them(four_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,GPU-8f1e,7")  # the kernel was started on a subset
    plan = resolve_devices(gpus=[2, 0])
    assert plan.rank_environment(0, 1)["CUDA_VISIBLE_DEVICES"] == "GPU-8f1e,3"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpus": [0, 5]}, r"gpus=\[0, 5\]: there is no GPU 5. The GPUs torch sees here: 0: NVIDIA H200, 1: NVIDIA"),
        ({"gpus": [-1]}, "there is no GPU -1"),
        ({"gpus": [1, 1]}, "names a GPU twice"),
        ({"gpus": []}, "non-empty list"),
        ({"gpus": "0,2"}, "non-empty list of GPU numbers"),
        ({"gpus": [0.0]}, "must hold GPU numbers"),
        ({"gpus": [0, 1], "device": "cpu"}, "chooses GPUs, but device='cpu'"),
        ({"gpus": [0, 1], "processes": 3}, "one process per GPU \\(2\\), not processes=3"),
        ({"device": "cuda:1"}, r"names one GPU.*Pass gpus=\[1\]"),
    ],
)
def test_impossible_gpu_choices_say_why(four_gpus, kwargs, message):
    with pytest.raises(devices.DeviceError, match=message):
        resolve_devices(**kwargs)


def test_gpus_without_any_gpu_say_there_is_none(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    with pytest.raises(devices.DeviceError, match=r"no GPU 0, 2. The GPUs torch sees here: none"):
        resolve_devices(gpus=[0, 2])


def test_a_pool_with_chosen_gpus_takes_only_runs_that_fit():
    plan = devices.DevicePlan("cuda", 2, "nccl", (0, 2))
    assert plan.mismatch(None, None, None) is None and plan.mismatch(2, "cuda", [0, 2]) is None
    assert plan.mismatch(None, None, [0, 1]) == "2 × cuda 0,2 (nccl), not GPUs 0,1"
    assert devices.DevicePlan("cuda", 2, "nccl").mismatch(None, None, [0, 1]) is None  # the first two, as chosen
    assert devices.DevicePlan("cpu", 2, "gloo").mismatch(None, "cuda", None) == "2 × cpu (gloo), not device 'cuda'"


def test_the_loopback_interface_is_the_one_holding_127_0_0_1():
    import psutil

    name = devices.loopback_interface()
    assert any(address.address == "127.0.0.1" for address in psutil.net_if_addrs()[name])


def test_without_posix_every_start_is_refused_naming_the_way_out(monkeypatch):
    import os

    from flair_nbddp import WorkerPool, launch
    from flair_nbddp.errors import UnsupportedPlatformError

    monkeypatch.delattr(os, "killpg")  # as on Windows
    for attempt in (lambda: launch(print), lambda: WorkerPool(), lambda: resolve_devices("cpu", 2)):
        with pytest.raises(UnsupportedPlatformError, match="needs a POSIX system .* has no killpg. .* WSL 2"):
            attempt()


def test_ranks_sharing_a_gpu_take_it_in_turn_over_gloo(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = resolve_devices("cuda", 4, share_gpus=True)
    assert plan == devices.DevicePlan("cuda", 4, "gloo", (0,)) and plan.shares_gpus
    assert str(plan) == "4 × cuda sharing GPU 0 (gloo)"
    assert [plan.device_for(rank) for rank in range(4)] == ["cuda:0"] * 4
    assert plan.rank_environment(3, 1)["CUDA_VISIBLE_DEVICES"] == "0"
    assert plan.rehearsal_notice() == "rehearsal: 4 ranks share GPU 0 over gloo; speed is not representative"
    assert plan.mismatch(4, "cuda", None) is None and plan.mismatch(None, None, [0]) is None  # a pool of it


def test_chosen_gpus_can_be_shared_round_robin(four_gpus):
    plan = resolve_devices(gpus=[2, 3], processes=4, share_gpus=True)
    assert str(plan) == "4 × cuda sharing GPUs 2,3 (gloo)"
    assert [plan.device_for(rank) for rank in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert plan.rank_environment(0, 1)["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_sharing_changes_nothing_with_a_gpu_per_process_or_on_cpu(four_gpus, monkeypatch):
    assert resolve_devices("cuda", 2, share_gpus=True) == devices.DevicePlan("cuda", 2, "nccl")
    assert resolve_devices(gpus=[1], share_gpus=True) == devices.DevicePlan("cuda", 1, "nccl", (1,))
    assert resolve_devices("cpu", 2, share_gpus=True) == devices.DevicePlan("cpu", 2, "gloo")
    assert devices.DevicePlan("cuda", 2, "nccl").rehearsal_notice() is None
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    assert resolve_devices(processes=2, share_gpus=True) == devices.DevicePlan("cpu", 2, "gloo")


def test_more_ranks_than_gpus_without_sharing_name_the_option(four_gpus):
    with pytest.raises(devices.DeviceError, match="only 4 GPU.*share_gpus=True to rehearse 8 ranks on them over gloo"):
        resolve_devices("cuda", 8)
    with pytest.raises(devices.DeviceError, match="not processes=3: leave processes out, or add share_gpus=True"):
        resolve_devices(gpus=[0, 1], processes=3)
    with pytest.raises(devices.DeviceError, match=r"not processes=1: leave processes out\.$"):
        resolve_devices(gpus=[0, 1], processes=1, share_gpus=True)
