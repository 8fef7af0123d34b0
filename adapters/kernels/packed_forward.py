"""The learner's forward on one packed row: policy log-probs at the trained tokens only.

The decoder runs once over the row's ``T`` tokens with tree attention
(:mod:`asyncgrpo.adapters.kernels.attention`) and the row's per-sample position ids; its hidden
states are gathered at the ``N`` positions that predict a trained token, and only those go through
the LM head and the log-softmax, ``chunk_size`` positions at a time. The last chunk keeps its
logits for the backward pass, which starts with it; every other chunk's logits are recomputed
there, so memory holds at most one chunk's ``[chunk_size, V]`` logits, never ``N x V``. The
log-prob math is :func:`asyncgrpo.core.loss.losses.token_log_probs`, applied per chunk, and
its gradient is written out (:mod:`asyncgrpo.adapters.kernels.lm_head_log_probs`), so the LM
head must be a plain ``nn.Linear``; a final-logit soft-cap or logit scale after it (Gemma 2/3,
Cohere) is applied there, gradient included.

Example (``model`` a causal LM switched with ``enable_tree_attention``)::

    out = packed_log_probs(model, pack_row(samples), temperature=1.0)
    (out.logp * weights).sum().backward()
"""

from __future__ import annotations

from typing import Any, cast

import torch
from attrs import frozen
from peft import PeftModel
from torch import Tensor, nn
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.attention import LAYOUT_KWARG, TREE_ATTENTION, tree_layout
from asyncgrpo.adapters.kernels.attention_parts import decoder_of
from asyncgrpo.adapters.kernels.backends import BackendChoice, ModelAttention
from asyncgrpo.adapters.kernels.gated_delta_net import (
    RECURRENT_LAYOUT_KWARG,
    RecurrentTensors,
    is_gated_delta_net,
    recurrent_tensors,
)
from asyncgrpo.adapters.kernels.layout import Backend, TreeLayout
from asyncgrpo.adapters.kernels.lm_head_log_probs import LogitTransform, lm_head_log_probs
from asyncgrpo.adapters.kernels.mamba2 import is_mamba2
from asyncgrpo.adapters.kernels.short_conv import is_short_conv
from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.loss.losses import TokenLogProbs, token_log_probs
from asyncgrpo.core.packing.tree import PackedRow

DEFAULT_CHUNK_SIZE = 1024


@frozen(eq=False)
class RowTensors:
    """What the packed forward needs from a :class:`PackedRow`, on the model's device.

    Attributes:
        input_ids: long [1, T].
        position_ids: long [1, T], each token's position in its own sample (for RoPE).
        predict_index: long [N], the row whose output predicts each trained token.
        target_ids: long [N], the trained tokens.
        layout: the row's attention layout.
        recurrent: the row's gated DeltaNet index tables, for models with such layers.
    """

    input_ids: Tensor
    position_ids: Tensor
    predict_index: Tensor
    target_ids: Tensor
    layout: TreeLayout
    recurrent: RecurrentTensors | None = None


def row_tensors(
    row: PackedRow,
    device: torch.device | str,
    backend: Backend | BackendChoice | None = None,
    shape: ModelAttention | None = None,
    conv_kernel: int | None = None,
) -> RowTensors:
    """Convert ``row``'s arrays to tensors on ``device``, with the layout for ``backend`` (a
    name, the run's choice, or by device and, on CPU, by the row's cost in a model of
    ``shape``; see :func:`~asyncgrpo.adapters.kernels.attention.tree_layout`) and, when
    ``conv_kernel`` is given (a gated DeltaNet model), the recurrent index tables."""

    def long(array) -> Tensor:
        return torch.tensor(array, dtype=torch.long, device=device)

    return RowTensors(
        input_ids=long(row.input_ids).unsqueeze(0),
        position_ids=long(row.position_ids).unsqueeze(0),
        predict_index=long(row.predict_index),
        target_ids=long(row.target_ids),
        layout=tree_layout(row, device, backend, shape),
        recurrent=None if conv_kernel is None else recurrent_tensors(row, device, conv_kernel),
    )


def recurrent_kernel(model: PreTrainedModel) -> int | None:
    """The convolution width of ``model``'s recurrent layers (gated DeltaNet, LFM2's short
    convolutions, Mamba-2), which the row's recurrent tables are built for; ``None`` without any.

    Raises:
        ValueError: the layers have convolutions of different widths.
    """
    kernels = {
        int(cast(Any, module).conv_kernel_size)
        for module in model.modules()
        if is_gated_delta_net(module) or is_short_conv(module) or is_mamba2(module)
    }
    if len(kernels) > 1:
        raise ValueError(f"recurrent layers with different convolution widths {sorted(kernels)}")
    return kernels.pop() if kernels else None


def base_model(model: PreTrainedModel | PeftModel) -> PreTrainedModel:
    """The transformers model under a ``PeftModel``, or ``model`` itself when it is not one
    (peft types ``get_base_model`` as any ``nn.Module``).

    Raises:
        TypeError: the model under the ``PeftModel`` is not a transformers model.
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(base, PreTrainedModel):
        raise TypeError(
            f"the model under the PeftModel is a {type(base).__name__}, not a transformers "
            "PreTrainedModel; the learner trains transformers causal LMs"
        )
    return base


def decoder_hidden_states(model: PreTrainedModel, inputs: RowTensors) -> Tensor:
    """The decoder's final hidden states (after its last norm) over the row, float [T, H].

    Raises:
        ValueError: ``model`` is not switched to tree attention.
    """
    attention = model.config._attn_implementation
    if attention != TREE_ATTENTION:
        raise ValueError(
            f"the model attends with {attention!r}, which ignores the tree layout; call "
            "asyncgrpo.adapters.kernels.attention.enable_tree_attention(model) before packed "
            "forwards"
        )
    recurrent = {} if inputs.recurrent is None else {RECURRENT_LAYOUT_KWARG: inputs.recurrent}
    output = decoder_of(model)(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        use_cache=False,
        **{LAYOUT_KWARG: inputs.layout},
        **recurrent,
    )
    return output.last_hidden_state[0]


def packed_log_probs(
    model: PreTrainedModel | PeftModel,
    row: PackedRow,
    temperature: float,
    *,
    topk: SamplerTopK | None = None,
    candidate_mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: Backend | BackendChoice | None = None,
) -> TokenLogProbs:
    """The policy's log-probs at ``row``'s N trained tokens, in ``row.predict_index`` order.

    Args:
        model: a causal LM whose logits are ``lm_head(hidden)`` (Qwen3, Llama, ...), or a
            ``PeftModel`` of one (its attributes are the base model's), possibly
            scaled and soft-capped (``logit_scale``, ``final_logit_softcapping``), switched to
            tree attention with ``enable_tree_attention``.
        row: the packed micro-batch row.
        temperature: the sampling temperature (> 0); the policy is ``log_softmax(logits / T)``.
        topk: the sampler's top-K ids [N, K] at each trained token, on the model's device.
        candidate_mask: bool [N, V] the sampler's candidate sets, on the model's device.
        chunk_size: trained positions per LM-head chunk (>= 1); results do not depend on it.
        backend: the tree-attention backend: a name, the run's choice
            (:func:`~asyncgrpo.adapters.kernels.backends.choose_backend`, made once), or by
            device when ``None``.

    Returns:
        ``logp`` float [N] and ``topk_logp`` float [N, K] (or ``None``) with gradients to the
        model's parameters; ``entropy`` float [N] in nats, detached.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 trained positions, got {chunk_size}")
    causal_lm = base_model(model)  # the LoRA layers are inside it
    _check_plain_lm_head(causal_lm)
    inputs = row_tensors(
        row, causal_lm.device, backend, ModelAttention.of(causal_lm), recurrent_kernel(causal_lm)
    )
    hidden = decoder_hidden_states(causal_lm, inputs)[inputs.predict_index]
    lm_head, n = causal_lm.get_output_embeddings(), hidden.shape[0]
    transform = LogitTransform.of(causal_lm.config)
    # One (possibly empty) chunk when N = 0, so that the result keeps its shapes and dtypes.
    starts = range(0, max(n, 1), chunk_size)
    chunks = [
        _chunk_log_probs(
            lm_head,
            hidden[start : start + chunk_size],
            inputs.target_ids[start : start + chunk_size],
            temperature,
            None if candidate_mask is None else candidate_mask[start : start + chunk_size],
            None if topk is None else _slice_topk(topk, start, start + chunk_size),
            transform,
            last=start == starts[-1],
        )
        for start in starts
    ]
    return TokenLogProbs(
        logp=torch.cat([c.logp for c in chunks]),
        entropy=torch.cat([c.entropy for c in chunks]),
        topk_logp=_concatenated([c.topk_logp for c in chunks]),
    )


def _concatenated(parts: list[Tensor | None]) -> Tensor | None:
    """The chunks' top-K log-probs as one tensor: every chunk has them (a ``topk`` was given)
    or none has (None)."""
    present = [part for part in parts if part is not None]
    if not present:
        return None
    if len(present) != len(parts):
        raise ValueError("some chunks have top-K log-probs and others not; all or none must")
    return torch.cat(present)


def _chunk_log_probs(
    lm_head: nn.Linear,
    hidden: Tensor,
    target_ids: Tensor,
    temperature: float,
    candidate_mask: Tensor | None,
    topk: SamplerTopK | None,
    transform: LogitTransform,
    *,
    last: bool,
) -> TokenLogProbs:
    """One chunk: hidden [c, H] -> logits [c, V] (the head, then ``transform``) -> log-probs.
    With grad, only the ``last`` chunk's logits are kept for the backward pass; the others'
    are recomputed there."""

    if not torch.is_grad_enabled():
        logits = transform(lm_head(hidden))
        return token_log_probs(logits, target_ids, temperature, candidate_mask, topk)
    return lm_head_log_probs(
        lm_head,
        hidden,
        target_ids,
        temperature,
        candidate_mask,
        topk,
        keep_logits=last,
        transform=transform,
    )


def _slice_topk(topk: SamplerTopK, start: int, stop: int) -> SamplerTopK:
    return SamplerTopK(topk.ids[start:stop], topk.logp[start:stop], topk.valid[start:stop])


def _check_plain_lm_head(model: PreTrainedModel) -> None:
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(
            f"{type(model).__name__}'s output embeddings are a {type(head).__name__}, not an "
            "nn.Linear; packed_log_probs writes out the gradient of a plain linear LM head only "
            "(LoRA and modules_to_save on lm_head are refused for this reason)"
        )
