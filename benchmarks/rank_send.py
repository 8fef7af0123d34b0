"""Sending a step's rows from rank 0 to the trainer processes (gloo, CPU): bytes and seconds.

A step with top-k on: every process gets one packed row of ``--samples`` samples (a 128-token
prompt shared by groups of 8, 256-token trained completions), each trained token carrying the
sampler's top ``--top-logprobs`` log-probs and a ``--top-k``-id candidate set, as
``num_sampler_logprobs`` and ``top_k`` give them. Two ways to send it, timed side by side on
``--ranks`` gloo processes:

- ``broadcast``: the whole step (every process's rows) pickled to every process with
  ``broadcast_object_list`` (how ``TrainingRun._next_rows`` sent steps before);
- ``scatter``: a small broadcast of what comes next, then ``scatter_object_list`` hands each
  process only its own rows (how it sends them now).

Bytes are the pickled payload rank 0 sends per step: ``(ranks - 1) x`` the whole step for
``broadcast``; for ``scatter`` ``(ranks - 1) x`` the largest process's rows (gloo's scatter pads
every part to the largest). Seconds are ``perf/send_s`` as the trainer measures it (from before
the send to having the rows, pickling included), the slowest process of each repeat, median
over repeats. The row representation is whatever :mod:`asyncgrpo.core.packing.tree` builds.

    .venv/bin/python benchmarks/rank_send.py
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence

VOCAB = 32_000


def make_row(rank: int, samples: int, top_logprobs: int, top_k: int) -> Any:
    """One process's packed row: groups of 8 sharing a prompt, with sampler tables."""
    rng = np.random.default_rng(rank)
    built = []
    for index in range(samples):
        if index % 8 == 0:
            prompt = rng.integers(10, VOCAB, 128)
        completion = rng.integers(10, VOCAB, 256)
        tokens = np.concatenate([prompt, completion])
        mask = np.r_[np.zeros(128, np.int8), np.ones(256, np.int8)]
        logprobs = np.where(mask == 1, -1.5, 0.0)
        tables: list[dict[int, float] | None] = [None] * 128
        sets: list[list[int] | None] = [None] * 128
        for token in completion:
            ids = [int(token), *rng.integers(10, VOCAB, top_k - 1).tolist()]
            values = np.sort(-rng.exponential(2.0, top_logprobs))[::-1]
            tables.append(dict(zip(ids[:top_logprobs], values.tolist(), strict=True)))
            sets.append(ids)
        sequence = TrainingSequence(tokens, mask, logprobs, sets, tables)
        built.append(TrainingSample(sequence, 1.0, 0, index // 8, 0, 0, f"{rank}-{index}"))
    row = pack_row(built)
    return row.without_sample_tables() if hasattr(row, "without_sample_tables") else row


def send(mode: str, step: list[list[Any]] | None, rank: int, world: int) -> list[Any]:
    """This process's rows of ``step`` (given on rank 0), sent by ``mode``."""
    if mode == "broadcast":
        payload = [step]
        dist.broadcast_object_list(payload, src=0)
        return [mb[rank] for mb in payload[0]]
    control = ["step" if step is not None else None]
    dist.broadcast_object_list(control, src=0)
    per_rank = None if step is None else [[mb[r] for mb in step] for r in range(world)]
    received: list[Any] = [None]
    dist.scatter_object_list(received, per_rank, src=0)
    return received[0]


def worker(rank: int, world: int, init: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    step = None
    if rank == 0:
        step = [[make_row(r, args.samples, args.top_logprobs, args.top_k) for r in range(world)]]
    for mode in ("broadcast", "scatter") * args.repeats:
        dist.barrier()
        start = time.monotonic()
        rows = send(mode, step, rank, world)
        elapsed = time.monotonic() - start
        assert rows[0].num_tokens > 0
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, elapsed)
        if rank == 0:
            queue.put((mode, max(gathered)))
    if rank == 0:
        assert step is not None
        whole = len(pickle.dumps(step))
        own = max(len(pickle.dumps([mb[r] for mb in step])) for r in range(world))
        queue.put(("bytes", (world - 1) * whole, (world - 1) * own))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32, help="samples per process's row")
    parser.add_argument("--top-logprobs", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        mp.spawn(worker, (args.ranks, init, args, queue), nprocs=args.ranks)
    seconds: dict[str, list[float]] = {"broadcast": [], "scatter": []}
    sizes = {}
    while not queue.empty():
        item = queue.get()
        if item[0] == "bytes":
            sizes = {"broadcast": item[1], "scatter": item[2]}
        else:
            seconds[item[0]].append(item[1])
    trained = args.samples * 256
    print(
        f"{args.ranks} ranks, {trained} trained tokens per rank, top-{args.top_logprobs} "
        f"log-probs, top-{args.top_k} candidate sets"
    )
    for mode in ("broadcast", "scatter"):
        print(
            f"{mode:>9}: {sizes[mode] / 1e6:8.2f} MB sent per step, perf/send_s median "
            f"{statistics.median(seconds[mode]):.4f} s over {len(seconds[mode])}"
        )


if __name__ == "__main__":
    main()
