import socket

import pytest

from flair_nbddp import devices
from flair_nbddp.devices import DEVICE_ENV, PROCESSES_ENV, resolve_devices


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
