"""The trainer on 2 processes (torchrun, gloo): rank 0 plans and scatters rows, both ranks
train, sync in memory (the server's gloo engine: rank 0 sends, rank 1 joins the gathers),
checkpoint and save together, and parity at staleness 0 holds. The run (:func:`one_node_run`,
tests/distributed/conftest.py) is shared with tests/distributed/test_trainer_nodes.py."""

import json

from asyncgrpo.shell.run import checkpoints, read_metrics


def test_two_ranks_train_sync_and_checkpoint(served, one_node_run) -> None:
    output_dir, log = one_node_run.output_dir, one_node_run.log_tail(3000)
    rows = read_metrics(output_dir)
    assert [r["step"] for r in rows] == [1, 2, 3], log
    for row in rows:
        assert row["batch/microbatches_per_step"] == 1, row
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, (row, log)
    assert (output_dir / "checkpoint-3" / "rollout_state.json").exists()
    # rank 0 lists every process's files, written before it writes the rollout state
    state = json.loads((output_dir / "checkpoint-3" / "rollout_state.json").read_text())
    assert {"rng_state_1.pth", "dcp/__1_0.distcp"} <= state["files"].keys(), state["files"]
    checkpoints.check_loads(output_dir / "checkpoint-3")
    assert (output_dir / "model.safetensors").exists()
