"""One FSDP2 training step on the rows of this rank, run by ``torchrun`` (gloo, CPU).

The same micro-batches are laid out for any number of processes: with 2, rank 0 holds groups
0 and 2 and rank 1 holds group 1 (and nothing in the second micro-batch); with 1, the process
holds every group of a micro-batch in one row. Each micro-batch has the same global trained
tokens either way, so the updated weights must agree. Rank 0 saves the full state dict and the
step's metrics to ``--out``, each rank the attention backend it runs to
``--out.backend-<rank>`` (with ``RANK_BACKENDS=a,b`` each rank's own choice would differ) and
whether each of its object collectives ran on the control group to
``--out.object-collectives-<rank>``. With ``RANKS_ON_META=1`` the ranks after rank 0 build the
model on the meta device, as ``AsyncGRPOTrainer`` does under torchrun, and get their shards of
rank 0's weights from the learner.

    torchrun --standalone --nproc_per_node=2 tests/distributed/fsdp_worker.py MODEL OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from on_policy import on_policy

from asyncgrpo.adapters.kernels.backends import BackendChoice
from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.adapters.process_group import control_group
from asyncgrpo.core.packing.memory import LINEAR
from asyncgrpo.core.packing.tree import PackedRow, pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.learner import learner as learner_module

TOP_K = 4
GROUPS = {
    0: ([11, 12, 13, 14], [[21, 22, 23], [21, 24], [25, 26, 27, 28]], [1.0, -0.5, -0.5]),
    1: ([15, 16, 17], [[31, 32], [33, 34, 35]], [0.7, -0.7]),
    2: ([18, 19, 20, 21, 22], [[41, 42, 43], [41, 42, 44], [45]], [1.2, 0.3, -1.5]),
}
# per micro-batch, the groups of each rank (by world size)
LAYOUT = {
    1: [[[0, 1]], [[2]]],
    2: [[[0], [1]], [[2], []]],
}


def group_samples(group: int) -> list[TrainingSample]:
    prompt, completions, advantages = GROUPS[group]
    samples = []
    for member, (tokens, advantage) in enumerate(zip(completions, advantages, strict=True)):
        ids = prompt + tokens
        mask = [0] * len(prompt) + [1] * len(tokens)
        sequence = TrainingSequence(ids, mask, [-1.0 if m else 0.0 for m in mask])
        rollout = f"{group}-{member}"
        samples.append(TrainingSample(sequence, advantage, 0, group, group, group, rollout))
    return samples


def my_rows(model_path: str, rank: int, world_size: int) -> list[PackedRow | None]:
    stock = load_causal_lm(model_path)
    rows: list[PackedRow | None] = []
    for micro_batch in LAYOUT[world_size]:
        groups = micro_batch[rank]
        samples = [on_policy(stock, s, TOP_K) for g in groups for s in group_samples(g)]
        rows.append(pack_row(samples) if samples else None)
    return rows


def recording_object_collectives() -> list:
    """The group every object collective of this process is given, in order, from now on."""
    groups: list = []
    for name in ("all_gather_object", "broadcast_object_list", "scatter_object_list"):
        collective = getattr(dist, name)

        def recorded(*args, __collective=collective, group=None, **kwargs):
            groups.append(group)
            return __collective(*args, group=group, **kwargs)

        setattr(dist, name, recorded)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    object_collectives = recording_object_collectives()
    if os.environ.get("RANK_BACKENDS"):  # each rank would choose its own attention backend
        chosen = os.environ["RANK_BACKENDS"].split(",")[int(os.environ["RANK"])]
        learner_module.choose_backend = lambda device, requested, shape: BackendChoice(
            chosen, LINEAR, f"rank {os.environ['RANK']}'s own choice"
        )
    config = AsyncGRPOConfig(num_sampler_logprobs=TOP_K, gradient_accumulation_steps=2, seed=0)
    on_meta = os.environ.get("RANKS_ON_META") == "1" and int(os.environ["RANK"]) > 0
    model = load_causal_lm(args.model, on_meta=on_meta)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with Learner(model, config, optimizers=(optimizer, None)) as learner:
        rows = my_rows(args.model, learner.rank, learner.world_size)
        metrics = learner.train_step(rows).metrics
        weights = learner.export.full_state_dict()
        Path(f"{args.out}.backend-{learner.rank}").write_text(str(learner.attention.backend))
        on_control = [group is control_group() for group in object_collectives]
        Path(f"{args.out}.object-collectives-{learner.rank}").write_text(json.dumps(on_control))
        if learner.rank == 0:
            torch.save({"weights": weights, "metrics": metrics}, args.out)
        dist.barrier()


if __name__ == "__main__":
    main()
    # The group is destroyed and the results are written. Leave without the interpreter's
    # finalisation: there, gloo's worker threads can still be torn down with the objects that
    # hold them and abort the process ("terminate called without an active exception", seen
    # once in CI on rank 1 after a passing run; pytorch/pytorch#190489 describes the mechanism).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
