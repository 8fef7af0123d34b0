"""The per-sample forward: a packed row's samples as a batch of separate sequences through the
model's own forward, for decoders the tree-packed forward cannot compute exactly.

A model with a layer the tree does not know (a Mamba or short-convolution state, a layer type
of its own; see :func:`~asyncgrpo.adapters.kernels.architecture_support.training_path`) still
trains exactly: the row's samples run as one right-padded batch
(:func:`~asyncgrpo.core.packing.sample_batch.sample_batch`) through the model's stock forward,
in its own attention implementation, so each sample's state and attention stay its own. The
LM head sees only the positions that predict a trained token (a pre-hook gathers them), and
whatever the model does to its logits after the head (a multiplier, ``logits_scaling``, a
soft-cap) is the model's own code. Nothing is shared between the samples: a prompt of a group
of ``G`` samples is forwarded ``G`` times, which is the packing the tree would have saved (the
step's ``batch/packing_ratio``), plus the padding up to the longest sample.

One forward per row, as on the tree, so FSDP2's collectives match across processes however
many samples each row holds. The result is laid out as
:func:`~asyncgrpo.adapters.kernels.packed_forward.packed_log_probs` lays out its own (the row's
trained tokens in ``predict_index`` order): the learner's loss does not know which ran.

Example (``model`` any causal LM in its own attention implementation)::

    out = per_sample_log_probs(model, pack_row(samples), temperature=1.0)
    (out.logp * weights).sum().backward()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import torch
from peft import PeftModel
from torch import Tensor, nn
from transformers import PreTrainedModel

from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.loss.losses import TokenLogProbs, token_log_probs
from asyncgrpo.core.packing.sample_batch import SampleBatch, sample_batch
from asyncgrpo.core.packing.tree import PackedRow


def per_sample_log_probs(
    model: PreTrainedModel | PeftModel,
    row: PackedRow,
    temperature: float,
    *,
    topk: SamplerTopK | None = None,
    candidate_mask: Tensor | None = None,
) -> TokenLogProbs:
    """The policy's log-probs at ``row``'s N trained tokens, in ``row.predict_index`` order,
    each sample forwarded as its own sequence (see the module docstring).

    Args:
        model: a causal LM (or a ``PeftModel`` of one) whose logits are a function of its
            output embeddings' output, position by position (transformers' causal LMs).
        row: the packed micro-batch row; its samples are forwarded, its trie is not.
        temperature: the sampling temperature (> 0).
        topk: the sampler's top-K ids [N, K] at each trained token, on the model's device.
        candidate_mask: bool [N, V] the sampler's candidate sets, on the model's device.

    Returns:
        ``logp`` float [N] and ``topk_logp`` float [N, K] (or ``None``) with gradients to the
        model's parameters; ``entropy`` float [N] in nats, detached. The N trained tokens'
        logits [N, V] are kept for the backward pass.

    Raises:
        ValueError: the model's logits are not one row per gathered position (something after
            its head mixes positions).
    """
    batch = sample_batch(row)
    device = next(model.parameters()).device
    with _trained_positions_only(model.get_output_embeddings(), batch, device):
        logits = model(
            input_ids=torch.tensor(batch.input_ids, device=device), use_cache=False
        ).logits
    n = len(row.target_ids)
    if logits.shape[:2] != (1, n):
        raise ValueError(
            f"{type(model).__name__}'s logits have shape {tuple(logits.shape)} after its LM "
            f"head saw the {n} trained positions: something after the head mixes positions, "
            "so the per-sample forward cannot keep only the trained ones"
        )
    targets = torch.tensor(row.target_ids, dtype=torch.long, device=device)
    out = token_log_probs(logits[0], targets, temperature, candidate_mask, topk)
    # fresh tensors, not views: FSDP2 hooks its backward on the root's outputs, which an
    # in-place op on a view would skip
    return attrs.evolve(
        out,
        logp=out.logp.clone(),
        topk_logp=None if out.topk_logp is None else out.topk_logp.clone(),
    )


@contextmanager
def _trained_positions_only(head: nn.Module, batch: SampleBatch, device) -> Iterator[None]:
    """While the block runs, ``head`` takes hidden [B, L, H] and computes only the N trained
    positions' rows, as [1, N, H] (N x V logits, never B x L x V)."""
    rows = torch.tensor(batch.predict_rows, device=device)
    positions = torch.tensor(batch.predict_positions, device=device)

    def gather(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, *rest = args
        return (hidden[rows, positions][None], *rest)

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()
