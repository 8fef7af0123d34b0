"""The loss of a micro-batch does not depend on how its samples were packed.

A toy one-layer attention model runs on packed rows through the reference dense mask; the loss
and its gradient must be the same whether the samples share one row, sit in rows of their own,
or are split any other way.
"""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from micro_batch_loss import policy_loss
from packing_strategies import sample_sets

from asyncgrpo.core.loss.inputs import LossConfig, SamplerTopK
from asyncgrpo.core.packing.tree import PackedRow, pack_row

VOCAB, DIM, MAX_POS = 6, 8, 32


def toy_model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "emb": (VOCAB, DIM),
        "pos": (MAX_POS, DIM),
        "q": (DIM, DIM),
        "k": (DIM, DIM),
        "v": (DIM, DIM),
        "out": (DIM, VOCAB),
    }
    return {
        n: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
        for n, s in shapes.items()
    }


def row_logits(params, row: PackedRow) -> torch.Tensor:
    ids = torch.tensor(row.input_ids)
    pos = torch.tensor(row.position_ids)
    x = params["emb"][ids] + params["pos"][pos]
    scores = (x @ params["q"]) @ (x @ params["k"]).T / DIM**0.5
    mask = torch.from_numpy(row.dense_mask())
    attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (attn @ (x @ params["v"])) @ params["out"]


def loss_of_rows(params, rows: list[PackedRow], total_tokens: int, centering: bool):
    total = torch.zeros((), dtype=torch.float64)
    for row in rows:
        logits = row_logits(params, row)[torch.tensor(row.predict_index)]
        n = len(row.target_ids)
        topk = SamplerTopK(
            ids=torch.arange(3).repeat(n, 1),
            logp=torch.full((n, 3), float(np.log(0.2)), dtype=torch.float64),
            valid=torch.ones(n, 3, dtype=torch.bool),
        )
        out = policy_loss(
            logits,
            target_ids=torch.tensor(row.target_ids),
            sampler_logp=torch.tensor(row.sampler_logprobs),
            advantages=torch.tensor(row.advantages),
            sample_index=torch.tensor(row.sample_index),
            config=LossConfig(
                score_centering=centering,
                vllm_importance_sampling_clip_min=0.0,
                vllm_importance_sampling_clip_max=1e9,
            ),
            num_trained_tokens_global=total_tokens,
            gradient_accumulation_steps=1,
            topk=topk if centering else None,
        )
        total = total + out.loss
    return total


def gradients(params, loss) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(params.values()), allow_unused=True))


@given(sample_sets(vocab=VOCAB - 1, max_len=6), st.randoms(use_true_random=False), st.booleans())
def test_loss_and_gradient_do_not_depend_on_packing(samples, rng, centering) -> None:
    total = sum(s.sequence.num_trained for s in samples)
    if total == 0:
        return
    params = toy_model()
    together = loss_of_rows(params, [pack_row(samples)], total, centering)
    alone = loss_of_rows(params, [pack_row([s]) for s in samples], total, centering)
    cut = rng.randint(1, len(samples))
    shuffled = rng.sample(list(samples), len(samples))
    split = loss_of_rows(
        params,
        [pack_row(shuffled[:cut])] + ([pack_row(shuffled[cut:])] if shuffled[cut:] else []),
        total,
        centering,
    )
    torch.testing.assert_close(together, alone, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(split, alone, rtol=1e-10, atol=1e-12)
    for a, b in zip(gradients(params, together), gradients(params, alone), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
