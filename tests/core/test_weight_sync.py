"""The weight-sync path decision: properties over every request, server and device."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.weights.sync import (
    AUTO,
    DISK,
    GLOO,
    NCCL,
    WEIGHT_TRANSFER_BACKENDS,
    choose_weight_transfer,
    chunk_bounds,
)

requests = st.sampled_from(WEIGHT_TRANSFER_BACKENDS)
servers = st.sampled_from([None, NCCL, GLOO, "ipc", "sparse_nccl"])


@given(requests, servers, st.booleans())
def test_a_chosen_engine_is_one_the_server_runs_and_the_trainer_can_drive(
    requested, server, cuda
) -> None:
    try:
        choice = choose_weight_transfer(requested, server, cuda)
    except ValueError as error:
        assert requested in (NCCL, GLOO) and "weight_transfer_backend" in str(error)
        return
    assert choice.backend in (DISK, NCCL, GLOO) and choice.reason
    if choice.backend != DISK:
        assert choice.backend == server
    if choice.backend == NCCL:
        assert cuda


@given(servers, st.booleans())
def test_auto_never_fails_and_disk_is_always_disk(server, cuda) -> None:
    choose_weight_transfer(AUTO, server, cuda)
    assert choose_weight_transfer(DISK, server, cuda).backend == DISK


@given(st.sampled_from([NCCL, GLOO]), st.booleans())
def test_auto_uses_a_drivable_engine_when_there_is_one(server, cuda) -> None:
    drivable = server == GLOO or cuda
    assert (choose_weight_transfer(AUTO, server, cuda).backend == server) == drivable


def test_a_mismatch_names_the_server_flag_and_an_unknown_value_is_rejected() -> None:
    with pytest.raises(ValueError, match="--weight-transfer-config"):
        choose_weight_transfer(NCCL, GLOO, trainer_on_cuda=True)
    with pytest.raises(ValueError, match="needs the trainer on a CUDA device"):
        choose_weight_transfer(NCCL, NCCL, trainer_on_cuda=False)
    with pytest.raises(ValueError, match="must be one of"):
        choose_weight_transfer("shm", GLOO, trainer_on_cuda=False)


@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 120))
def test_chunks_cover_every_tensor_once_in_order_and_are_as_full_as_allowed(sizes, limit) -> None:
    bounds = chunk_bounds(sizes, limit)
    assert [i for start, stop in bounds for i in range(start, stop)] == list(range(len(sizes)))
    for number, (start, stop) in enumerate(bounds):
        assert stop > start
        filled = sum(sizes[start:stop])
        assert filled <= limit or stop - start == 1
        if number + 1 < len(bounds):
            assert filled + sizes[stop] > limit
