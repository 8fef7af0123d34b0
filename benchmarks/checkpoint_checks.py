"""How long it takes to tell a damaged checkpoint: the check of one checkpoint, and a resume
that skips a damaged newest one, for a small and a larger model (docs/reliability.md).

For each model, a real learner's checkpoint (after one optimizer step, so the optimizer state
is in it) is written through the run's save path; then the median of ``--repeats`` timings of:
``check_loads`` on the whole checkpoint (what each save and each resume runs), and
``find_for_resume`` on a run directory whose newest checkpoint has one file damaged (cut to
half, emptied or deleted), for every file the checkpoint holds; and ``check_safetensors`` on
the model's saved ``model.safetensors`` (what loading a model directory runs first).

Usage: .venv/bin/python benchmarks/checkpoint_checks.py OUT_DIR [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import time
from pathlib import Path

import structlog
import torch

from asyncgrpo.adapters.checkpoint_files import check_safetensors
from asyncgrpo.adapters.models.causal_lm import load_causal_lm, save_tiny_model
from asyncgrpo.core.rollout.cursor import PromptCursor
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.run import checkpoints

MODELS = {
    "tiny (hidden 128, 2 layers)": {},
    "h1024 (hidden 1024, 8 layers)": {"hidden_size": 1024, "num_layers": 8},
}
DAMAGES = ("truncate", "empty", "delete")


def write_checkpoint(model_dir: Path, out: Path) -> tuple[Path, int]:
    """A real checkpoint of ``model_dir`` under ``out``; returns it and its parameter count."""
    config = AsyncGRPOConfig(
        output_dir=str(out / "unused"), num_sampler_logprobs=4, seed=0, gradient_checkpointing=False
    )
    with Learner(load_causal_lm(model_dir), config) as learner:
        learner.optimizer.zero_grad()
        sum(p.sum() for p in learner.model.parameters()).backward()
        learner.optimizer.step()
        parameters = sum(p.numel() for p in learner.model.parameters())

        def write(path: Path) -> None:
            learner.save_checkpoint(path)
            checkpoints.write_model_source(path, str(model_dir), None)
            checkpoints.write_rollout_state(path, PromptCursor(), version=1, step=1)

        return checkpoints.save(out / "saved", 1, write), parameters


def median_ms(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def damaged_copy(saved: Path, copy: Path, file: str, how: str) -> None:
    """``saved`` at ``copy`` (hard links), with ``file`` cut to half, emptied or deleted."""
    shutil.copytree(saved, copy, copy_function=os.link)
    (copy / file).unlink()
    if how == "truncate":
        with (saved / file).open("rb") as source, (copy / file).open("wb") as target:
            target.write(source.read((saved / file).stat().st_size // 2))
    elif how == "empty":
        (copy / file).write_bytes(b"")


def measure(name: str, overrides: dict, out: Path, repeats: int) -> dict:
    model_dir = save_tiny_model(out / "model", "qwen3", seed=0, **overrides)
    saved, parameters = write_checkpoint(model_dir, out)
    files = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    size = sum((saved / f).stat().st_size for f in files)
    row = {
        "model": name,
        "parameters": parameters,
        "checkpoint_mb": round(size / 1e6, 1),
        "files": files,
        "check_ms": median_ms(lambda: checkpoints.check_loads(saved), repeats),
        "resume_fallback_ms": {},
    }
    weights = model_dir / "model.safetensors"
    row["safetensors_mb"] = round(weights.stat().st_size / 1e6, 1)
    row["safetensors_check_ms"] = median_ms(lambda: check_safetensors(weights), repeats)
    run = out / "run"
    for file in files:
        for how in DAMAGES:
            shutil.rmtree(run, ignore_errors=True)
            run.mkdir()
            (run / "checkpoint-1").symlink_to(saved)  # complete; not copied again
            damaged_copy(saved, run / "checkpoint-2", file, how)
            assert checkpoints.find_for_resume(run) == run / "checkpoint-1"
            took = median_ms(lambda: checkpoints.find_for_resume(run), repeats)
            row["resume_fallback_ms"][f"{file} {how}"] = took
    shutil.rmtree(out)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    for index, (name, overrides) in enumerate(MODELS.items()):
        row = measure(name, overrides, args.out / str(index), args.repeats)
        fallback = row["resume_fallback_ms"].values()
        row["resume_fallback_ms_range"] = [min(fallback), max(fallback)]
        print(json.dumps(row))


if __name__ == "__main__":
    main()
