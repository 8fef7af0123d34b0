"""Run AsyncGRPOTrainer under torchrun: rank 0 owns the rollout process and sends every rank
its rows (tests/distributed/test_trainer_ranks.py, test_trainer_nodes.py).

    torchrun ... trainer_worker.py MODEL BASE_URL OUTPUT_DIR [--identity-dir DIR]
                                   [--cpu-sharing auto|off]

With ``--identity-dir``, each process first writes ``rank-<RANK>.json`` there: what torchrun
told it (``RANK``, ``GROUP_RANK`` (its node), ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``), its pid and its parent's (its node's torchrun agent), so that a test
can tell which node each rank ran on. ``--cpu-sharing`` sets the config's ``cpu_sharing``.
"""

import argparse
import json
import os
from pathlib import Path

from tiny_run import tiny_run

LAUNCH_VARIABLES = ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def write_identity(directory: Path) -> None:
    """This process's place in the launch, as ``directory/rank-<RANK>.json``."""
    identity = {name: int(os.environ[name]) for name in LAUNCH_VARIABLES}
    identity |= {"pid": os.getpid(), "agent_pid": os.getppid()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank-{identity['RANK']}.json").write_text(json.dumps(identity))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("base_url")
    parser.add_argument("output_dir")
    parser.add_argument("--identity-dir", type=Path)
    parser.add_argument("--cpu-sharing", default="auto")
    args = parser.parse_args()
    if args.identity_dir is not None:
        write_identity(args.identity_dir)
    tiny_run(args.model, args.base_url, args.output_dir, cpu_sharing=args.cpu_sharing).train()


if __name__ == "__main__":
    main()
