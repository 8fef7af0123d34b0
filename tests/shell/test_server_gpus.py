"""The servers asyncgrpo starts on a GPU host run on GPUs the trainer does not use.

This machine has no GPU: ``fake_cuda_host`` makes torch report some (a fake, named as such;
nothing here touches a device), and the servers are never started.
"""

import dataclasses

import pytest
import torch

from asyncgrpo.adapters.vllm.server import ServerSpec
from asyncgrpo.shell.commands.cli import main
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.servers import local_servers, servers_gpus_for


@pytest.fixture
def fake_cuda_host(monkeypatch):
    """Fake of a CUDA host with ``count`` GPUs (torch's answers only)."""

    def host(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return host


def test_servers_take_the_gpus_after_the_trainers(fake_cuda_host, monkeypatch) -> None:
    fake_cuda_host(4)
    config = AsyncGRPOConfig(output_dir="out")
    assert servers_gpus_for(config, 1) == ("1",)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7,2,3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert servers_gpus_for(config, 2) == ("2", "3")
    assert servers_gpus_for(dataclasses.replace(config, use_cpu=True), 2) is None


def test_without_cuda_the_servers_keep_the_environment() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA host")
    assert servers_gpus_for(AsyncGRPOConfig(output_dir="out"), 2) is None


def test_a_servers_gpu_is_its_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert ServerSpec(model="m", cuda_devices="1").environment()["CUDA_VISIBLE_DEVICES"] == "1"
    assert ServerSpec(model="m").environment()["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_local_servers_need_a_gpu_per_server(tmp_path) -> None:
    servers = local_servers(ServerSpec(model="m"), [(0,), (1,)], tmp_path, gpus=["1"])
    with pytest.raises(ValueError, match="2 servers' cores but 1 GPUs"), servers:
        pass


def test_train_on_a_one_gpu_host_is_refused_before_a_server_starts(
    fake_cuda_host, tmp_path, capsys, monkeypatch
) -> None:
    fake_cuda_host(1)

    def never(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr("asyncgrpo.shell.servers.local_servers", never)
    flags = ["--model", "m", "--dataset", "d.jsonl", "--reward", "a:b"]
    assert main(["train", *flags, "--output_dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "CUDA_VISIBLE_DEVICES" in error and "--vllm_url" in error
