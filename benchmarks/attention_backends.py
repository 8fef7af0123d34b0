"""CPU tree attention: ``dense`` vs ``segments`` by row shape, and the fitted cost model.

Rows of about ``--tokens`` forwarded tokens, from one long sample to many short ones (each
sample its own segment), and the same with groups of 8 samples sharing a prompt (a trie). For
each row and backend: the layout build (once per forward) and one attention layer's forward
and backward (random q, k, v; ``heads x 64`` query width, one KV head), median of
``--repeats``; the two backends alternate. Then the constants of
:mod:`asyncgrpo.core.packing.attention_choice` are fitted by least squares, and the table shows
which backend each row should use, which the model picks, and the time of the pick.

    .venv/bin/python benchmarks/attention_backends.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from asyncgrpo.adapters.kernels.attention import tree_attention_forward, tree_layout
from asyncgrpo.core.packing.attention_choice import (
    AttentionCosts,
    cheaper_backend,
    dense_cost,
    segments_cost,
)
from asyncgrpo.core.packing.flops import query_key_pairs
from asyncgrpo.core.packing.tree import PackedRow, pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence

HEAD_DIM = 64


def sample(tokens: list[int], group: int, rollout: str) -> TrainingSample:
    mask = [0] + [1] * (len(tokens) - 1)
    seq = TrainingSequence(
        input_ids=tokens, trained_mask=mask, sampler_logprobs=[-0.1 * m for m in mask]
    )
    return TrainingSample(seq, 1.0, 0, group, group, group, rollout)


def independent_row(tokens: int, count: int, rng: np.random.Generator) -> PackedRow:
    length = max(2, tokens // count)
    return pack_row([sample(list(rng.integers(0, 1000, length)), i, f"s{i}") for i in range(count)])


def grouped_row(tokens: int, count: int, rng: np.random.Generator) -> PackedRow:
    groups = max(1, count // 8)
    prompt, completion = max(2, tokens // (groups * 12)), max(1, tokens // (groups * 12))
    samples = []
    for g in range(groups):
        shared = list(rng.integers(0, 1000, prompt))
        samples += [
            sample(shared + list(rng.integers(0, 1000, completion)), g, f"{g}-{m}")
            for m in range(8)
        ]
    return pack_row(samples)


def timed(row: PackedRow, backend: str, heads: int) -> tuple[float, float]:
    """(layout build seconds, one layer's forward+backward seconds)."""
    start = time.perf_counter()
    layout = tree_layout(row, "cpu", backend)
    built = time.perf_counter()
    t = row.num_tokens
    q = torch.randn(1, heads, t, HEAD_DIM, requires_grad=True)
    k = torch.randn(1, 1, t, HEAD_DIM, requires_grad=True)
    v = torch.randn(1, 1, t, HEAD_DIM, requires_grad=True)
    attend_start = time.perf_counter()
    out, _ = tree_attention_forward(None, q, k, v, None, tree_layout=layout)
    out.sum().backward()
    return built - start, time.perf_counter() - attend_start


def fit(rows: list[dict]) -> AttentionCosts:
    """Least-squares, non-negative-clipped constants from the measurements."""

    def solve(features: list[list[float]], target: list[float]) -> np.ndarray:
        solution, *_ = np.linalg.lstsq(np.array(features), np.array(target), rcond=None)
        return np.maximum(solution, 0.0)

    dense = solve([[1.0, r["T"] ** 2 * r["width"]] for r in rows], [r["dense_s"] for r in rows])
    mask = solve([[r["T"] ** 2, r["T"]] for r in rows], [r["mask_s"] for r in rows])
    split = solve(
        [[r["S"], r["pairs"] * r["width"]] for r in rows], [r["segments_s"] for r in rows]
    )
    return AttentionCosts(
        dense_per_call=dense[0],
        dense_per_cell_dim=dense[1],
        mask_per_cell=mask[0],
        mask_per_token=mask[1],
        segments_per_call=split[0],
        segments_per_pair_dim=split[1],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 8, 32, 128])
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    results = []
    for heads in args.heads:
        for tokens in args.tokens:
            for count in args.counts:
                for kind, build in (("independent", independent_row), ("G=8 trie", grouped_row)):
                    if kind != "independent" and count < 8:
                        continue
                    row = build(tokens, count, rng)
                    times: dict[str, list[tuple[float, float]]] = {"dense": [], "segments": []}
                    for _ in range(args.repeats):
                        for backend in times:
                            times[backend].append(timed(row, backend, heads))
                    results.append(
                        {
                            "kind": kind,
                            "count": count,
                            "heads": heads,
                            "width": heads * HEAD_DIM,
                            "T": row.num_tokens,
                            "S": row.num_segments,
                            "pairs": query_key_pairs(row.cu_seqlens_q, row.cu_seqlens_k),
                            "mask_s": statistics.median(b for b, _ in times["dense"]),
                            "dense_s": statistics.median(a for _, a in times["dense"]),
                            "segments_s": statistics.median(b + a for b, a in times["segments"]),
                        }
                    )
    costs = fit(results)
    print(f"fitted: {costs}")
    print(
        "| heads x 64 | row | T | segments | pairs / T² | dense ms (mask + layer) | "
        "segments ms | faster | model picks |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    hits = 0
    for r in results:
        dense_total = r["mask_s"] + r["dense_s"]
        faster = "dense" if dense_total < r["segments_s"] else "segments"
        pick = cheaper_backend(r["T"], r["S"], r["pairs"], r["width"], 1, costs)
        hits += pick == faster
        predicted = (
            dense_cost(r["T"], r["width"], 1, costs),
            segments_cost(r["S"], r["pairs"], r["width"], 1, costs),
        )
        print(
            f"| {r['heads']} | {r['count']} {r['kind']} | {r['T']} | {r['S']} | "
            f"{r['pairs'] / r['T'] ** 2:.3f} | {1e3 * dense_total:.2f} | "
            f"{1e3 * r['segments_s']:.2f} | {faster} | {pick} "
            f"(model {1e3 * predicted[0]:.2f} / {1e3 * predicted[1]:.2f}) |"
        )
    print(f"model picks the faster backend in {hits} of {len(results)} rows")


if __name__ == "__main__":
    main()
