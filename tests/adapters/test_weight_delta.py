"""Delta weight pushes (``weight_sync_delta``) without a server: the patches the trainer
computes, applied as the server applies them to the policy it kept, give bit for bit the
weights a full push gives, and the checksums catch a patch gone missing; and which server
gets a delta and which the full policy. The real server takes its patches in
``test_engine_transfer.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.adapters.transfer.delta import (
    DeltaEncoder,
    KeptPolicy,
    Patch,
    checksum,
    checksum_update,
)
from asyncgrpo.adapters.transfer.files import SyncTimings
from asyncgrpo.core.weights import delta
from asyncgrpo.core.weights.sync import GLOO
from asyncgrpo.shell.weights.paths import EngineWeights, Snapshot

SHAPES = {"embed": (64, 16), "q_proj": (16, 16), "norm": (16,), "bias": (3,)}


def applied(kept: KeptPolicy, patches: list[Patch]) -> list[str]:
    """What the server does with a round's patches: each applied to the policy it kept; the
    names whose checksum then differs from the trainer's."""
    return [patch.name for patch in patches if kept.apply(patch) != patch.checksum]


def policy(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).to(dtype) for name, shape in SHAPES.items()
    }


def stepped(weights: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """Each element moved by a small step with probability ``share`` (an optimizer step that
    crosses a rounding boundary of the server's dtype for some elements only)."""
    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name, tensor in weights.items():
        mask = torch.rand(tensor.shape, generator=generator) < share
        step = torch.randn(tensor.shape, generator=generator) * 0.05
        moved[name] = torch.where(mask, (tensor.float() + step).to(tensor.dtype), tensor)
    return moved


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a
    )


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
    shares=st.lists(st.sampled_from([0.0, 0.002, 0.05, 0.6, 1.0]), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_patches_after_n_pushes_give_the_weights_bit_for_bit(dtype, shares, seed) -> None:
    """After any number of delta pushes (sparse, dense and unchanged tensors mixed), the
    server's policy is exactly the trainer's last weights, every checksum agreeing; without a
    tensor's patch it is not, and the next patch of that tensor fails its checksum."""
    weights = policy(dtype, seed)
    server = KeptPolicy(weights.items())
    encoder = DeltaEncoder()
    encoder.remember(weights.items())
    last_patches: list[Patch] = []
    for round_index, share in enumerate(shares):
        before = weights
        weights = stepped(weights, share, seed + round_index + 1)
        last_patches, stats = encoder.encode(weights.items())
        assert applied(server, last_patches) == []
        differing = sum(int((before[n] != weights[n]).sum()) for n in weights)
        assert stats.changed_elements == differing
        assert stats.sent_bytes <= stats.full_bytes
        assert {p.name for p in last_patches} == {
            n for n in weights if not torch.equal(before[n], weights[n])
        }
    assert bits_equal(server.tensors, weights)
    assert bits_equal(encoder.previous, weights)
    assert server.sums == {name: checksum(tensor) for name, tensor in weights.items()}
    sparse = [p for p in last_patches if p.indices is not None]
    if sparse:  # control: a server whose copy went astray where the last round writes
        astray = KeptPolicy(before.items())
        astray.tensors[sparse[0].name].view(-1)[sparse[0].indices[0]] += 1
        assert applied(astray, last_patches) == [sparse[0].name]
    if last_patches:  # control: a server that missed the last round
        assert not bits_equal(before, weights)


class FakeServerEngine:
    """Fake of one server's :class:`EngineSync` (a push to several servers needs several
    servers): records what each push sent it, and fails when told to."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.fails = False

    def _landed(self, kind: str) -> SyncTimings:
        if self.fails:
            raise ConnectionResetError("the server went away")
        self.got.append(kind)
        return SyncTimings(pause_s=0.0, barrier_s=0.0, transfer_s=0.0)

    def send_patches(self, patches) -> SyncTimings:
        return self._landed("delta")

    def keep_baseline(self) -> None:
        pass

    def send_snapshot(self, weights, ready=None) -> SyncTimings:
        return self._landed("full")


def test_only_a_server_that_holds_the_last_push_gets_a_delta() -> None:
    """The first push is full everywhere; then a server gets a delta only while every push
    since it joined landed on it: one a push failed on, one a push went without (out of
    routing) and one that reconnected get the full policy once, then deltas again."""
    weights = EngineWeights(
        learner=None,
        args=SimpleNamespace(server_urls=["a", "b", "c"], weight_sync_delta=True),
        client=None,
        backend=GLOO,
        server_workers=1,
    )
    engines = {i: FakeServerEngine() for i in range(3)}
    weights.engines = engines  # type: ignore[assignment]
    weights._close = lambda index: None  # type: ignore[method-assign]
    weights._start = lambda index: None  # type: ignore[method-assign]
    state = policy(torch.bfloat16, 0)

    def push(servers=(0, 1, 2)):
        nonlocal state
        state = stepped(state, 0.01, len(engines[0].got))
        landing = weights.send(Snapshot(1, dict(state)), servers=servers)
        return {i: type(outcome).__name__ for i, outcome in landing.items()}

    push()
    assert [e.got for e in engines.values()] == [["full"]] * 3
    engines[1].fails = True
    assert push()[1] == "ConnectionResetError"
    engines[1].fails = False
    push(servers=(0, 1))  # server 2 is out of routing
    push()
    weights.reconnect(servers=(0,))
    push()
    assert engines[0].got == ["full", "delta", "delta", "delta", "full"]
    assert engines[1].got == ["full", "full", "delta", "delta"]
    assert engines[2].got == ["full", "delta", "full", "delta"]


def test_delta_is_refused_where_it_cannot_be_written_in_place() -> None:
    assert delta.delta_refusal(GLOO, is_peft=False) is None
    for backend, peft, named in [
        ("disk", False, "weight_transfer_backend='asyncgrpo_gloo'"),
        ("nccl", False, "the nccl path"),
        (GLOO, True, "peft_config"),
    ]:
        refusal = delta.delta_refusal(backend, peft)
        assert refusal is not None and named in refusal and "weight_sync_delta=False" in refusal


@settings(max_examples=50, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16, torch.int64]),
    numel=st.integers(1, 300),
    data=st.data(),
)
def test_a_checksum_kept_from_the_changes_alone_equals_one_computed_in_full(
    dtype, numel, data
) -> None:
    old = (torch.randn(numel) * 100).to(dtype)
    where = torch.tensor(
        sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=numel))), dtype=torch.int64
    )
    new = old.clone()
    new[where] = (torch.randn(where.numel()) * 100).to(dtype)
    assert checksum_update(checksum(old), old[where], new[where], where) == checksum(new)
    if where.numel() and not torch.equal(old, new):  # control: a change left out
        assert checksum_update(checksum(old), old[where[:0]], new[where[:0]], where[:0]) != (
            checksum(new)
        )
