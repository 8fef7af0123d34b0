r"""The real model learns through a harness: the real demo's task as OpenEnv sessions, held-out
accuracy before and after, over seeds.

:class:`asyncgrpo.HarnessAsyncGRPOTrainer` trains SmolLM2-135M-Instruct with the real demo's
settings (:func:`asyncgrpo.shell.commands.real_demo.real_demo_config`, its server settings,
one server for every run on the core the CPU plan gives it) on its arithmetic problems, but
each rollout is an OpenEnv session: ``initial_messages()`` is the problem, OpenEnv's
``MCPHarnessAdapter`` runs the conversation (white-box; the session serves no tools, since the
model's chat template has none, so a rollout is one turn), and ``verify()`` scores the reply
(:func:`asyncgrpo.tasks.answer_reward` against the row's answer). No reward function is given:
the session's reward is the only one. The held-out split (58 problems) goes through the same
sessions, greedily, at the start and every 10 steps.

Printed per seed: held-out accuracy at each evaluation with its 90% interval over problems,
the samples trained and the median step's seconds; then the held-out gain's median over seeds
with its 90% bootstrap interval. Regime: as the real demo's on the same CPU (docs/benchmarks.md).
::

    .venv/bin/python benchmarks/harness_real_model.py --output-dir runs/harness-real
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from openenv.core.harness import ResourceSession, ResourceSessionFactory, VerifyResult


class ArithmeticSession(ResourceSession):
    """One problem: its messages, no tools, and the answer's check."""

    def __init__(self, task: dict[str, Any]) -> None:
        self.task = task

    def initial_messages(self) -> list[dict[str, Any]]:
        return list(self.task["prompt"])

    def list_tools(self) -> list[Any]:
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        raise KeyError(f"this task serves no tools, not {name}")

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        from asyncgrpo.tasks import answer_reward

        [reward] = answer_reward([transcript[-1:]], [self.task["answer"]])
        return VerifyResult(env_reward=reward, done=True)

    def close(self) -> None:
        pass


class ArithmeticSessions(ResourceSessionFactory[ArithmeticSession]):
    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> ArithmeticSession:
        return ArithmeticSession(dict(task))


def main() -> None:
    from openenv.core.harness import MCPHarnessAdapter

    from asyncgrpo import HarnessAsyncGRPOTrainer
    from asyncgrpo.adapters.models.packaged import resolve_model
    from asyncgrpo.adapters.vllm.auth import new_api_key
    from asyncgrpo.core.experiments.stats import bootstrap_interval
    from asyncgrpo.shell.commands.real_demo import (
        held_out_problems,
        real_demo_config,
        real_demo_server,
        train_problems,
    )
    from asyncgrpo.shell.run import EVALUATIONS_FILE, read_metrics
    from asyncgrpo.shell.servers import local_servers, servers_cpus_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model("smollm2-135m"))
    key = new_api_key()
    config = real_demo_config(out, args.steps, "http://127.0.0.1")
    spec = real_demo_server(model, config, api_key=key)
    gains, lines = [], []
    with local_servers(spec, servers_cpus_for(config, 1), out) as servers:
        for seed in (int(s) for s in args.seeds.split(",")):
            run_dir = out / f"seed-{seed}"
            run_args = dataclasses.replace(
                config,
                output_dir=str(run_dir),
                seed=seed,
                vllm_server_base_url=servers[0].base_url,
                vllm_server_api_key=key,
            )
            HarnessAsyncGRPOTrainer(
                model=model,
                args=run_args,
                train_dataset=train_problems(),
                eval_dataset={"held_out": held_out_problems()},
                harness_session_factory=ArithmeticSessions(),
                harness_adapter=MCPHarnessAdapter(),
            ).train()
            evaluations = read_metrics(run_dir, EVALUATIONS_FILE)
            steps = read_metrics(run_dir)
            held_out = [
                (
                    e["step"],
                    e["eval/held_out/reward"],
                    e["eval/held_out/reward/ci_low"],
                    e["eval/held_out/reward/ci_high"],
                )
                for e in evaluations
            ]
            gains.append(held_out[-1][1] - held_out[0][1])
            samples = int(sum(r.get("batch/samples_per_step", 0) for r in steps))
            step_s = statistics.median(r["perf/step_s"] for r in steps if "perf/step_s" in r)
            cells = " / ".join(
                f"{v:.3f} [{lo:.3f}, {hi:.3f}] (step {s})" for s, v, lo, hi in held_out
            )
            lines.append(f"| {seed} | {cells} | {samples} | {step_s:.1f} |")
            print(f"seed {seed}: held-out {cells}", flush=True)
    print(
        "\nSmolLM2-135M-Instruct through OpenEnv sessions (white-box, MCPHarnessAdapter), the "
        f"real demo's task and settings, {args.steps} steps"
    )
    print(
        "| seed | held-out accuracy (90% interval over problems) | samples trained | median "
        "step s |"
    )
    print("|---|---|---|---|")
    print("\n".join(lines))
    gain = bootstrap_interval(gains)
    print(
        f"held-out gain {gain.estimate:+.3f} [{gain.low:+.3f}, {gain.high:+.3f}] (median over "
        f"{len(gains)} seeds, 90% bootstrap interval)"
    )


if __name__ == "__main__":
    main()
