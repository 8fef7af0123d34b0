"""Local servers never run on a GPU the trainer uses (asyncgrpo.core.servers.gpu_plan)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.servers.gpu_plan import GpuPlanError, server_devices, visible_devices

names = st.lists(
    st.one_of(st.integers(0, 15).map(str), st.uuids().map(lambda u: f"GPU-{u}")),
    unique=True,
    max_size=8,
).map(tuple)


@given(names, st.integers(1, 8), st.integers(1, 4))
def test_servers_get_devices_the_trainer_does_not_use_or_the_run_is_refused(
    visible, trainer_processes, servers
) -> None:
    trainer = set(visible[:trainer_processes])
    if len(visible) < trainer_processes + servers:
        with pytest.raises(GpuPlanError, match="CUDA_VISIBLE_DEVICES") as refused:
            server_devices(visible, trainer_processes, servers)
        assert "--vllm_url" in str(refused.value)
        assert f"Make {trainer_processes + servers} GPUs visible" in str(refused.value)
        return
    chosen = server_devices(visible, trainer_processes, servers)
    assert len(chosen) == servers == len(set(chosen))
    assert not trainer & set(chosen)
    assert set(chosen) <= set(visible)


def test_one_gpu_and_one_trainer_process_leave_no_gpu_for_the_server() -> None:
    """The review's case: ``asyncgrpo train`` on a one-GPU host without --vllm_url started vLLM
    on the trainer's GPU at 0.9 of its memory."""
    with pytest.raises(GpuPlanError, match=r"sees 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES: 0\)"):
        server_devices(visible_devices(None, 1), trainer_processes=1, servers=1)


@given(names, st.integers(0, 8))
def test_visible_devices_are_the_variables_first_usable_entries(named, count) -> None:
    assert visible_devices(" , ".join(named), count) == named[:count]
    assert visible_devices(None, count) == tuple(str(i) for i in range(count))
