"""The GPU planner against a second framework's published asynchronous-against-synchronous pair,
held out of every fit: NeMo-RL's GRPO on Llama-3.1-8B-Instruct, 16 H100 (docs/experiments.md,
"Checked against published runs").

NeMo-RL's performance summary (``docs/about/performance-summary.md``, v0.5.0, 2025): GRPO on
OpenMathInstruct-2, 64 prompts x 32 samples a step, at most 4,096 tokens a sequence, bf16,
Megatron. Step time "includes training, generation, policy logprobs, and refit time":

* on policy (synchronous), its recipe colocated on all 16 GPUs: 92.8 s a step, sequences of
  1,019 tokens on average;
* 1-step off (asynchronous, ``max_trajectory_age_steps`` 1, in-flight weight updates), 8 GPUs
  generating and 8 training: 64.8 s, 1,123 tokens. Predicted twice: as NeMo-RL schedules it
  (the next step's whole batch in flight beside this step's training) and as this trainer's
  pacing at ``max_staleness`` 1 would run it.

Every part is the planner's default (nothing is fitted to these runs): the H100 decode step
overhead its published vLLM figure implies, 40% MFU, the trainer's fixed cost per sample fitted
to verl's runs. Assumed and not published: prompts of 150 tokens on average (the sequences'
means less it are the responses'), the responses' shape (median 0.8x the mean, 90th percentile
2x), vLLM at tensor-parallel 1, and the old log-probs recomputed in both modes (a forward over
the step's samples, a third of a forward and backward)::

    .venv/bin/python benchmarks/published_nemo_rl.py --output-dir runs/published-nemo-rl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs

from asyncgrpo.core.experiments import gpu_plan
from asyncgrpo.core.experiments.recommend import Candidate
from asyncgrpo.core.experiments.workload import Workload, workload_from_mapping
from asyncgrpo.shell.experiments.workload_plan import (
    colocated_config,
    simulated_prediction,
    simulation_config,
)

LLAMA31_8B = {  # its config.json (Hugging Face), the fields the planner reads
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
PROMPT_MEAN = 150  # assumed: OpenMathInstruct-2's problems with a chat template
MAX_SEQUENCE = 4096
OLD_LOG_PROB_SHARE = 1 / 3  # a forward over a forward and backward
SAMPLES_PER_STEP = 64 * 32


@attrs.frozen
class Published:
    """One published run: its mode, its mean sequence (prompt and response) and its step."""

    name: str
    colocated: bool
    mean_sequence: float
    step_s: float


PUBLISHED = (
    Published("on policy, colocated on 16 GPUs", True, 1019, 92.8),
    Published("1-step off, 8 generating : 8 training", False, 1123, 64.8),
)


def workload(run: Published) -> Workload:
    """The run's setup as a workload (the module's docstring names what is assumed)."""
    response = run.mean_sequence - PROMPT_MEAN
    return workload_from_mapping(
        {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "config": LLAMA31_8B},
            "cluster": {"gpu": "h100", "gpus": 16, "gpus_per_node": 8},
            "batch": {"prompts_per_step": 64, "num_generations": 32},
            "lengths": {
                "prompt": {"mean": PROMPT_MEAN, "p50": 130, "p90": 250, "max": 512},
                "response": {
                    "mean": response,
                    "p50": 0.8 * response,
                    "p90": 2.0 * response,
                    "max": MAX_SEQUENCE - 512,
                },
            },
            "settings": {"weight_path": "nccl"},
        }
    )


def predict(run: Published, out: Path, steps: int, emulated: bool) -> tuple[float, float]:
    """The planner's step of ``run`` with the old log-probs' forward, and its trainer's idle
    share; an asynchronous run ``emulated`` as NeMo-RL schedules it, else as this trainer's
    pacing would."""
    w = workload(run)
    if run.colocated:
        candidate = Candidate(16, 16, 0, 1, 1)
        config = colocated_config(w, 16, 1, steps)
    elif emulated:
        # NeMo-RL's 1-step off: the next step's whole batch generated beside this step's
        # training; emulated as this trainer with that batch in flight at most and a
        # max_staleness that drops none of it
        candidate = Candidate(8, 8, 4, 1, 1)
        config = simulation_config(w, gpu_plan.Split(8, 8, 1), 4, 1, steps)
        config = attrs.evolve(config, max_concurrent_rollouts=SAMPLES_PER_STEP)
    else:  # this trainer's own pacing at max_staleness 1
        candidate = Candidate(8, 8, 1, 1, 1)
        config = simulation_config(w, gpu_plan.Split(8, 8, 1), 1, 1, steps)
    name = "sync" if run.colocated else ("async-emulated" if emulated else "async-paced")
    p = simulated_prediction(config, candidate, out / name)
    train = (1 - p.trainer_idle_frac) * p.step_s
    return p.step_s + OLD_LOG_PROB_SHARE * train, p.trainer_idle_frac


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    out = Path(args.output_dir)
    print("| run | published s/step | predicted | error | predicted trainer idle |")
    print("|---|---|---|---|---|")
    sync, asynchronous = PUBLISHED
    sync_s, idle = predict(sync, out, args.steps, emulated=False)
    print(
        f"| {sync.name} | {sync.step_s:.1f} | {sync_s:.1f} | "
        f"{sync_s / sync.step_s - 1:+.1%} | {idle:.0%} |"
    )
    for emulated in (True, False):
        step_s, idle = predict(asynchronous, out, args.steps, emulated)
        how = "NeMo-RL's schedule emulated" if emulated else "this trainer's pacing"
        print(
            f"| {asynchronous.name} ({how}) | {asynchronous.step_s:.1f} | {step_s:.1f} | "
            f"{step_s / asynchronous.step_s - 1:+.1%} | {idle:.0%} |"
        )
        print(
            f"  async against sync ({how}): published {sync.step_s / asynchronous.step_s:.2f}x, "
            f"predicted {sync_s / step_s:.2f}x"
        )


if __name__ == "__main__":
    main()
