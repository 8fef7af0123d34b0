"""FSDP2 sharding of the learner's model, its precision, and reading the sharded weights whole.

**Sharding.** Each decoder layer is one FSDP2 unit, and the root unit is the
:class:`~asyncgrpo.adapters.kernels.packed_policy.PackedPolicy` around the model, whose forward is
the packed forward. So the parameters outside the layers (embeddings, final norm, ``lm_head``,
called once per LM-head chunk) are gathered once per micro-batch and reduce-scattered once per
backward, however many chunks a process's row has.

**Loading.** FSDP2 does not broadcast: either every process loads the same files, or (what
``AsyncGRPOTrainer`` does under torchrun) rank 0 loads them and the other ranks build the
architecture on the meta device; :func:`load_from_rank0` then sends each rank its shards,
one tensor at a time, and no rank but rank 0 holds a whole fp32 copy of the model.

**Gradient sum across processes.** :func:`asyncgrpo.core.loss.losses.normalize_loss` divides each
process's loss by the micro-batch's trained tokens summed over all processes (and by the number
of micro-batches), so the step's gradient is the SUM of the processes' gradients. FSDP2's
reduce-scatter averages by default; :func:`shard` sets every FSDP unit's gradient divide factor
to 1 with sum reduction forced (``set_gradient_divide_factor(1.0)``,
``set_force_sum_reduction_for_comms(True)``), so the reduce-scatter sums and the loss is used
as is. ``tests/distributed`` checks that 2 processes update the weights exactly as 1 process
holding all their rows.

**Precision.** ``bf16`` (default: on with CUDA, off on CPU) selects FSDP2 mixed precision:
bf16 forward and backward, fp32 gradient reduction, and fp32 master weights and optimizer
states (trainable parameters are upcast before sharding, as accelerate does), unless
``dtype="bfloat16"`` asks for pure bf16 training. Exported weights are in bf16 then, as TRL's
AsyncGRPOTrainer documentation says; checkpoints for resuming keep the master weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import cast

import torch
import torch.distributed as dist
from peft import PeftModel
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from asyncgrpo.adapters.kernels.attention_parts import config_setting
from asyncgrpo.adapters.kernels.packed_forward import base_model
from asyncgrpo.adapters.kernels.packed_policy import PackedPolicy
from asyncgrpo.core.packing.memory import DecoderShape, ShardedModel
from asyncgrpo.core.packing.precision import (
    BF16_MIN_PARAMETERS,
    PrecisionChoice,
    choose_precision,
)


def decoder_layers(model: PreTrainedModel | PeftModel) -> nn.ModuleList:
    """The decoder layers of a causal LM (or of the base model of a ``PeftModel``)."""
    base = base_model(model)
    layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(base).__name__} has no decoder.layers ModuleList to shard with FSDP2; the "
            "learner supports transformers decoder-only causal LMs (Qwen3, Llama, ...)"
        )
    return layers


def decoder_shape(model: PreTrainedModel) -> DecoderShape:
    """What a packed row's activations depend on, from ``model``'s text config and its first
    decoder layer as built: the norms over the hidden size in it and whether it norms each
    query and key head (:func:`~asyncgrpo.core.packing.memory.layer_values_per_token`)."""
    config = model.config.get_text_config()
    hidden = int(getattr(config, "hidden_size", 0))
    heads = int(config_setting(config, "num_attention_heads") or 1)
    head_dim = int(config_setting(config, "head_dim") or hidden // max(heads, 1))
    kv_heads = int(config_setting(config, "num_key_value_heads") or heads)
    named = dict(decoder_layers(model)[0].named_modules())
    qk_norm = any(name.endswith(("q_norm", "k_norm")) for name in named)
    hidden_norms = sum(
        1
        for name, module in named.items()
        if name.rsplit(".", 1)[-1].endswith("norm")
        and not name.endswith(("q_norm", "k_norm"))
        and tuple(getattr(getattr(module, "weight", None), "shape", ())) == (hidden,)
    )
    return DecoderShape(
        int(getattr(config, "num_hidden_layers", 1)),
        hidden,
        kv_heads * head_dim,
        int(config_setting(config, "intermediate_size") or 4 * hidden),
        heads,
        q_width=heads * head_dim,
        head_dim=head_dim,
        hidden_norms=hidden_norms or 2,
        qk_norm=qk_norm,
    )


def shard(policy: PackedPolicy, mesh: DeviceMesh, precision: MixedPrecisionPolicy) -> None:
    """``fully_shard`` each decoder layer, then the root, with gradients summed over ranks.

    One process holds every shard whole: a layer keeps the weights gathered for its forward
    until its backward (no second gather), and its gradient is left as it is (a sum over one
    process; a divide factor set would still cost a division and a copy of each layer's
    gradients per step). Measured on the real model: `docs/benchmarks.md`."""
    alone = mesh.size() == 1
    for layer in decoder_layers(policy.model):
        fully_shard(layer, mesh=mesh, mp_policy=precision, reshard_after_forward=not alone)
    fully_shard(policy, mesh=mesh, mp_policy=precision, reshard_after_forward=not alone)
    if alone:
        return
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def built_on_meta(model: nn.Module) -> bool:
    """``model`` was built on the meta device, its weights not read on this process (the
    ranks after rank 0 of a run that loads once, :func:`load_from_rank0`)."""
    return any(p.is_meta for p in model.parameters())


def load_from_rank0(
    policy: PackedPolicy, weights: Mapping[str, Tensor], device: torch.device
) -> None:
    """Give every process its shards of rank 0's weights, after :func:`shard` (collective).

    ``weights`` is rank 0's whole state dict of ``policy.model``, taken before sharding (an
    empty dict on the other ranks). A process whose model was built on the meta device gets
    empty shards on ``device`` first; then rank 0 broadcasts one tensor at a time and each
    process keeps its own shard of it, so no process but rank 0 ever holds the whole model.
    Buffers, which FSDP2 does not shard (and the non-persistent ones, such as the rotary
    embedding's frequencies, which no state dict has), are broadcast from rank 0 whole.
    """
    if built_on_meta(policy):
        policy.to_empty(device=device)  # the root's own _apply re-registers the shards
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(policy.model, dict(weights), options=options)
    for buffer in policy.buffers():
        dist.broadcast(buffer, src=0)


def sharded_model(model: PreTrainedModel | PeftModel, bf16: bool, processes: int) -> ShardedModel:
    """What this process holds of ``model`` once :func:`shard` ran: its shards of the trained
    parameters in bytes, the whole model's parameter count, its largest decoder layer's, and
    the bytes of a value of the copy FSDP2 gathers for the forward."""
    trained = sum(
        _local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )
    parameters = sum(_whole_numel(p) for p in model.parameters())
    largest = max(
        (sum(_whole_numel(p) for p in layer.parameters()) for layer in decoder_layers(model)),
        default=0,
    )
    compute = 2 if bf16 else next(model.parameters()).element_size()
    return ShardedModel(trained, parameters, largest, compute, processes)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _whole_numel(tensor: Tensor) -> int:
    return math.prod(tensor.shape)  # a DTensor's shape is the whole tensor's


def precision_for(
    bf16: bool | None, device: torch.device, model: PreTrainedModel
) -> PrecisionChoice:
    """The learner's compute precision (:func:`~asyncgrpo.core.packing.precision.choose_precision`):
    on a CPU, with ``bf16`` unset and a model large enough, the speed of bf16 matrix products
    at the model's hidden and intermediate sizes is measured first (a few hundred ms)."""
    parameters = sum(p.numel() for p in model.parameters())
    speedup = None
    if bf16 is None and device.type != "cuda" and parameters >= BF16_MIN_PARAMETERS:
        config = model.config.get_text_config()
        hidden = int(getattr(config, "hidden_size", 1024))
        inner = int(getattr(config, "intermediate_size", 4 * hidden))
        speedup = matmul_seconds(hidden, inner, torch.float32) / matmul_seconds(
            hidden, inner, torch.bfloat16
        )
    return choose_precision(bf16, device.type == "cuda", parameters, speedup)


def matmul_seconds(
    hidden: int, inner: int, dtype: torch.dtype, rows: int = 256, repeats: int = 5
) -> float:
    """The fastest of ``repeats`` products ``[rows, hidden] @ [hidden, inner]`` in ``dtype``
    with this process's threads, after one warm-up."""
    a = torch.randn(rows, hidden, dtype=dtype)
    b = torch.randn(hidden, inner, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def mixed_precision(bf16: bool) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 reduction under ``bf16``; no casts (the weights' dtype) else."""
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def upcast_trainable(model: nn.Module) -> None:
    """Trainable floating parameters to fp32 in place: FSDP2 then keeps fp32 master weights."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point():
            param.data = param.data.float()


def clip_gradients(model: nn.Module, max_grad_norm: float) -> float:
    """Clip the sharded gradients to ``max_grad_norm`` (none when <= 0); the total norm before
    clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_grad_norm if max_grad_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def weights_finite(model: nn.Module) -> bool:
    """Whether every trainable weight is finite on every process (collective: each process
    checks its own shards, one all-reduce of the verdict)."""
    local = [
        p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad
    ]
    device = local[0].device if local else torch.device("cpu")
    bad = torch.zeros((), dtype=torch.int32, device=device)
    # the extremes are NaN or infinite exactly when an entry is (min and max propagate NaN):
    # one vectorised pass over each tensor, where isfinite's comparisons took 10x as long on
    # the real model's 135M weights; an empty shard has none to check
    for tensor in local:
        if tensor.numel():
            bad += ~torch.stack(torch.aminmax(tensor.detach())).isfinite().all()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(bad)
    return not bool(bad)


def gathered_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded state dict on the CPU in the weights' own dtypes (collective: every
    process must call it; rank 0 gets the weights, the others an empty dict)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # a model's state dict holds tensors only (torch's type spans optimizer states too)
    return cast(dict[str, Tensor], get_model_state_dict(model, options=options))


def iter_full_tensors(
    model: nn.Module, keep: Callable[[str], bool]
) -> Iterator[tuple[str, Tensor]]:
    """``(name, unsharded tensor)`` of each state-dict entry whose name ``keep`` accepts, one
    all-gather at a time, on the model's device (collective: every process iterates it to the
    end in step)."""
    for name, tensor in model.state_dict().items():
        if keep(name):
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach()


def meta_state_dict(model: nn.Module, keep: Callable[[str], bool]) -> dict[str, Tensor]:
    """The state-dict entries ``keep`` accepts as meta tensors of their full (unsharded)
    shapes and dtypes, without gathering anything."""
    return {
        name: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
        for name, t in model.state_dict().items()
        if keep(name)
    }
