"""Run AsyncGRPOTrainer under torchrun: rank 0 owns the rollout process and sends every rank
its rows (see tests/distributed/test_trainer_ranks.py)."""

import sys

from tiny_run import tiny_run


def main() -> None:
    model, base_url, output_dir = sys.argv[1:4]
    tiny_run(model, base_url, output_dir).train()


if __name__ == "__main__":
    main()
