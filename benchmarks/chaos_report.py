"""What ``benchmarks/chaos.py`` prints at the end: the faults' table (outcomes, times to
detect and to recover) and the invariants (the positions audit, the steps, the processes
left, memory flat from the first quarter of the run to the last)."""

from __future__ import annotations

import collections
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import attrs
import psutil

from asyncgrpo.core.rollout.cursor import audit_positions
from asyncgrpo.shell.run.checkpoints import ROLLOUT_STATE

FLAT_WITHIN = 0.10  # memory: the most a process may change, first quarter to last


def named(cause: str) -> bool:
    """Whether a trainer's last words name the cause as asyncgrpo does (its command's line, or
    one of its errors), not a bare library exception."""
    return re.sub(r"^\[rank\d+\]:\s*", "", cause).startswith("asyncgrpo")


def spread(times: list[float]) -> str:
    """Median [min, max] in seconds, or ``-``."""
    if not times:
        return "-"
    return f"{statistics.median(times):.0f} s [{min(times):.0f}, {max(times):.0f}]"


def fault_table(faults: list[Any], kinds: tuple[str, ...]) -> list[str]:
    """One row per kind: how often injected, each outcome, the times to detect (how many of
    the faults were noticed at all) and to recover."""
    lines = [
        "| fault | injected | survived | failed with its cause named, resumed | failed, "
        "cause not named, resumed | not recovered | time to detect, median [range] "
        "(noticed) | time to recover, median [range] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        of_kind = [f for f in faults if f.kind == kind and f.outcome != "skipped"]
        times = [f.recover_s for f in of_kind if f.recover_s is not None]
        detected = [f.detect_s for f in of_kind if f.detect_s is not None]
        survived = sum(f.outcome == "survived" for f in of_kind)
        failed = [
            f
            for f in of_kind
            if f.recover_s is not None and f.outcome.startswith(("failed", "stopped"))
        ]
        failed_named = sum(named(f.cause) for f in failed)
        lost = len(of_kind) - survived - len(failed)
        skipped = [f.cause for f in faults if f.kind == kind and f.outcome == "skipped"]
        note = f" (skipped {len(skipped)}: {skipped[0]})" if skipped else ""
        lines.append(
            f"| {kind}{note} | {len(of_kind)} | {survived} | {failed_named} | "
            f"{len(failed) - failed_named} | {lost} | {spread(detected)} "
            f"({len(detected)} of {len(of_kind)}) | {spread(times)} |"
        )
    return lines


def leftover_processes(out: Path) -> list[str]:
    """Processes still running whose command line names this run's folder (this script and
    what started it aside)."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(out) in command and process.pid not in mine:
            found.append(f"{process.pid}: {command[:120]}")
    return found


def memory_table(samples: list[dict[str, Any]]) -> list[str]:
    """Median RSS per process (each role of the run, summed over its processes: the two
    servers' workers are one role) in the first and the last quarter of the run (MB), whether
    it stayed within ``FLAT_WITHIN`` of the first, and a last line saying whether every one
    did."""
    if len(samples) < 8:
        return ["too few memory samples: memory flatness NOT CHECKED"]
    quarter = max(1, len(samples) // 4)
    first, last = samples[1 : quarter + 1], samples[-quarter:]
    roles = sorted({k for s in samples for k in s if k != "t"})
    lines = [
        f"| process | RSS, first quarter (MB) | RSS, last quarter (MB) | change | "
        f"within {FLAT_WITHIN:.0%} |",
        "|---|---|---|---|---|",
    ]
    grown: list[str] = []
    unjudged: list[str] = []
    for role in [*roles, "all"]:

        def rss(rows: list[dict[str, Any]], role: str = role) -> float:
            def of(row: dict[str, Any]) -> float:
                if role == "all":
                    return sum(v for k, v in row.items() if k != "t")
                return row.get(role, 0.0)

            present = [of(r) for r in rows if role == "all" or r.get(role)]
            return statistics.median(present) if present else 0.0

        a, b = rss(first), rss(last)
        if not (a and b):  # a process of one quarter only (e.g. one that exited as sampled)
            unjudged.append(role)
            lines.append(f"| {role} | {a:.0f} | {b:.0f} | n/a | not in both quarters |")
            continue
        flat = abs(b - a) <= FLAT_WITHIN * a
        if not flat:
            grown.append(role)
        lines.append(
            f"| {role} | {a:.0f} | {b:.0f} | {(b - a) / a:+.0%} | {'yes' if flat else 'NO'} |"
        )
    verdict = (
        f"every process within {FLAT_WITHIN:.0%}, first quarter to last"
        if not grown
        else f"NOT FLAT within {FLAT_WITHIN:.0%}: {', '.join(grown)}"
    )
    if unjudged:
        verdict += f" (not in both quarters, not judged: {', '.join(unjudged)})"
    return [*lines, "", f"memory: {verdict}"]


def report(
    run: Any,
    faults: list[Any],
    kinds: tuple[str, ...],
    unplanned: list[str],
    out: Path,
    disk: Path | None,
) -> None:
    """Print the faults' table and the invariants; ``run`` is the chaos script's ``Run``."""
    print(
        f"\n{len(faults)} faults in {run.elapsed() / 60:.1f} minutes, {run.incarnations} "
        "trainer incarnations\n"
    )
    print("\n".join(fault_table(faults, kinds)))
    print("\ncauses named by the trainer:")
    for cause, n in collections.Counter(f.cause for f in faults if f.cause).most_common():
        print(f"  {n} x {cause[:240]}")
    if unplanned:
        print("\ntrainer exits no fault explains:")
        for line in unplanned:
            print(f"  {line}")
    rows = run.rows()
    steps = [int(r["step"]) for r in rows]
    contiguous = steps == list(range(1, len(steps) + 1))
    print(
        f"\nmetrics.jsonl steps 1..{max(steps, default=0)}: "
        f"{'contiguous, each once' if contiguous else 'NOT contiguous'} ({len(steps)} rows)"
    )
    final = run.last_checkpoint()
    state = json.loads((run.run_dir / f"checkpoint-{final}" / ROLLOUT_STATE).read_text())
    positions = [json.loads(line) for line in (run.run_dir / "positions.jsonl").open()]
    positions = [r for r in positions if r["step"] <= state["step"]]
    audit = audit_positions(positions, state["cursor"], samples_per_group=8)
    print(
        f"positions against checkpoint-{final}: {audit.consumed} consumed, {audit.split} "
        f"split, {audit.trained_samples} samples trained, dropped {dict(audit.dropped)}; "
        f"missing {list(audit.missing)}, repeated {list(audit.repeated)}, unconsumed "
        f"{list(audit.unconsumed)}: {'EXACT' if audit.exact else 'NOT EXACT'}"
    )
    (out / "metrics.jsonl").write_text((run.run_dir / "metrics.jsonl").read_text())
    (out / "positions.jsonl").write_text((run.run_dir / "positions.jsonl").read_text())
    if disk is not None:
        subprocess.run(["umount", str(disk)], check=False)
    time.sleep(2.0)
    left = leftover_processes(out)
    print(f"processes left: {left or 'none'}")
    print("\nmemory:\n" + "\n".join(memory_table(run.memory)))
    (out / "faults.json").write_text(json.dumps([attrs.asdict(f) for f in faults], indent=1))
    (out / "memory.json").write_text(json.dumps(run.memory))
