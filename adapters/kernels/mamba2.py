"""Tree-aware Mamba-2: the state-space layers of Mamba-2, Bamba, Granite 4.0 hybrids,
Nemotron-H and Falcon-H1 on a tree-packed row.

A Mamba-2 mixer projects each token to a gate ``z``, the convolved channels ``xBC`` and a step
``dt``; convolves ``xBC`` over the token and its ``K - 1`` predecessors; and runs the
selective scan ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = C_t h_t + D x_t``, then a
gated norm and the output projection. transformers runs both along the row, so on a packed
row the convolution and the state would run from one sample into the next. Under tree
attention (:func:`enable_tree_mamba2`, called by
:func:`~asyncgrpo.adapters.kernels.attention.enable_tree_attention`) each mixer instead:

* projects every token of the row at once (token-local);
* convolves each token with its ``K - 1`` predecessors along its own trie path
  (:attr:`~asyncgrpo.core.packing.recurrent_tree.RecurrentLayout.conv_window`);
* runs the chunked scan once per trie depth, a right-padded batch of that depth's segments,
  each starting from its parent segment's final state (padding has ``x = 0`` and ``dt = 0``,
  so it leaves a state unchanged); gradients flow back into the parent states.

The scan is the model module's own ``mamba2_chunk_scan`` (transformers' torch reference or the
hub kernel it loads), with the step's softplus, bias and limits applied here first so that
padding can be given ``dt = 0``. Falcon-H1's multipliers (``ssm_in_multiplier``,
``mup_vector``) and its optional gated norm are applied as its forward applies them. The
decoder layers call their mixer without the row's tables, which reach it through the layer
(:mod:`asyncgrpo.adapters.kernels.recurrent_routing`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncgrpo.adapters.kernels.gated_delta_net import (
    RecurrentTensors,
    scan_by_depth,
    tree_conv,
    with_padding_row,
)
from asyncgrpo.adapters.kernels.recurrent_routing import route_to_tree_forward

MAMBA2_CLASSES = frozenset(
    {
        "Mamba2Mixer",
        "BambaMixer",
        "GraniteMoeHybridMambaLayer",
        "NemotronHMamba2Mixer",
        "FalconH1Mixer",
    }
)
"""transformers' Mamba-2 mixers that :func:`tree_mamba2_forward` computes."""


def _mamba2_class(module: object) -> type | None:
    """transformers' Mamba-2 class of ``module`` (also under FSDP2's subclass)."""
    return next((c for c in type(module).__mro__ if c.__name__ in MAMBA2_CLASSES), None)


def is_mamba2(module: object) -> bool:
    """Whether ``module`` is one of :data:`MAMBA2_CLASSES`."""
    return _mamba2_class(module) is not None


def enable_tree_mamba2(model: nn.Module) -> int:
    """Route every Mamba-2 mixer of ``model`` through :func:`tree_mamba2_forward` whenever its
    decoder layer's forward carries the row's recurrent tables; returns how many. Idempotent."""
    return route_to_tree_forward(model, is_mamba2, tree_mamba2_forward)


def tree_mamba2_forward(module: Any, hidden_states: Tensor, layout: RecurrentTensors) -> Tensor:
    """A Mamba-2 mixer over one tree-packed row.

    Args:
        module: a mixer of :data:`MAMBA2_CLASSES`.
        hidden_states: float [1, T, hidden].
        layout: the row's :class:`RecurrentTensors` (``conv_window`` of ``K`` columns).

    Returns:
        float [1, T, hidden], each token's output as if its sample were forwarded alone.
    """
    t = layout.num_tokens
    if hidden_states.shape[:2] != (1, t):
        raise ValueError(
            f"a tree-packed Mamba-2 mixer takes one row of {t} tokens, got hidden states of "
            f"shape {tuple(hidden_states.shape)}"
        )
    dtype = hidden_states.dtype
    hidden = hidden_states[0]
    if hasattr(module, "ssm_in_multiplier"):  # Falcon-H1
        hidden = hidden * module.ssm_in_multiplier
    projected = module.in_proj(hidden)
    if hasattr(module, "mup_vector"):  # Falcon-H1
        projected = projected * module.mup_vector.reshape(-1)
    gate, xbc, dt = projected.split(
        [module.intermediate_size, module.conv_dim, module.num_heads], dim=-1
    )
    xbc = tree_conv(module, xbc, layout.conv_window)
    groups = module.n_groups * module.ssm_state_size
    x, b, c = xbc.split([module.intermediate_size, groups, groups], dim=-1)
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype))
    low, high = module.time_step_limit
    dt = dt.clamp(min=low, max=high)
    scan = _tree_scan(module, x, dt, b, c, layout)
    y = scan.reshape(t, -1)
    # Falcon-H1 without its norm gates alone
    y = module.norm(y, gate) if getattr(module, "mamba_rms_norm", True) else y * F.silu(gate)
    return module.out_proj(y.to(dtype))[None]


def _tree_scan(
    module: Any, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, layout: RecurrentTensors
) -> Tensor:
    """x [T, H * P], dt [T, H] (after softplus and limits), b/c [T, G * N] -> y [T, H, P]:
    the chunked scan once per trie depth, each segment from its parent's final state."""
    heads, head_dim = module.num_heads, module.head_dim
    groups, state = module.n_groups, module.ssm_state_size

    # the padding row T has x = 0 and dt = 0, which leave a state as it is
    x = with_padding_row(x.reshape(-1, heads, head_dim))
    b, c = (with_padding_row(tensor.reshape(-1, groups, state)) for tensor in (b, c))
    dt = with_padding_row(dt)
    chunk_scan = sys.modules[_mamba2_class(module).__module__].mamba2_chunk_scan
    a = -torch.exp(module.A_log.float())

    def level_scan(rows: Tensor, initial: Tensor | None) -> tuple[Tensor, Tensor]:
        return chunk_scan(
            x[rows],
            dt[rows],
            a,
            b[rows],
            c[rows],
            chunk_size=module.chunk_size,
            D=module.D,
            initial_states=initial,
            return_final_states=True,
        )

    return scan_by_depth(layout, level_scan)
