"""The route from a decoder layer's keywords to a recurrent token mixer it calls without them.

Some decoder layers call their recurrent mixer with a fixed set of arguments (LFM2's
convolution gets ``seq_idx`` only, Falcon-H1's Mamba gets the cache and the mask), so the
row's recurrent tables, which the packed forward passes as the keyword ``recurrent_layout``,
never reach it. :func:`route_to_tree_forward` hands them over through the layer: a forward
pre-hook on the layer reads the keyword and leaves it on the mixer for that call (again when
activation checkpointing recomputes the layer), a forward hook takes it away, and the mixer's
forward runs the tree forward given while the tables are there, its own forward otherwise.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from asyncgrpo.adapters.kernels.gated_delta_net import (
    RECURRENT_LAYOUT_KWARG,
    TREE_LAYOUT_KWARG,
    RecurrentTensors,
)

TreeForward = Callable[[Any, Tensor, RecurrentTensors], Tensor]
"""``(mixer, hidden_states [1, T, hidden], tables) -> [1, T, hidden]``."""

_STOCK_FORWARD = "_asyncgrpo_stock_forward"
_LAYOUT = "_asyncgrpo_recurrent_layout"
_NO_LAYOUT = object()  # the layer's call carried a tree layout but no recurrent tables


def route_to_tree_forward(
    model: nn.Module, is_mixer: Callable[[nn.Module], bool], tree_forward: TreeForward
) -> int:
    """Route every module of ``model`` that ``is_mixer`` picks through ``tree_forward``
    whenever its parent layer's forward carries the row's recurrent tables; returns how many.
    Idempotent."""
    routed = 0
    for layer in model.modules():
        for mixer in [child for child in layer.children() if is_mixer(child)]:
            if not hasattr(mixer, _STOCK_FORWARD):
                setattr(mixer, _STOCK_FORWARD, mixer.forward)
                mixer.forward = types.MethodType(_dispatching(tree_forward), mixer)
                layer.register_forward_pre_hook(_hand_layout(mixer), with_kwargs=True)
                layer.register_forward_hook(_take_layout(mixer))
            routed += 1
    return routed


def _hand_layout(mixer: nn.Module):
    def hook(layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        layout = kwargs.get(RECURRENT_LAYOUT_KWARG)
        if layout is None and kwargs.get(TREE_LAYOUT_KWARG) is not None:
            layout = _NO_LAYOUT
        setattr(mixer, _LAYOUT, layout)

    return hook


def _take_layout(mixer: nn.Module):
    def hook(layer: nn.Module, args: tuple, output: Any) -> None:
        setattr(mixer, _LAYOUT, None)

    return hook


def _dispatching(tree_forward: TreeForward):
    def forward(module: Any, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        layout = getattr(module, _LAYOUT, None)
        if layout is None:
            return getattr(module, _STOCK_FORWARD)(hidden_states, *args, **kwargs)
        if not isinstance(layout, RecurrentTensors):
            raise ValueError(
                f"{type(module).__name__} got a tree layout without {RECURRENT_LAYOUT_KWARG}="
                "RecurrentTensors: recurrent layers need the row's tables; build them with "
                "recurrent_tensors(row, device, conv_kernel) (packed_log_probs does)"
            )
        return tree_forward(module, hidden_states, layout)

    return forward
