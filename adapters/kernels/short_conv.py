"""Tree-aware short convolutions: LFM2's gated convolution layers on a tree-packed row.

An LFM2 convolution layer (``Lfm2ShortConv``, ``Lfm2MoeShortConv``) projects each token to
``B``, ``C`` and ``x``, convolves ``B * x`` depthwise over the token and its ``K - 1``
predecessors, gates the result with ``C`` and projects it out. transformers runs the
convolution along the row, so on a packed row a token would read the previous sample's last
tokens. Under tree attention (:func:`enable_tree_short_conv`, called by
:func:`~asyncgrpo.adapters.kernels.attention.enable_tree_attention`) each token instead reads
its ``K - 1`` predecessors along its own trie path
(:attr:`~asyncgrpo.core.packing.recurrent_tree.RecurrentLayout.conv_window`, the table gated
DeltaNet's convolution reads), which is exactly what forwarding its sample alone computes:
the state of a short convolution is nothing but those predecessors.

LFM2's decoder layer hands its convolution no keywords but ``seq_idx``, so the row's tables
reach it through the layer (:mod:`asyncgrpo.adapters.kernels.recurrent_routing`); without
them the convolution runs transformers' own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from asyncgrpo.adapters.kernels.gated_delta_net import RecurrentTensors
from asyncgrpo.adapters.kernels.recurrent_routing import route_to_tree_forward

SHORT_CONV_CLASSES = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv"})
"""transformers' gated short-convolution layers that :func:`tree_short_conv_forward`
computes."""


def is_short_conv(module: object) -> bool:
    """Whether ``module`` is one of :data:`SHORT_CONV_CLASSES` (also under FSDP2's subclass)."""
    return any(cls.__name__ in SHORT_CONV_CLASSES for cls in type(module).__mro__)


def enable_tree_short_conv(model: nn.Module) -> int:
    """Route every short convolution of ``model`` through :func:`tree_short_conv_forward`
    whenever its decoder layer's forward carries the row's recurrent tables; returns the
    number of layers switched. Idempotent."""
    return route_to_tree_forward(model, is_short_conv, tree_short_conv_forward)


def tree_short_conv_forward(module: Any, hidden_states: Tensor, layout: RecurrentTensors) -> Tensor:
    """A gated short convolution over one tree-packed row.

    Args:
        module: an LFM2 short convolution (:data:`SHORT_CONV_CLASSES`): ``in_proj`` to
            ``3 x hidden``, a depthwise ``conv`` of ``K`` taps, ``out_proj``.
        hidden_states: float [1, T, hidden].
        layout: the row's :class:`RecurrentTensors` (its ``conv_window`` of ``K`` columns).

    Returns:
        float [1, T, hidden], each token's output as if its sample were forwarded alone.
    """
    if hidden_states.shape[:2] != (1, layout.num_tokens):
        raise ValueError(
            f"a tree-packed short convolution takes one row of {layout.num_tokens} tokens, got "
            f"hidden states of shape {tuple(hidden_states.shape)}"
        )
    b, c, x = module.in_proj(hidden_states[0]).chunk(3, dim=-1)  # each [T, hidden]
    gated = b * x
    padded = torch.cat([gated, gated.new_zeros(1, gated.shape[1])])  # row T: no predecessor
    weight = module.conv.weight.squeeze(1)  # [hidden, K], oldest tap first
    convolved = torch.einsum("tkc,ck->tc", padded[layout.conv_window], weight)
    if module.conv.bias is not None:
        convolved = convolved + module.conv.bias
    return module.out_proj((c * convolved)[None])
