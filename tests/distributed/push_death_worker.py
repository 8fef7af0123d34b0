"""AsyncGRPOTrainer on 2 processes (torchrun) whose server dies during weight pushes: rank 0
announces each push the test is to kill at its kill point (before or while streaming) and
waits until the test has killed the server (see tests/distributed/test_push_death.py).

Arguments: model, server URL, output dir, signal dir, vllm_server_timeout (s), kill points
(comma-separated, each one of :data:`KILL_POINTS`: the first kills push 2, the one after step
1). Files in the signal dir, for kill ``n`` from 1: ``push-started-<n>`` (written here),
``server-killed-<n>`` (written by the test); and ``outcome-<rank>`` (how ``train()`` ended on
this rank: ``ok`` or the exception's type and message)."""

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tiny_run import tiny_run

from asyncgrpo.adapters.transfer.engine import ResumingWeightSyncClient, WeightStream

KILLED_TIMEOUT_S = 120.0


def hand_over(signals: Path, number: int) -> None:
    """Tell the test push ``number`` is under way and wait until it has killed the server."""
    (signals / f"push-started-{number}").write_text("")
    deadline = time.monotonic() + KILLED_TIMEOUT_S
    while not (signals / f"server-killed-{number}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not kill the server in {KILLED_TIMEOUT_S} s")
        time.sleep(0.05)


def die_at(signals: Path, kill_points: list[str]) -> None:
    """Rank 0 hands over to the test at each of ``kill_points`` in turn (test hooks):
    ``before-streaming`` at its ``/start_weight_update`` (the server paused, rank 1 in the
    round's first gather), ``while-streaming`` after the round's first tensor (the server's
    update session open and receiving; both ranks gathering). Kill ``n`` (from 1) is armed
    once rank 0 has started ``2n`` pushes: the first push (before step 1) finds the server,
    and each killed push is made again once before the next kill."""
    start, rounds = ResumingWeightSyncClient.start_weight_update, WeightStream.__iter__
    pending = list(enumerate(kill_points, start=1))
    starts = 0

    def due(point: str) -> int | None:
        if pending and pending[0][1] == point and starts >= 2 * pending[0][0]:
            return pending.pop(0)[0]
        return None

    def announced_start(self: ResumingWeightSyncClient) -> None:
        nonlocal starts
        starts += 1
        if (number := due("before-streaming")) is not None:
            hand_over(signals, number)
        start(self)

    def announced_rounds(self: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        weights = rounds(self)
        if (number := due("while-streaming")) is None:
            return weights

        def first_then_hand_over() -> Iterator[tuple[str, torch.Tensor]]:
            yield next(weights)
            hand_over(signals, number)
            yield from weights

        return first_then_hand_over()

    ResumingWeightSyncClient.start_weight_update = announced_start
    WeightStream.__iter__ = announced_rounds


KILL_POINTS = ("before-streaming", "while-streaming")


def main() -> None:
    model, base_url, output_dir, signal_dir, server_timeout, kill_points = sys.argv[1:7]
    signals, rank = Path(signal_dir), int(os.environ["RANK"])
    points = kill_points.split(",")
    if unknown := set(points) - set(KILL_POINTS):
        raise ValueError(f"kill points {sorted(unknown)}: not among {KILL_POINTS}")
    if rank == 0:
        die_at(signals, points)
    trainer = tiny_run(
        model,
        base_url,
        output_dir,
        save_steps=1000,
        vllm_server_timeout=float(server_timeout),
        weight_sync_timeout=float(server_timeout),  # a send to the killed server is bounded alike
    )
    outcome = signals / f"outcome-{rank}"
    try:
        trainer.train()
    except BaseException as error:
        outcome.write_text(f"{type(error).__name__}: {error}")
        raise
    outcome.write_text("ok")


if __name__ == "__main__":
    main()
