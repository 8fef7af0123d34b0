"""Tree-aware gated DeltaNet: the linear-attention layers of Qwen3.5/3.6 and Qwen3-Next on a
tree-packed row.

transformers' gated DeltaNet forward runs its input as one sequence: on a packed row the
convolution window and the recurrent state would run from one sample into the next. Under
tree attention (:func:`enable_tree_gated_delta_net`, called by
:func:`~asyncgrpo.adapters.kernels.attention.enable_tree_attention`) each such layer instead:

* projects every token of the row at once (token-local);
* convolves each token with its ``K - 1`` predecessors along its own trie path
  (:attr:`~asyncgrpo.core.packing.recurrent_tree.RecurrentLayout.conv_window`);
* runs the chunked delta rule once per trie depth, a right-padded batch of that depth's
  segments, each starting from its parent segment's final state (padding has ``beta = 0`` and
  ``g = 0``, so it leaves a state unchanged); gradients flow back into the parent states.

The index tables come from :func:`asyncgrpo.core.packing.recurrent_tree.recurrent_layout`, built
once per row (:func:`recurrent_tensors`) and passed to every layer as the
:data:`RECURRENT_LAYOUT_KWARG` keyword (``packed_log_probs`` does this). Without that keyword
and without a tree layout, the layer runs transformers' own forward, so a model switched back
to ``"sdpa"`` computes unpacked batches as before.

The delta rule is transformers' function of the model's own module
(``torch_chunk_gated_delta_rule``; on CUDA with ``fla`` installed, fla's
``chunk_gated_delta_rule``).
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard

import attrs
import torch
from torch import Tensor
from transformers.activations import ACT2FN

from asyncgrpo.core.packing.recurrent_tree import recurrent_layout
from asyncgrpo.core.packing.tree import PackedRow

RECURRENT_LAYOUT_KWARG = "recurrent_layout"
TREE_LAYOUT_KWARG = "tree_layout"

GATED_DELTA_NET_CLASSES = frozenset(
    {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"}
)
"""transformers' gated DeltaNet layers that :func:`tree_gated_delta_net_forward` computes."""


class GatedDeltaNetLayer(Protocol):
    """What the tree forward reads of a layer of :data:`GATED_DELTA_NET_CLASSES` (the members
    the families share; their input projections differ, see :func:`_projections`). Dimensions
    are counts of features or heads."""

    key_dim: int
    value_dim: int
    head_k_dim: int
    head_v_dim: int
    num_k_heads: int
    num_v_heads: int
    conv_kernel_size: int
    activation: str
    A_log: torch.nn.Parameter
    dt_bias: torch.nn.Parameter
    conv1d: torch.nn.Conv1d
    norm: torch.nn.Module
    out_proj: torch.nn.Linear

    forward: Callable[..., Any]


def is_gated_delta_net(module: object) -> TypeGuard[GatedDeltaNetLayer]:
    """Whether ``module`` is one of transformers' gated DeltaNet layers
    (:data:`GATED_DELTA_NET_CLASSES`, also under FSDP2's subclass)."""
    return _gated_delta_net_class(module) is not None


_STOCK_FORWARD = "_asyncgrpo_stock_forward"


@attrs.frozen(eq=False)
class DepthTensors:
    """One depth level on the device (see
    :class:`~asyncgrpo.core.packing.recurrent_tree.DepthLevel`).

    Attributes:
        rows: long [B, L], row indices padded with ``T``.
        parent_slots: long [B], parents' slots among earlier levels' final states (-1: root).
        valid_flat: long [n], flat indices of real rows in ``rows``.
    """

    rows: Tensor
    parent_slots: Tensor
    valid_flat: Tensor
    is_root: bool


@attrs.frozen(eq=False)
class RecurrentTensors:
    """A row's recurrent index tables on the model's device, shared by every layer.

    Attributes:
        num_tokens: ``T``.
        conv_window: long [T, K], path predecessors then the token, ``T`` for padding.
        levels: per trie depth, root first.
        output_order: long [T], each row's place among the levels' concatenated outputs.
    """

    num_tokens: int
    conv_window: Tensor
    levels: tuple[DepthTensors, ...]
    output_order: Tensor


def recurrent_tensors(
    row: PackedRow, device: torch.device | str, conv_kernel: int
) -> RecurrentTensors:
    """The row's :class:`RecurrentTensors` for a convolution of ``conv_kernel`` taps."""
    layout = recurrent_layout(row, conv_kernel)

    def long(array) -> Tensor:
        return torch.tensor(array, dtype=torch.long, device=device)

    return RecurrentTensors(
        num_tokens=layout.num_tokens,
        conv_window=long(layout.conv_window),
        levels=tuple(
            DepthTensors(
                rows=long(level.rows),
                parent_slots=long(level.parent_slots),
                valid_flat=long(level.valid_flat),
                is_root=depth == 0,
            )
            for depth, level in enumerate(layout.levels)
        ),
        output_order=long(layout.output_order),
    )


def enable_tree_gated_delta_net(model: torch.nn.Module) -> int:
    """Route every gated DeltaNet layer of ``model`` through :func:`tree_gated_delta_net_forward`
    whenever a forward carries a tree layout; returns the number of layers switched.

    Idempotent. Forwards without the tree keywords keep transformers' behaviour.
    """
    switched = 0
    for module in model.modules():
        if not is_gated_delta_net(module):
            continue
        if not hasattr(module, _STOCK_FORWARD):
            setattr(module, _STOCK_FORWARD, module.forward)
            module.forward = types.MethodType(_dispatching_forward, module)
        switched += 1
    return switched


def _dispatching_forward(
    module: GatedDeltaNetLayer,
    hidden_states: Tensor,
    cache_params: object | None = None,
    attention_mask: Tensor | None = None,
    **kwargs: object,
) -> Tensor:
    layout = kwargs.get(RECURRENT_LAYOUT_KWARG)
    if layout is None and kwargs.get(TREE_LAYOUT_KWARG) is None:
        stock = getattr(module, _STOCK_FORWARD)
        return stock(
            hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
        )
    if not isinstance(layout, RecurrentTensors):
        raise ValueError(
            f"{type(module).__name__} got a tree layout without {RECURRENT_LAYOUT_KWARG}="
            f"RecurrentTensors (got {type(layout).__name__}): gated DeltaNet layers need the "
            "row's recurrent tables; build them with recurrent_tensors(row, device, "
            "recurrent_kernel(model)) (packed_log_probs does)"
        )
    if cache_params is not None or attention_mask is not None:
        raise ValueError(
            "tree-packed gated DeltaNet takes no cache and no attention mask: forward with "
            "use_cache=False and no attention_mask"
        )
    return tree_gated_delta_net_forward(module, hidden_states, layout)


def tree_gated_delta_net_forward(
    module: GatedDeltaNetLayer, hidden_states: Tensor, layout: RecurrentTensors
) -> Tensor:
    """A gated DeltaNet layer over one tree-packed row.

    Args:
        module: a transformers gated DeltaNet layer (:data:`GATED_DELTA_NET_CLASSES`).
        hidden_states: float [1, T, hidden].
        layout: the row's :class:`RecurrentTensors`.

    Returns:
        float [1, T, hidden], each token's output as if its sample were forwarded alone.
    """
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != layout.num_tokens:
        raise ValueError(
            f"tree-packed gated DeltaNet takes one row of {layout.num_tokens} tokens, got "
            f"hidden states of shape {tuple(hidden_states.shape)}"
        )
    mixed_qkv, z, b, a = _projections(module, hidden_states[0])
    mixed_qkv = tree_conv(module, mixed_qkv, layout.conv_window)
    query, key, value = torch.split(
        mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], -1
    )
    t = layout.num_tokens
    query = query.reshape(t, -1, module.head_k_dim)
    key = key.reshape(t, -1, module.head_k_dim)
    value = value.reshape(t, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)
    repeat = module.num_v_heads // module.num_k_heads
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=1)
        key = key.repeat_interleave(repeat, dim=1)
    core = _tree_delta_rule(_delta_rule_function(module), query, key, value, g, beta, layout)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, t, -1))


def _projections(module: Any, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [T, hidden] -> mixed q|k|v [T, 2 key_dim + value_dim] (before the convolution),
    z [T, Hv, Dv], b [T, Hv], a [T, Hv]: transformers' projections of either family. ``module``
    is a :class:`GatedDeltaNetLayer` with one family's projection members (typed ``Any``: the
    families name them differently, and the one present is found with ``hasattr``)."""
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: fused, grouped by key head
        query, key, value, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden[None]), module.in_proj_ba(hidden[None])
        )
        mixed = torch.cat([x.reshape(x.shape[1], -1) for x in (query, key, value)], dim=-1)
        return mixed, z[0], b[0], a[0]
    t = hidden.shape[0]
    z = module.in_proj_z(hidden).reshape(t, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def tree_conv(module: Any, mixed: Tensor, window: Tensor) -> Tensor:
    """The depthwise causal convolution along each token's path, then the layer's activation:
    mixed [T, C] -> [T, C]; ``window`` long [T, K] (row ``T`` is a zero row). ``module`` has a
    depthwise ``conv1d`` and an ``activation`` name (gated DeltaNet, Mamba-2)."""
    weight = module.conv1d.weight.squeeze(1)  # [C, K]
    padded = torch.cat([mixed, mixed.new_zeros(1, mixed.shape[1])]).to(weight.dtype)
    out = torch.einsum("tkc,ck->tc", padded[window], weight)
    if module.conv1d.bias is not None:
        out = out + module.conv1d.bias
    return ACT2FN[module.activation](out).to(mixed.dtype)


DeltaRule = Callable[..., tuple[Tensor, Tensor]]
"""The chunked delta rule (transformers' or fla's): ``(output, final state)``; the final state
is None unless ``output_final_state=True``, which :func:`_tree_delta_rule` always passes."""


def _tree_delta_rule(
    delta_rule: DeltaRule,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    layout: RecurrentTensors,
) -> Tensor:
    """query/key [T, Hv, Dk], value [T, Hv, Dv], g/beta [T, Hv] -> output [T, Hv, Dv]: one
    batched delta-rule call per trie depth, each segment from its parent's final state."""
    query, key, value, g, beta = (with_padding_row(x) for x in (query, key, value, g, beta))

    def level_rule(rows: Tensor, initial: Tensor | None) -> tuple[Tensor, Tensor]:
        return delta_rule(
            query[rows],
            key[rows],
            value[rows],
            g=g[rows],
            beta=beta[rows],
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    return scan_by_depth(layout, level_rule)


def with_padding_row(x: Tensor) -> Tensor:
    """``x`` [T, ...] with a zero row ``T`` after it, which the levels' padding indexes."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def scan_by_depth(
    layout: RecurrentTensors,
    scan: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]],
) -> Tensor:
    """A recurrence over a tree-packed row, one batched call per trie depth: ``scan(rows,
    initial)`` runs the segments of a depth (``rows`` long [B, L], right-padded with ``T``)
    from their parents' final states (``initial`` [B, ...], None at the roots) and returns
    ``(output [B, L, ...], final state [B, ...])``. Returns the outputs of the row's tokens in
    row order, [T, ...]; gradients flow back into the parents' states."""
    finals: list[Tensor] = []
    outputs: list[Tensor] = []
    for level in layout.levels:
        initial = None if level.is_root else torch.cat(finals)[level.parent_slots]
        out, final = scan(level.rows, initial)
        finals.append(final)
        outputs.append(out.reshape(-1, *out.shape[2:])[level.valid_flat])
    return torch.cat(outputs)[layout.output_order]


def _delta_rule_function(module: GatedDeltaNetLayer) -> DeltaRule:
    """fla's ``chunk_gated_delta_rule`` on CUDA when installed, else the function
    transformers' own forward of this layer calls."""
    if module.out_proj.weight.device.type == "cuda":
        fla = _fla_chunk_gated_delta_rule()
        if fla is not None:
            return fla
    return sys.modules[_gated_delta_net_class(module).__module__].torch_chunk_gated_delta_rule


@functools.cache
def _fla_chunk_gated_delta_rule() -> DeltaRule | None:
    try:
        return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except ImportError:
        return None


def _gated_delta_net_class(module: object) -> type | None:
    """transformers' gated DeltaNet class of ``module`` (also under FSDP2's subclass)."""
    for cls in type(module).__mro__:
        if cls.__name__ in GATED_DELTA_NET_CLASSES:
            return cls
    return None
