"""The GPU planner against published asynchronous-against-synchronous runs: predicted seconds per
step beside the published ones, from each run's stated setup (docs/experiments.md, "Checked
against published runs").

The runs are verl's fully asynchronous recipe (``recipe/fully_async_policy/README.md``, last
updated 2025-12-25): DAPO on Qwen2.5-Math-7B, 512 prompts x 16 responses a step, responses up
to 28,672 tokens, on 32, 64 and 128 H20 GPUs, each colocated and synchronous (every GPU
generates, then trains; vLLM at tensor-parallel 4) and asynchronous (half the GPUs to each side,
``staleness_threshold`` 0.5 with partial rollouts, a weight sync per 512 prompts).

Neither the mean response length, nor how fast vLLM decodes one request, nor the trainers'
efficiency is published, so they are fitted, on the two 128-GPU runs' phases only:

* the mean response length, so that the asynchronous run's trainer (64 GPUs, the planner's
  default 40% MFU: an assumption) takes its published ``update_actor`` (113.16 s), with the
  lengths' shape assumed (median 0.8x the mean, 90th percentile 2x, the maximum 28,672);
* the decode step's overhead beside the roofline (kernel launches, the tensor-parallel
  all-reduces, sampling), so that the synchronous run's generation phase is its published
  ``gen`` (177.85 s): a synchronous step waits for its longest response, decoded one token a
  step;
* the colocated trainer's MFU, so that its training phase is its published ``update_actor``
  (113.81 s on 128 GPUs: it offloads its parameters and optimizer to the CPU between phases,
  so the same work takes it twice the GPU-seconds).

The runs on 64 and 32 GPUs are held out: predicted from the setup and the three values.

With ``--fit-trainer`` the asynchronous trainer is instead fitted as ``a + b / GPUs`` to its
runs on 64 and 32 trainer GPUs (``[trainer] measured``, what a user with two runs of their own
gives the planner), the colocated trainer gets the same ``a`` a step and its MFU is fitted
to the 128-GPU run, and the runs left, colocated on 64 and 32 GPUs and asynchronous on 16:16,
are held out.
The synchronous runs also recompute the old log-probs (verl's ``old_log_prob``, a forward pass
over the step's samples, one third of a forward and backward), added to their prediction; the
asynchronous runs take the sampler's.

    .venv/bin/python benchmarks/published_runs.py --output-dir runs/published
    .venv/bin/python benchmarks/published_runs.py --output-dir runs/published --fit-trainer
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import attrs

from asyncgrpo.core.experiments import gpu_plan
from asyncgrpo.core.experiments.parts import fit_trainer
from asyncgrpo.core.experiments.recommend import Candidate, Prediction
from asyncgrpo.core.experiments.workload import Workload, workload_from_mapping
from asyncgrpo.shell.experiments.workload_plan import (
    colocated_config,
    simulated_prediction,
    simulation_config,
)

QWEN25_MATH_7B = {  # its config.json (Hugging Face), the fields the planner reads
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
MAX_RESPONSE = 28 * 1024
SAMPLES_PER_STEP = 512 * 16
OLD_LOG_PROB_SHARE = 1 / 3  # a forward over a forward and backward (2 / 6 FLOPs per parameter)


@attrs.frozen
class Published:
    """One published run: its GPUs, how they split, and its mean seconds per step."""

    name: str
    gpus: int
    colocated: bool
    step_s: float
    gen_s: float
    train_s: float  # update_actor (and old_log_prob, for a synchronous run, in old_log_prob_s)
    old_log_prob_s: float = 0.0


PUBLISHED = (  # recipe/fully_async_policy/README.md, "Asynchronous Training on 7B Model"
    Published("colocated sync, 128 GPUs", 128, True, 356.30, 177.85, 113.81, 53.92),
    Published("fully async 64:64", 128, False, 150.63, 33.14, 113.16),
    Published("colocated sync, 64 GPUs", 64, True, 365.28, 150.72, 133.41, 70.26),
    Published("fully async 32:32", 64, False, 189.26, 28.46, 156.98),
    # update_actor as the docs and README_zh give it (the English README swaps sync's and
    # async's; only these add up to the step)
    Published("colocated sync, 32 GPUs", 32, True, 790.10, 357.41, 313.81, 107.71),
    Published("fully async 16:16", 32, False, 294.77, 21.26, 269.80),
)
CALIBRATION = PUBLISHED[:2]
TRAINER_RUNS = (PUBLISHED[1], PUBLISHED[3])
"""With ``--fit-trainer``: the asynchronous runs on 64 and 32 trainer GPUs, whose trainers
give ``a + b / GPUs`` (the second is then fitted, not held out)."""


def workload(
    mean_response: float,
    mfu: float,
    step_overhead_s: float = 0.0,
    trainer: dict[str, Any] | None = None,
) -> Workload:
    """The runs' setup as a workload; the response lengths' shape is assumed (see above).
    ``trainer``: the ``[trainer]`` table (default: ``mfu`` and no per-step overhead)."""
    return workload_from_mapping(
        {
            "model": {"name": "Qwen/Qwen2.5-Math-7B", "config": QWEN25_MATH_7B},
            "cluster": {
                "gpu": "h20",
                "gpus": 128,
                "gpus_per_node": 8,
                "intra_node": "nvlink4",
                "inter_node": "ib-ndr",
            },
            "batch": {"prompts_per_step": 512, "num_generations": 16},
            "lengths": {
                "prompt": {"mean": 250, "p50": 220, "p90": 400, "max": 2048},
                "response": {
                    "mean": mean_response,
                    "p50": 0.8 * mean_response,
                    "p90": min(2.0 * mean_response, MAX_RESPONSE - 1),
                    "max": MAX_RESPONSE,
                },
            },
            "settings": {"weight_path": "nccl"},
            # no per-step overhead unless given: the default's
            # (parts.TRAINER_OVERHEAD_S_PER_SAMPLE) is fitted to these runs' asynchronous
            # steps on 32 and 64 GPUs
            "trainer": trainer or {"mfu": mfu, "step_overhead_s": 0.0},
            "generator": {"step_overhead_s": step_overhead_s, "source": "fitted to verl's runs"},
        }
    )


@attrs.frozen
class Phases:
    """A predicted step and its parts, seconds."""

    step_s: float
    gen_s: float  # the trainer waiting for samples
    train_s: float


def predict(run: Published, w: Workload, out: Path, steps: int) -> Phases:
    """The planner's prediction of ``run`` under workload ``w``."""
    if run.colocated:
        candidate = Candidate(run.gpus, run.gpus // 4, 0, 1, 4)
        config = colocated_config(w, run.gpus, 4, steps)
    else:
        half = run.gpus // 2
        candidate = Candidate(half, half // 4, 4, 1, 4)
        config = simulation_config(w, gpu_plan.Split(half, half // 4, 4), 4, 1, steps)
        # staleness_threshold 0.5: at most 1.5 steps' samples generated ahead; partial
        # rollouts: no sample dropped for its age (max_staleness 4 drops none here)
        config = attrs.evolve(config, max_concurrent_rollouts=int(1.5 * SAMPLES_PER_STEP))
    p: Prediction = simulated_prediction(config, candidate, out / run.name.replace(" ", "_"))
    gen = p.trainer_idle_frac * p.step_s
    train = p.step_s - gen
    if run.colocated:  # the old log-probs recomputed: a forward over the step
        return Phases(p.step_s + OLD_LOG_PROB_SHARE * train, gen, train)
    return Phases(p.step_s, gen, train)


@attrs.frozen
class Fitted:
    """The values fitted to the 128-GPU runs (and, with ``measured``, the asynchronous
    trainer fitted as ``a + b / GPUs`` to its steps at two GPU counts, ``fixed_s`` the ``a``
    the colocated trainer shares)."""

    mean_response: float
    step_overhead_s: float
    mfu_colocated: float
    measured: tuple[tuple[int, float], ...] = ()
    fixed_s: float = 0.0

    def workload(self, run: Published) -> Workload:
        if not self.measured:
            mfu = self.mfu_colocated if run.colocated else SEPARATE_MFU
            return workload(self.mean_response, mfu, self.step_overhead_s)
        table: dict[str, Any] = (
            {"mfu": self.mfu_colocated, "step_overhead_s": self.fixed_s}
            if run.colocated
            else {"measured": [{"gpus": g, "train_s": t} for g, t in self.measured]}
        )
        return workload(self.mean_response, SEPARATE_MFU, self.step_overhead_s, table)


SEPARATE_MFU = 0.4  # the planner's default, assumed for the trainer on its own GPUs


def training_s(run: Published, w: Workload) -> float:
    """The trainer part's seconds for one step of ``run`` (no simulation needed)."""
    gpus = run.gpus if run.colocated else run.gpus // 2
    split = gpu_plan.Split(gpus, gpus // 4, 4)
    shape = gpu_plan.step_shape(w, split)
    return gpu_plan.trainer_part(w, split, shape).step_s(shape.forwarded_tokens)


def bisect(function, target: float, low: float, high: float, rounds: int) -> float:
    """The argument in [low, high] where an increasing ``function`` meets ``target``."""
    for _ in range(rounds):
        middle = (low + high) / 2
        low, high = (middle, high) if function(middle) < target else (low, middle)
    return (low + high) / 2


def fit(
    out: Path, steps: int, trainer_runs: tuple[Published, ...] = ()
) -> tuple[Fitted, list[str]]:
    """The mean response length, the decode step's overhead and the colocated MFU, fitted to
    the 128-GPU runs' phases (the module's docstring); with ``trainer_runs`` (asynchronous
    runs at two or more GPU counts), the asynchronous trainer is their ``a + b / GPUs`` and
    the colocated MFU is fitted with its ``a`` per step."""
    log: list[str] = []
    sync, asynchronous = CALIBRATION
    mean = bisect(
        lambda m: training_s(asynchronous, workload(m, SEPARATE_MFU)),
        asynchronous.train_s,
        100.0,
        20_000.0,
        30,
    )
    log.append(
        f"mean response {mean:.0f} tokens: the 64 trainer GPUs at {SEPARATE_MFU:.0%} MFU "
        f"take {training_s(asynchronous, workload(mean, SEPARATE_MFU)):.1f} s"
    )

    def generation_s(overhead: float) -> float:
        phases = predict(sync, workload(mean, SEPARATE_MFU, overhead), out / "fit", steps)
        log.append(f"decode step overhead {overhead * 1e3:.2f} ms: gen {phases.gen_s:.1f} s")
        return phases.gen_s

    overhead = bisect(generation_s, sync.gen_s, 0.0, 0.05, 8)
    if not trainer_runs:
        mfu = bisect(lambda u: -training_s(sync, workload(mean, u)), -sync.train_s, 0.01, 1.0, 30)
        log.append(f"colocated MFU {mfu:.3f}: {training_s(sync, workload(mean, mfu)):.1f} s")
        return Fitted(mean, overhead, mfu), log
    measured = tuple((r.gpus // 2, r.train_s) for r in trainer_runs)
    fixed = fit_trainer(measured).fixed_s
    log.append(f"asynchronous trainer fitted to {measured}: {fixed:.1f} s a step besides")

    def colocated(u: float) -> Workload:
        return workload(mean, u, overhead, {"mfu": u, "step_overhead_s": fixed})

    mfu = bisect(lambda u: -training_s(sync, colocated(u)), -sync.train_s, 0.01, 1.0, 30)
    log.append(f"colocated MFU {mfu:.3f} with it: {training_s(sync, colocated(mfu)):.1f} s")
    return Fitted(mean, overhead, mfu, measured, fixed), log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--fit-trainer",
        action="store_true",
        help="fit the asynchronous trainer to its runs on 64 and 32 trainer GPUs (a + b / GPUs)"
        " and hold out the rest",
    )
    args = parser.parse_args()
    out = Path(args.output_dir)
    trainer_runs = TRAINER_RUNS if args.fit_trainer else ()
    calibration = CALIBRATION + trainer_runs[1:]
    fitted, log = fit(out, args.steps, trainer_runs)
    print("\n".join(log))
    print(
        f"fitted on the 128-GPU runs: mean response {fitted.mean_response:.0f} tokens, "
        f"decode step overhead {fitted.step_overhead_s * 1e3:.2f} ms, colocated MFU "
        f"{fitted.mfu_colocated:.3f} (on its own GPUs: {SEPARATE_MFU}, assumed)\n"
    )
    predicted = {
        run.name: predict(run, fitted.workload(run), out / "predict", args.steps)
        for run in PUBLISHED
    }
    rows: list[dict[str, Any]] = []
    print(
        "| run | published s/step | predicted | error | published gen / train s | "
        "predicted gen / train s | held out |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in PUBLISHED:
        p = predicted[run.name]
        error = p.step_s / run.step_s - 1
        train = run.train_s + run.old_log_prob_s
        rows.append({"run": run.name, "error": error, "held_out": run not in calibration})
        print(
            f"| {run.name} | {run.step_s:.1f} | {p.step_s:.1f} | {error:+.1%} | "
            f"{run.gen_s:.1f} / {train:.1f} | {p.gen_s:.1f} / "
            f"{p.train_s * (1 + OLD_LOG_PROB_SHARE * run.colocated):.1f} | "
            f"{'yes' if run not in calibration else 'fitted (its phases)'} |"
        )
    print()
    for gpus in (128, 64, 32):
        sync, asynchronous = (r for r in PUBLISHED if r.gpus == gpus)
        ratio = predicted[sync.name].step_s / predicted[asynchronous.name].step_s
        print(
            f"{gpus} GPUs: async against sync published "
            f"{sync.step_s / asynchronous.step_s:.2f}x, predicted {ratio:.2f}x"
        )
    held = [abs(r["error"]) for r in rows if r["held_out"]]
    print(
        f"\nheld out: median absolute error {statistics.median(held):.1%}, "
        f"{sum(e <= 0.15 for e in held)} of {len(held)} within 15%, "
        f"{sum(e <= 0.25 for e in held)} within 25%"
    )


if __name__ == "__main__":
    main()
