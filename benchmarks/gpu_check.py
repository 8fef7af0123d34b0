"""GPU check for one H200 with only torch, transformers and peft (no vLLM, no ``kernels``,
no network): tree attention, parity and the FSDP2 learner on a Qwen3-0.6B-shaped random model.

Checks, each a row of one table (a failing check is a row with its error, not a crash):

1. **parity**: per-token log-probs of tree-packed rows equal those of each sample forwarded
   on its own (transformers' SDPA, the reference), in fp32 (TF32 off; tolerance
   ``FP32_TOL``) and bf16 (``BF16_TOL``: the reference is bf16 too, so both sides round), for
   each tree-attention backend the device offers: FlexAttention (``flex``) and torch's
   built-in varlen attention (``torch_varlen``, bf16 only) on CUDA; ``dense`` and
   ``segments`` on CPU.
2. **fwd+bwd**: :meth:`Learner.train_step` (FSDP2 over NCCL at world size 1, bf16 mixed
   precision, gradient checkpointing) on the same G=8 groups as one tree-packed row and as one
   padding-free row (each sample its own segment), per backend: milliseconds, trained tokens
   per second, ``perf/fwd_bwd_mfu`` against the device's peak, peak memory.
3. **memory**: peak memory of one train step as ``token_budget`` (the row's tokens) grows.

    python benchmarks/gpu_check.py              # on the GPU machine, about 3-6 minutes
    python benchmarks/gpu_check.py --dry-run    # CPU: a tiny model, a few tokens (CI runs it)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_packing import padding_free_row

from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.kernels.backends import BackendUnavailableError, check_backend
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs
from asyncgrpo.core.packing.tree import PackedRow, pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.run.flops import FlopsMeter

FP32_TOL = 1e-3  # max |packed - unpacked| log-prob, nats
BF16_TOL = 0.25  # max, nats; the mean must stay under BF16_TOL / 10
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                  vocab_size=151_936, tie_word_embeddings=True, rope_theta=1_000_000.0,
                  max_position_embeddings=40_960, rms_norm_eps=1e-6)  # fmt: skip
TINY = dict(QWEN3_0_6B, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, intermediate_size=256, vocab_size=1000,
            max_position_embeddings=4096)  # fmt: skip


class Sizes:
    """Lengths per mode: (prompt, completion) of the parity and fwd+bwd groups, and the
    token budgets of the memory check."""

    def __init__(self, dry_run: bool) -> None:
        self.parity = (12, 6) if dry_run else (96, 48)
        self.throughput = (24, 8) if dry_run else (1024, 256)
        self.budgets = (64, 128) if dry_run else (4096, 8192, 16384, 32768)
        self.repeats = 1 if dry_run else 3


def make_groups(vocab: int, groups: int, prompt: int, completion: int,
                rng: np.random.Generator) -> list[TrainingSample]:  # fmt: skip
    """``groups`` x 8 samples; each group shares a random prompt; completions vary in length
    (``completion / 2`` to ``completion``), all trained, sampler log-prob ``-log(vocab)``."""
    samples = []
    for group in range(groups):
        shared = rng.integers(10, vocab, prompt)
        for member in range(8):
            own = rng.integers(
                10, vocab, int(rng.integers(max(1, completion // 2), completion + 1))
            )
            tokens = np.concatenate([shared, own])
            mask = np.r_[np.zeros(prompt, np.int8), np.ones(len(own), np.int8)]
            sequence = TrainingSequence(tokens, mask, np.where(mask == 1, -math.log(vocab), 0.0))
            samples.append(TrainingSample(sequence, (-1.0) ** member, 0, group, group, group,
                                          f"{group}-{member}"))  # fmt: skip
    return samples


def model_config(dry_run: bool) -> Qwen3Config:
    return Qwen3Config(**(TINY if dry_run else QWEN3_0_6B))


def random_model(dtype: torch.dtype, device: torch.device, dry_run: bool) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(dry_run), dtype=dtype)
    return model.to(device).eval()


def backends_for(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The tree-attention backends to check on ``device``: the CUDA ones the install offers."""
    wanted = ["dense", "segments"] if device.type == "cpu" else ["flex", "torch_varlen"]
    offered = []
    for name in wanted:
        if name == "torch_varlen" and dtype == torch.float32:
            continue
        try:
            check_backend(name, device)
            offered.append(name)
        except BackendUnavailableError as error:
            print(f"skipping backend {name}: {error}", file=sys.stderr)
    return offered


def unpacked_log_probs(model: Any, samples: list[TrainingSample]) -> torch.Tensor:
    """The reference: each sample alone through transformers' SDPA, log-probs of its trained
    tokens in sample order (the order of ``PackedRow.target_ids``)."""
    model.set_attn_implementation("sdpa")
    out = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor(sample.sequence.input_ids, device=model.device)[None]
            logits = model(input_ids=ids).logits[0].float()
            mask = torch.tensor(sample.sequence.trained_mask, device=model.device).bool()
            targets = ids[0][mask]
            logp = torch.log_softmax(logits[:-1], -1)[mask[1:]]
            out.append(logp.gather(-1, targets[:, None])[:, 0])
    return torch.cat(out)


def parity_rows(device: torch.device, sizes: Sizes, dry_run: bool) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(1)
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        model = random_model(dtype, device, dry_run)
        samples = make_groups(model.config.vocab_size, 2, *sizes.parity, rng)
        want = unpacked_log_probs(model, samples)
        row = pack_row(samples)
        enable_tree_attention(model)
        for backend in backends_for(device, dtype):

            def check(model=model, row=row, backend=backend, want=want, tol=tol,
                      dtype=dtype) -> dict:  # fmt: skip
                with torch.no_grad():
                    got = packed_log_probs(model, row, 1.0, backend=backend).logp.float()
                diff = (got - want).abs()
                ok = diff.max().item() <= tol and (
                    dtype == torch.float32 or diff.mean().item() <= tol / 10
                )  # fmt: skip
                return {"result": f"max {diff.max().item():.2e}, mean {diff.mean().item():.2e}"
                                  f" (tol {tol:g})", "ok": ok}  # fmt: skip

            rows.append(run_check("parity", str(dtype).removeprefix("torch."), backend,
                                  row.num_tokens, check))  # fmt: skip
        del model
    return rows


def learner_config(device: torch.device) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir="/tmp/gpu_check", bf16=True, score_centering=False,
                           vllm_importance_sampling_clip_max=1e9, learning_rate=1e-7,
                           use_cpu=device.type == "cpu")  # fmt: skip


def step_figures(learner: Learner, row: PackedRow, meter: FlopsMeter, repeats: int,
                 device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Median train step over ``repeats`` after one warm-up; peak memory of the steps."""
    learner.train_step([row])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = statistics.median(
        learner.train_step([row]).metrics["perf/fwd_bwd_s"] for _ in range(repeats)
    )
    flops = meter.of_rows([row])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"ms": 1e3 * seconds, "tok_s": len(row.target_ids) / seconds,
            "mfu": flops / (seconds * meter.peak_flops), "peak_gib": peak, "ok": True,
            "result": f"{len(row.target_ids)} trained"}  # fmt: skip


def learner_rows(device: torch.device, sizes: Sizes, dry_run: bool) -> list[dict[str, Any]]:
    rows = []
    config = model_config(dry_run)
    meter = FlopsMeter(config, device, bf16=True)
    rng = np.random.default_rng(2)
    samples = make_groups(config.vocab_size, 2, *sizes.throughput, rng)
    layouts = {"tree": pack_row(samples), "padding-free": padding_free_row(samples)}
    for backend in backends_for(device, torch.bfloat16):
        model = random_model(torch.float32, device, dry_run).train()  # FSDP2 shards it in place
        with Learner(model, learner_config(device), attention_backend=backend) as learner:
            for name, row in layouts.items():
                rows.append(run_check(f"fwd+bwd {name}", "bf16", backend, row.num_tokens,
                                      lambda row=row, learner=learner: step_figures(
                                          learner, row, meter, sizes.repeats,
                                          device)))  # fmt: skip
            for budget in sizes.budgets:
                prompt = max(2, budget // 24)
                groups = max(1, budget // (prompt + 8 * prompt))
                row = pack_row(make_groups(config.vocab_size, groups, prompt, prompt, rng))
                rows.append(run_check(f"memory budget {budget}", "bf16", backend,
                                      row.num_tokens, lambda row=row, learner=learner:
                                      step_figures(learner, row, meter, 1, device)))  # fmt: skip
    return rows


def run_check(check: str, dtype: str, backend: str, tokens: int,
              body: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    start = time.perf_counter()
    try:
        figures = body()
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        figures = {"result": f"error: {type(error).__name__}: {str(error)[:120]}", "ok": False}
    print(f"done {check} {dtype} {backend} in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)  # fmt: skip
    return {"check": check, "dtype": dtype, "backend": backend, "tokens": tokens, **figures}


def print_table(rows: list[dict[str, Any]], device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}")
    print(
        "| check | dtype | backend | tokens | result | ms | trained tok/s | MFU | peak GiB | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def fmt(value: Any, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in rows:
        print(f"| {r['check']} | {r['dtype']} | {r['backend']} | {r['tokens']} | {r['result']} "
              f"| {fmt(r.get('ms'), '.1f')} | {fmt(r.get('tok_s'), ',.0f')} "
              f"| {fmt(r.get('mfu'), '.3f')} | {fmt(r.get('peak_gib'), '.2f')} "
              f"| {'yes' if r['ok'] else 'NO'} |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny model, few tokens, CPU backends only")  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sizes = Sizes(args.dry_run)
    rows = parity_rows(device, sizes, args.dry_run) + learner_rows(device, sizes, args.dry_run)
    print_table(rows, device)
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
