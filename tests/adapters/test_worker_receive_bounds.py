"""A server's worker is never left blocked in a weight receive whose trainer is gone.

The engines are asyncgrpo's real gloo engines, the worker's in a process of its own. What
stands around the worker's engine is a fake of vLLM's server (``FakeWorkerServer``): it runs
the engine's calls one at a time, as vLLM's worker runs its RPCs, and answers them over a
local socket. A trainer that fails or dies mid-send must leave the worker free at once: the
next trainer's handshake would otherwise queue behind a receive that waits out the whole
``weight_sync_timeout``.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Client, Listener
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncgrpo.adapters.transfer.gloo import (
    GlooTrainerWeightTransferEngine,
    GlooWeightTransferEngine,
    trainer_init_info,
)
from asyncgrpo.adapters.vllm.server import free_port

AUTH = b"asyncgrpo-test"
TIMEOUT_S = 120.0  # weight_sync_timeout of the group: each bound below is far under it
BOUND_S = 30.0
CHUNK_BYTES = 16  # a chunk per tensor (16 bytes each): a send can stop between chunks


class RecordingModel(torch.nn.Module):
    """The worker's model: keeps the last value loaded under each name."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, list[float]] = {}

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.loaded[name] = tensor.tolist()


def _serve_engine(address_out: Any) -> None:
    """FakeWorkerServer: one real :class:`GlooWeightTransferEngine` whose calls run one at a
    time (as vLLM's worker runs its RPCs), each asked over a connection of its own."""
    model = RecordingModel()
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
    engine = GlooWeightTransferEngine(None, vllm_config, torch.device("cpu"), model)
    serial = threading.Lock()
    listener = Listener(("127.0.0.1", 0), authkey=AUTH)
    address_out.send(listener.address)

    def answer(conn: Any) -> None:
        with conn:
            method, payload = conn.recv()
            with serial:
                try:
                    if method == "init_weight_transfer_engine":
                        engine.init_transfer_engine(engine.parse_init_info(payload))
                    elif method == "update_weights":
                        engine.update_weights(payload)
                    elif method == "loaded":
                        conn.send(("ok", dict(model.loaded)))
                        return
                    conn.send(("ok", None))
                except Exception as error:
                    conn.send(("error", f"{type(error).__name__}: {error}"))

    while True:
        threading.Thread(target=answer, args=(listener.accept(),), daemon=True).start()


class FakeServerClient:
    """Fake of vLLM's HTTP weight-sync client: each call asks the fake worker server."""

    def __init__(self, address: Any) -> None:
        self.address = address

    def _ask(self, method: str, payload: Any = None) -> Any:
        with Client(self.address, authkey=AUTH) as conn:
            conn.send((method, payload))
            status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"the server answered {method} with {value}")
        return value

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._ask("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._ask("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def loaded(self) -> dict[str, list[float]]:
        return self._ask("loaded")


class Weights:
    """A WeightSource of four tensors of value ``value``; with ``stop_after``, the round stops
    after that many tensors: ``"raise"`` raises, ``"hang"`` blocks (and says so in ``held``)."""

    def __init__(self, value: float, stop_after: int | None = None, how: str = "raise") -> None:
        self.pairs = [(f"w{i}", torch.full((4,), value + i)) for i in range(4)]
        self.stop_after = stop_after
        self.how = how
        self.held = threading.Event()

    def metadata(self) -> list[Any]:
        return [SimpleNamespace(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, pair in enumerate(self.pairs):
            if index == self.stop_after:
                if self.how == "raise":
                    raise ValueError("the trainer's side refused the rest of the round")
                self.held.set()
                time.sleep(3600)
            yield pair


def join(address: Any, source: Weights, timeout_s: float = TIMEOUT_S) -> Any:
    info = trainer_init_info("127.0.0.1", free_port(), 2, 0, timeout_s)
    info.chunk_bytes = CHUNK_BYTES
    return GlooTrainerWeightTransferEngine.trainer_init(
        info, client=FakeServerClient(address), source=source
    )


@pytest.fixture
def worker():
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve_engine, args=(theirs,), daemon=True)
    process.start()
    try:
        assert ours.poll(60), "the fake worker server did not start"
        yield ours.recv()
    finally:
        process.kill()
        process.join(10)


def next_trainer_lands(address: Any) -> float:
    """Seconds a new trainer takes to join and push a whole round (checked on the worker)."""
    start = time.monotonic()
    engine = join(address, Weights(10.0), timeout_s=BOUND_S)
    engine.send_weights()
    took = time.monotonic() - start
    engine.shutdown()
    assert FakeServerClient(address).loaded() == {f"w{i}": [10.0 + i] * 4 for i in range(4)}
    return took


def test_a_send_that_fails_midway_frees_the_worker_though_the_trainer_keeps_its_error(
    worker,
) -> None:
    engine = join(worker, Weights(1.0, stop_after=2))
    with pytest.raises(ValueError, match="refused the rest") as kept:  # a run keeps its error
        engine.send_weights()
    assert next_trainer_lands(worker) < BOUND_S
    assert kept.value.__traceback__ is not None


def _trainer_until_killed(address: Any, held: Any) -> None:
    source = Weights(1.0, stop_after=2, how="hang")
    engine = join(address, source)
    threading.Thread(target=lambda: (source.held.wait(), held.set()), daemon=True).start()
    engine.send_weights()


def test_a_trainer_killed_mid_send_leaves_the_worker_to_the_next_trainer(worker) -> None:
    context = mp.get_context("spawn")
    held = context.Event()
    trainer = context.Process(target=_trainer_until_killed, args=(worker, held), daemon=True)
    trainer.start()
    try:
        assert held.wait(60), "the first trainer did not start its round"
    finally:
        trainer.kill()
        trainer.join(10)
    assert next_trainer_lands(worker) < BOUND_S
