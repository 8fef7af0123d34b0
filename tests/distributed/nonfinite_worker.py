"""Two optimizer steps at an absurd learning rate on the rows of this rank (``torchrun``,
gloo, CPU), the rows laid out as in :mod:`fsdp_worker` (with 2 processes rank 1 holds nothing
in the second micro-batch): the first step moves the weights by about 1e12, the second's
gradient norm is NaN. Rank 0 saves each step's ``skipped`` on every rank, the weights after
each step and the optimizer's state after each to ``OUT``.

    torchrun --standalone --nproc_per_node=2 tests/distributed/nonfinite_worker.py MODEL OUT
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from fsdp_worker import TOP_K, my_rows

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner

ABSURD_LEARNING_RATE = 1e12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = AsyncGRPOConfig(
        num_sampler_logprobs=TOP_K,
        gradient_accumulation_steps=2,
        seed=0,
        learning_rate=ABSURD_LEARNING_RATE,
    )
    with Learner(load_causal_lm(args.model), config) as learner:
        rows = my_rows(args.model, learner.rank, learner.world_size)
        steps = []
        for _ in range(2):
            out = learner.train_step(rows)
            skipped: list[bool | None] = [None] * learner.world_size
            dist.all_gather_object(skipped, out.skipped)
            optimizer = [
                t.to_local().clone() if hasattr(t, "to_local") else t.clone()
                for state in learner.optimizer.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            ]
            weights = learner.export.full_state_dict()
            steps.append(
                {
                    "skipped": skipped,
                    "weights": weights,
                    "optimizer": optimizer,
                    "grad_norm": out.metrics["grad_norm"],
                }
            )
        if learner.rank == 0:
            torch.save(steps, args.out)
        dist.barrier()


if __name__ == "__main__":
    main()
    # as fsdp_worker: leave without the interpreter's finalisation (gloo's threads)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
