"""AsyncGRPOTrainer on 2 processes (torchrun) whose server dies during a weight push: rank 0
announces the push after step 1 at a kill point (before or while streaming) and waits until
the test has killed the server (see tests/distributed/test_push_death.py).

Arguments: model, server URL, output dir, signal dir, vllm_server_timeout (s), kill point
(a key of :data:`KILL_POINTS`). Files in the
signal dir: ``push-started`` (written here), ``server-killed`` (written by the test), and
``outcome-<rank>`` (how ``train()`` ended on this rank: ``ok`` or the exception's type and
message)."""

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tiny_run import tiny_run

from asyncgrpo.adapters.transfer.engine import ResumingWeightSyncClient, WeightStream

KILLED_TIMEOUT_S = 120.0
PUSH_THAT_DIES = 2  # the first push (before step 1) must find the server; the next one dies


def hand_over(signals: Path) -> None:
    """Tell the test the push is under way and wait until it has killed the server."""
    (signals / "push-started").write_text("")
    deadline = time.monotonic() + KILLED_TIMEOUT_S
    while not (signals / "server-killed").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not kill the server in {KILLED_TIMEOUT_S} s")
        time.sleep(0.05)


def die_before_streaming(signals: Path) -> None:
    """Rank 0's ``/start_weight_update`` of push :data:`PUSH_THAT_DIES` (the server paused,
    rank 1 in the round's first gather) first hands over to the test (a test hook)."""
    start = ResumingWeightSyncClient.start_weight_update
    calls = 0

    def announced(self: ResumingWeightSyncClient) -> None:
        nonlocal calls
        calls += 1
        if calls == PUSH_THAT_DIES:
            hand_over(signals)
        start(self)

    ResumingWeightSyncClient.start_weight_update = announced


def die_while_streaming(signals: Path) -> None:
    """Rank 0's round of push :data:`PUSH_THAT_DIES` hands over to the test after its first
    tensor (the server's update session open and receiving; both ranks gathering)."""
    rounds = WeightStream.__iter__
    calls = 0

    def announced(self: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal calls
        calls += 1
        weights = rounds(self)
        if calls != PUSH_THAT_DIES:
            return weights

        def first_then_hand_over() -> Iterator[tuple[str, torch.Tensor]]:
            yield next(weights)
            hand_over(signals)
            yield from weights

        return first_then_hand_over()

    WeightStream.__iter__ = announced


KILL_POINTS = {"before-streaming": die_before_streaming, "while-streaming": die_while_streaming}


def main() -> None:
    model, base_url, output_dir, signal_dir, server_timeout, kill_point = sys.argv[1:7]
    signals, rank = Path(signal_dir), int(os.environ["RANK"])
    if rank == 0:
        KILL_POINTS[kill_point](signals)
    trainer = tiny_run(model, base_url, output_dir, save_steps=1000,
                       vllm_server_timeout=float(server_timeout))  # fmt: skip
    outcome = signals / f"outcome-{rank}"
    try:
        trainer.train()
    except BaseException as error:
        outcome.write_text(f"{type(error).__name__}: {error}")
        raise
    outcome.write_text("ok")


if __name__ == "__main__":
    main()
