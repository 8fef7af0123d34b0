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
reach it through the layer: a forward pre-hook on the decoder layer takes
``recurrent_layout`` from the layer's keywords and leaves it on the convolution for that call
(again when activation checkpointing recomputes the layer), and a forward hook takes it away.
Without it the convolution runs transformers' own forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from asyncgrpo.adapters.kernels.gated_delta_net import (
    RECURRENT_LAYOUT_KWARG,
    TREE_LAYOUT_KWARG,
    RecurrentTensors,
)

SHORT_CONV_CLASSES = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv"})
"""transformers' gated short-convolution layers that :func:`tree_short_conv_forward`
computes."""

_STOCK_FORWARD = "_asyncgrpo_stock_forward"
_LAYOUT = "_asyncgrpo_recurrent_layout"
_NO_LAYOUT = object()  # the layer's call carried a tree layout but no recurrent tables


def is_short_conv(module: object) -> bool:
    """Whether ``module`` is one of :data:`SHORT_CONV_CLASSES` (also under FSDP2's subclass)."""
    return any(cls.__name__ in SHORT_CONV_CLASSES for cls in type(module).__mro__)


def short_conv_kernel_size(model: nn.Module) -> int | None:
    """The width ``K`` of ``model``'s short convolutions, ``None`` without such layers."""
    kernels = {module.conv_kernel_size for module in model.modules() if is_short_conv(module)}
    if len(kernels) > 1:
        raise ValueError(f"short convolutions with different kernel sizes {sorted(kernels)}")
    return kernels.pop() if kernels else None


def enable_tree_short_conv(model: nn.Module) -> int:
    """Route every short convolution of ``model`` through :func:`tree_short_conv_forward`
    whenever its decoder layer's forward carries the row's recurrent tables; returns the
    number of layers switched. Idempotent."""
    switched = 0
    for layer in model.modules():
        convs = [child for child in layer.children() if is_short_conv(child)]
        for conv in convs:
            if not hasattr(conv, _STOCK_FORWARD):
                setattr(conv, _STOCK_FORWARD, conv.forward)
                conv.forward = types.MethodType(_dispatching_forward, conv)
                layer.register_forward_pre_hook(_hand_layout(conv), with_kwargs=True)
                layer.register_forward_hook(_take_layout(conv))
            switched += 1
    return switched


def _hand_layout(conv: nn.Module):
    def hook(layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        layout = kwargs.get(RECURRENT_LAYOUT_KWARG)
        if layout is None and kwargs.get(TREE_LAYOUT_KWARG) is not None:
            layout = _NO_LAYOUT
        setattr(conv, _LAYOUT, layout)

    return hook


def _take_layout(conv: nn.Module):
    def hook(layer: nn.Module, args: tuple, output: Any) -> None:
        setattr(conv, _LAYOUT, None)

    return hook


def _dispatching_forward(module: Any, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    layout = getattr(module, _LAYOUT, None)
    if layout is None:
        return getattr(module, _STOCK_FORWARD)(hidden_states, *args, **kwargs)
    if not isinstance(layout, RecurrentTensors):
        raise ValueError(
            f"{type(module).__name__} got a tree layout without {RECURRENT_LAYOUT_KWARG}="
            "RecurrentTensors: short convolutions need the row's recurrent tables; build them "
            "with recurrent_tensors(row, device, conv_kernel) (packed_log_probs does)"
        )
    return tree_short_conv_forward(module, hidden_states, layout)


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
