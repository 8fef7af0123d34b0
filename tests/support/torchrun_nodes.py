"""Run ``tests/distributed/trainer_worker.py`` under torchrun, on one node or on several
(one torchrun agent per node, all on this host), and collect what the run left: its output
directory, each rank's launch identity, each node's log, and any process of it still running.
Used by tests/distributed/conftest.py's :func:`one_node_run` and
tests/distributed/test_trainer_nodes.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import psutil
from processes import alive_after, described, kill_all

WORKER = Path(__file__).parents[1] / "distributed" / "trainer_worker.py"
RUN_TIMEOUT_S = 600.0  # 24 s alone (docs/testing.md), 107-117 s beside other work: generous
GONE_TIMEOUT_S = 30.0


@attrs.frozen
class TrainerRun:
    """A finished torchrun run of ``trainer_worker.py``.

    Attributes:
        output_dir: the trainer's ``output_dir`` (metrics, checkpoints, ``model.safetensors``).
        identities: each rank's launch identity, by rank (``trainer_worker.write_identity``).
        agents: the pid of each node's torchrun agent, in launch order.
        logs: each node's output (stdout and stderr), in launch order.
        left: processes of the run still running after it ended ("pid command"; empty).
        seconds: wall time from the first launch to the last node's exit, s.
    """

    output_dir: Path
    identities: dict[int, dict[str, int]]
    agents: tuple[int, ...]
    logs: tuple[str, ...]
    left: tuple[str, ...]
    seconds: float

    def log_tail(self, chars: int = 4000) -> str:
        return "\n".join(f"--- node {i}\n{log[-chars:]}" for i, log in enumerate(self.logs))


def two_node_options(port: int) -> list[list[str]]:
    """Each node's torchrun options: node 0 hosts the rendezvous store at 127.0.0.1:``port``
    (``is_host``, stated, not inferred from the address, which is this host's for both)."""
    options = []
    for node in range(2):
        options.append(
            [
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id=two-nodes-{port}",
                f"--rdzv_conf=is_host={int(node == 0)},join_timeout=300",
                "--local_addr=127.0.0.1",
                "--max_restarts=0",
            ]
        )
    return options


def run_trainer(
    node_options: list[list[str]],
    model: Path,
    base_url: str,
    directory: Path,
    worker_options: tuple[str, ...] = (),
) -> TrainerRun:
    """Start one torchrun agent per entry of ``node_options`` (its launch options), all at
    once, each running ``trainer_worker.py`` (with ``worker_options``) for the same run in
    ``directory``; wait for all of them. Every process of the run is killed on the way out,
    whatever happened (each agent starts its workers in sessions of their own, so they are
    tracked by pid while the run goes on: a node that dies leaves no orphan). Fails naming
    the nodes' output when a node fails or the run outlasts ``RUN_TIMEOUT_S``."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    arguments = [
        str(WORKER),
        str(model),
        base_url,
        str(directory / "run"),
        "--identity-dir",
        str(directory / "identity"),
        *worker_options,
    ]
    log_paths = [directory / f"node-{i}.log" for i in range(len(node_options))]
    agents: list[subprocess.Popen] = []
    seen: dict[int, psutil.Process] = {}
    start = time.monotonic()
    try:
        for options, log_path in zip(node_options, log_paths, strict=True):
            command = [sys.executable, "-m", "torch.distributed.run", *options, *arguments]
            with log_path.open("w") as log:
                agents.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        while any(agent.poll() is None for agent in agents):
            if time.monotonic() - start > RUN_TIMEOUT_S:
                break
            for agent in agents:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(agent.pid).children(recursive=True):
                        seen.setdefault(child.pid, child)
            time.sleep(0.2)
        seconds = time.monotonic() - start
        codes = [agent.poll() for agent in agents]
        running = [] if None in codes else alive_after(list(seen.values()), GONE_TIMEOUT_S)
        left = tuple(map(described, running))
    finally:
        kill_all([*seen.values(), *(psutil.Process(a.pid) for a in agents if a.poll() is None)])
        for agent in agents:
            agent.wait(timeout=GONE_TIMEOUT_S)
    logs = tuple(path.read_text() for path in log_paths)
    run = TrainerRun(
        directory / "run",
        read_identities(directory / "identity"),
        tuple(agent.pid for agent in agents),
        logs,
        left,
        seconds,
    )
    assert None not in codes, f"the run outlasted {RUN_TIMEOUT_S} s:\n{run.log_tail()}"
    assert codes == [0] * len(agents), f"exit codes {codes}:\n{run.log_tail()}"
    return run


def read_identities(directory: Path) -> dict[int, dict[str, int]]:
    identities = [json.loads(path.read_text()) for path in sorted(directory.glob("rank-*.json"))]
    return {identity["RANK"]: identity for identity in identities}
