"""Where a real-demo step's time goes, profiled as the step runs: beside its vLLM server, on
the run's own rows.

``asyncgrpo demo --model smollm2-135m`` runs
(:func:`asyncgrpo.shell.commands.real_demo.run_real_demo`, its server started as the demo
starts it) with :class:`~asyncgrpo.shell.learner.Learner`'s
``train_step`` wrapped in ``torch.profiler`` for steps ``--profile-steps``. Each profiled op's
own CPU time goes to one part of the step:

- ``matrix products``: the decoder's linear layers (``mm``/``addmm``, forward and backward);
- ``attention``: the tree attention's batched products and softmax, and their backward;
- ``LM head and log-softmax``: every op on a ``[*, V]`` tensor (the head's products, the
  log-softmax, its gather, their backward);
- ``embedding``: the input embedding's lookup and its dense gradient;
- ``FSDP2 hooks and copies``: ops under FSDP2's own profiler ranges (``FSDP::...``) and its
  post-backward autograd node;
- ``optimizer``: clipping, AdamW, the finiteness checks (``optimizer_step``);
- ``rest``: everything else (norms, activations, the loss, the copies between them).

Printed per part: the median seconds per profiled step and its share of the step
(forward + backward + optimizer), and the step's forwarded tokens/s and ``perf/fwd_bwd_mfu``
from the run's metrics; ``profile.jsonl`` in each run's folder keeps every profiled step's
parts and each part's six largest ops. The profiler slows the step it watches (its figures
are for shares, not speed): the run's unprofiled steps in ``metrics.jsonl`` are the speed.
``--baseline COMMIT`` first runs the same with the trainer as it was at
``COMMIT`` (``benchmarks/real_model.py``'s worktree), so a change is profiled before and after
on the same machine, in one sitting::

    .venv/bin/python benchmarks/step_profile.py --output-dir runs/step-profile --baseline HEAD
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

PARTS = (
    "matrix products",
    "attention",
    "LM head and log-softmax",
    "embedding",
    "FSDP2 hooks and copies",
    "optimizer",
    "rest",
)
ATTENTION_OPS = {
    "aten::bmm",
    "aten::baddbmm",
    "aten::_softmax",
    "aten::_safe_softmax",
    "aten::_softmax_backward_data",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}
ATTENTION_NODES = ("BmmBackward", "SoftmaxBackward", "SafeSoftmaxBackward", "ScaledDotProduct")
MATMUL_OPS = {"aten::mm", "aten::addmm"}
OPTIMIZER_RANGE = "asyncgrpo::optimizer_step"


def part_of(event: Any, vocab: int) -> str:
    """The part of the step one profiled op belongs to (see the module docstring)."""
    ancestors = []
    parent = event.cpu_parent
    while parent is not None:
        ancestors.append(parent.name)
        parent = parent.cpu_parent
    shapes = [shape for shape in (event.input_shapes or []) if isinstance(shape, list)]
    if OPTIMIZER_RANGE in ancestors:
        return "optimizer"
    if any(a.startswith("FSDP::") or "RegisterPostBackward" in a for a in ancestors):
        return "FSDP2 hooks and copies"
    if "embedding" in event.name or any("EmbeddingBackward" in a for a in ancestors):
        return "embedding"
    if any("LMHeadLogProbs" in a for a in ancestors) or any(
        vocab in (shape[0], shape[-1]) for shape in shapes if len(shape) > 1
    ):
        return "LM head and log-softmax"
    if event.name in ATTENTION_OPS or any(n in a for a in ancestors for n in ATTENTION_NODES):
        return "attention"
    if event.name in MATMUL_OPS:
        return "matrix products"
    return "rest"


def profiled_run(output_dir: Path, max_steps: int, profile_steps: set[int]) -> None:
    """Run the real demo in this process with ``profile_steps`` profiled; each profiled step's
    seconds per part go to ``output_dir/profile.jsonl``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import asyncgrpo.shell.learner.learner as learner_module
    from asyncgrpo.shell.commands.real_demo import run_real_demo

    step_of = learner_module.Learner.train_step
    optimizer_step = learner_module.optimizer_step

    def labelled_optimizer_step(*args: Any, **kwargs: Any) -> Any:
        with record_function(OPTIMIZER_RANGE):
            return optimizer_step(*args, **kwargs)

    def train_step(self: Any, micro_batches: Any) -> Any:
        if self.step + 1 not in profile_steps:
            return step_of(self, micro_batches)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
            out = step_of(self, micro_batches)
        seconds: dict[str, float] = defaultdict(float)
        ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for event in profiler.events():
            part = part_of(event, self.vocab_size)
            seconds[part] += event.self_cpu_time_total / 1e6
            ops[part][event.name] += event.self_cpu_time_total / 1e6
        top = {
            part: dict(sorted(times.items(), key=lambda kv: -kv[1])[:6])
            for part, times in ops.items()
        }
        record = {
            "step": self.step,
            "seconds": seconds,
            "top_ops": top,
            "forwarded_tokens": sum(r.num_tokens for r in micro_batches if r is not None),
            "fwd_bwd_s": out.metrics["perf/fwd_bwd_s"],
            "optimizer_s": out.metrics["perf/optimizer_s"],
        }
        with open(output_dir / "profile.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return out

    learner_module.optimizer_step = labelled_optimizer_step
    learner_module.Learner.train_step = train_step
    run_real_demo(output_dir, max_steps=max_steps)


def summary(output_dir: Path) -> dict[str, Any]:
    """Medians over the profiled steps, and the run's own ``perf/fwd_bwd_mfu`` of them."""
    from asyncgrpo.shell.run import read_metrics

    records = [json.loads(line) for line in (output_dir / "profile.jsonl").read_text().splitlines()]
    steps = {r["step"] for r in records}
    mfu = [
        row["perf/fwd_bwd_mfu"]
        for row in read_metrics(output_dir)
        if row.get("step") in steps and row.get("perf/fwd_bwd_mfu") is not None
    ]
    return {
        "steps": sorted(steps),
        "parts": {
            part: statistics.median(r["seconds"].get(part, 0.0) for r in records) for part in PARTS
        },
        "profiled_s": statistics.median(sum(r["seconds"].values()) for r in records),
        "tokens_per_s": statistics.median(r["forwarded_tokens"] / r["fwd_bwd_s"] for r in records),
        "forwarded_tokens": statistics.median(r["forwarded_tokens"] for r in records),
        "mfu": statistics.median(mfu) if mfu else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--profile-steps",
        default="4,5,6",
        help="steps to profile, comma-separated (after the first steps' warm-up)",
    )
    parser.add_argument(
        "--baseline", metavar="COMMIT", help="first profile the trainer as it was at COMMIT"
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    profile_steps = {int(s) for s in args.profile_steps.split(",")}
    if args.one:
        profiled_run(Path(args.output_dir), max(profile_steps), profile_steps)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from real_model import checkout_of  # the baseline's worktree, as real_model.py makes it

    runs: dict[str, dict[str, str] | None] = {"after": None}
    output = Path(args.output_dir)
    results = {}
    with checkout_of(args.baseline) if args.baseline else nullcontext() as environment:
        if args.baseline:
            runs = {"before": environment, "after": None}
        for name, env in runs.items():
            folder = output / name
            command = [
                sys.executable,
                __file__,
                "--one",
                "--output-dir",
                str(folder),
                "--profile-steps",
                args.profile_steps,
            ]
            subprocess.run(command, check=True, env=env)
            results[name] = summary(folder)
    print_table(results, args.baseline)


def print_table(results: dict[str, dict[str, Any]], baseline: str | None) -> None:
    names = list(results)
    print(
        f"real demo, steps {results[names[-1]]['steps']} profiled"
        + (f"; before: the trainer at {baseline}" if baseline else "")
    )
    print("| part | " + " | ".join(f"{n}: s per step (share)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for part in PARTS:
        cells = [
            f"{r['parts'][part]:.2f} ({r['parts'][part] / r['profiled_s']:.0%})"
            for r in results.values()
        ]
        print(f"| {part} | " + " | ".join(cells) + " |")
    print(
        "| profiled step | " + " | ".join(f"{r['profiled_s']:.2f}" for r in results.values()) + " |"
    )
    print(
        "| forwarded tokens (fwd+bwd tokens/s) | "
        + " | ".join(
            f"{r['forwarded_tokens']:.0f} ({r['tokens_per_s']:.0f})" for r in results.values()
        )
        + " |"
    )
    print("| perf/fwd_bwd_mfu | " + " | ".join(f"{r['mfu']:.2f}" for r in results.values()) + " |")


if __name__ == "__main__":
    main()
