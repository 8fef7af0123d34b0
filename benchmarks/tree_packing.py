"""Learner throughput with tree packing vs padding-free packing of the same samples (CPU).

G=8 samples share a 256-token prompt and have 64-token completions (all trained). The same
samples go through :meth:`Learner.train_step` as one tree-packed row (the prompt forwarded once)
and as one padding-free row (each sample its own segment, nothing shared). Both are timed side
by side, alternating, and the figure is trained tokens per second of forward and backward
(``perf/fwd_bwd_s``), median over repeats. Gradient checkpointing is on, as by default.

The default model is a tiny Qwen3 with hidden 256 and 4 layers (random weights, fp32), larger
than the test model (hidden 128, 2 layers) so that the decoder rather than per-call overhead
dominates; ``--hidden 128 --layers 2`` runs the test model. ``--model-family qwen3-next``
runs a tiny Qwen3-Next hybrid instead (alternating gated DeltaNet and gated attention layers,
routed experts; the tree-aware DeltaNet forward of
:mod:`asyncgrpo.adapters.kernels.gated_delta_net`), where the FLOP estimate, written for plain
decoders, is left out.

    .venv/bin/python benchmarks/tree_packing.py
    .venv/bin/python benchmarks/tree_packing.py --model-family qwen3-next
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np
import torch

from asyncgrpo.adapters.models.causal_lm import load_causal_lm, save_tiny_model
from asyncgrpo.core.packing.tree import PackedRow, pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.run.planner import attention_cost, batch_metrics
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner


def make_group(
    vocab: int, group_size: int = 8, prompt_len: int = 256, completion_len: int = 64
) -> list[TrainingSample]:
    """One group: a shared random prompt and random completions; sampler log-prob
    ``-log(vocab)`` (about the random model's own, so the importance ratios are near 1)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, vocab, prompt_len)
    samples = []
    for member in range(group_size):
        tokens = np.concatenate([prompt, rng.integers(10, vocab, completion_len)])
        mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(completion_len, np.int8)]
        logprobs = np.where(mask == 1, -np.log(vocab), 0.0)
        sequence = TrainingSequence(tokens, mask, logprobs)
        samples.append(TrainingSample(sequence, (-1.0) ** member, 0, 0, 0, 0, f"0-{member}"))
    return samples


def padding_free_row(samples: list[TrainingSample]) -> PackedRow:
    """The samples one after another, each its own root segment: nothing is shared."""
    rows = [pack_row([sample]) for sample in samples]
    tokens = np.cumsum([0] + [row.num_tokens for row in rows])
    segments = np.cumsum([0] + [row.num_segments for row in rows])

    def cat(field: str, offsets=None) -> np.ndarray:
        parts = [getattr(row, field) for row in rows]
        if offsets is not None:
            parts = [p + o for p, o in zip(parts, offsets, strict=False)]
        return np.concatenate(parts)

    parents = [
        np.where(row.segment_parents < 0, -1, row.segment_parents + offset)
        for row, offset in zip(rows, segments, strict=False)
    ]
    lengths = cat("segment_lengths")
    kv_lengths = np.concatenate([np.diff(row.cu_seqlens_k) for row in rows])
    return PackedRow(
        input_ids=cat("input_ids"),
        position_ids=cat("position_ids"),
        segment_ids=cat("segment_ids", segments),
        segment_starts=cat("segment_starts", tokens),
        segment_lengths=lengths,
        segment_parents=np.concatenate(parents),
        kv_indices=cat("kv_indices", tokens),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        cu_seqlens_k=np.concatenate([[0], np.cumsum(kv_lengths)]).astype(np.int32),
        trained_rows=cat("trained_rows", tokens),
        predict_index=cat("predict_index", tokens),
        target_ids=cat("target_ids"),
        sampler_logprobs=cat("sampler_logprobs"),
        advantages=cat("advantages"),
        sample_index=cat("sample_index", range(len(rows))),
        candidate_sets=None,
        sampler_top_logprobs=None,
        samples=tuple(samples),
    )


def forward_macs(row: PackedRow, config) -> float:
    """Multiply-accumulates of the packed forward, estimated: the decoder's linear layers per
    forwarded token, attention per (query, key) pair (:func:`attention_cost`), and the LM head
    per trained token only. Backward and recomputation scale these alike."""
    hidden, heads, kv_heads = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    head_dim = config.head_dim
    linear = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    linear += 3 * hidden * config.intermediate_size
    attention = 2 * heads * head_dim * attention_cost(row.position_ids)
    layers = config.num_hidden_layers * (row.num_tokens * linear + attention)
    return layers + len(row.target_ids) * hidden * config.vocab_size


def time_rows(learner: Learner, rows: dict[str, PackedRow], repeats: int) -> dict[str, float]:
    """Median ``perf/fwd_bwd_s`` per layout, layouts alternating, after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    for repeat in range(repeats + 1):
        for name, row in rows.items():
            seconds = learner.train_step([row]).metrics["perf/fwd_bwd_s"]
            if repeat:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-family", choices=("qwen3", "qwen3-next"), default="qwen3")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    architecture = "qwen3_next" if args.model_family == "qwen3-next" else "qwen3"
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(tmp, architecture, hidden_size=args.hidden, num_layers=args.layers)
        model = load_causal_lm(path)
    samples = make_group(model.config.vocab_size)
    rows = {"tree": pack_row(samples), "padding-free": padding_free_row(samples)}
    config = AsyncGRPOConfig(score_centering=False, vllm_importance_sampling_clip_max=1e9)
    with Learner(model, config) as learner:
        medians = time_rows(learner, rows, args.repeats)
    trained = len(rows["tree"].target_ids)
    ratio = batch_metrics([[rows["tree"]]], rows["tree"].num_tokens)["batch/packing_ratio"]
    print(
        f"{args.model_family} hidden {args.hidden}, {args.layers} layers; {len(samples)} samples, "
        f"{trained} trained tokens; threads {args.threads}, {args.repeats} repeats"
    )
    for name, row in rows.items():
        print(
            f"{name:>12}: {row.num_tokens:5d} forwarded tokens, fwd+bwd median "
            f"{medians[name] * 1e3:7.1f} ms, {trained / medians[name]:8.0f} trained tokens/s"
        )
    speedup = medians["padding-free"] / medians["tree"]
    if architecture == "qwen3_next":
        print(
            f"packing_ratio {ratio:.2f}, speedup {speedup:.2f} ({speedup / ratio:.2f} x "
            "packing_ratio)"
        )
        return
    ideal = forward_macs(rows["padding-free"], model.config) / forward_macs(
        rows["tree"], model.config
    )
    print(
        f"packing_ratio {ratio:.2f}, speedup {speedup:.2f} "
        f"({speedup / ratio:.2f} x packing_ratio; target >= 0.90); "
        f"FLOP-estimate speedup {ideal:.2f} ({ideal / ratio:.2f} x packing_ratio)"
    )


if __name__ == "__main__":
    main()
