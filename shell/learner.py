"""The learner: the trained model and its optimizer on one process, sharded with FSDP2.

Every process of a ``torchrun`` job (or a lone process) owns one :class:`Learner`. A step is
one call of :meth:`Learner.train_step` with this process's tree-packed row of each micro-batch
(:mod:`asyncgrpo.core.planner`); every process must call it with the same number of
micro-batches, since the sharded forward and backward are collective.

**Sharding.** Each decoder layer is one FSDP2 unit, and the root unit is :class:`PackedPolicy`,
a small module around the model whose forward is the packed forward. So the parameters outside
the layers (embeddings, final norm, ``lm_head``, called once per LM-head chunk) are gathered
once per micro-batch and reduce-scattered once per backward, however many chunks a process's
row has. Every process must hold identical weights before sharding (FSDP2 does not broadcast):
load them from the same files; LoRA adapters are initialised under ``config.seed``.

**Gradient sum across processes.** :func:`asyncgrpo.core.losses.normalize_loss` divides each
process's loss by the micro-batch's trained tokens summed over all processes (and by the number
of micro-batches), so the step's gradient is the SUM of the processes' gradients. FSDP2's
reduce-scatter averages by default; the learner sets every FSDP unit's gradient divide factor
to 1 with sum reduction forced (``set_gradient_divide_factor(1.0)``,
``set_force_sum_reduction_for_comms(True)``), so the reduce-scatter sums and the loss is used
as is. ``tests/distributed`` checks that 2 processes update the weights exactly as 1 process
holding all their rows.

**Empty rows.** ``None`` in ``micro_batches`` means this process has no samples in that
micro-batch. It still runs the forward and backward of a 2-token dummy row whose loss is
multiplied by 0, so that its all-gathers and reduce-scatters pair with the other processes';
it adds 0 to every gradient, 0 trained tokens to the global count and no metrics.

**Precision.** ``bf16`` (default: on with CUDA, off on CPU) selects FSDP2 mixed precision:
bf16 forward and backward, fp32 gradient reduction, and fp32 master weights and optimizer
states (trainable parameters are upcast before sharding, as accelerate does), unless
``dtype="bfloat16"`` asks for pure bf16 training. Exported weights (:meth:`full_state_dict`,
:meth:`save_pretrained`) are in bf16 then, as TRL's AsyncGRPOTrainer documentation says;
checkpoints for resuming keep the master weights.

**MoE.** For a Mixture-of-Experts model the router logits of every layer are captured during the
packed forward, and transformers' load-balancing loss of the row times ``router_aux_loss_coef``
(the model config's value unless the config sets one) is added, averaged over the micro-batch's
rows on all processes and over the micro-batches.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import random
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from peft import PeftConfig, PeftModel
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedModel,
    get_scheduler,
    set_seed,
)

from asyncgrpo.adapters.attention import Backend, enable_tree_attention
from asyncgrpo.adapters.packed_forward import DEFAULT_CHUNK_SIZE, packed_log_probs
from asyncgrpo.adapters.peft_models import adapter_state_dict, merged_state_dict, wrap_with_lora
from asyncgrpo.adapters.vision_language import (
    frozen_prefixes,
    is_synced_weight,
    is_vision_language,
)
from asyncgrpo.core.losses import (
    LossConfig,
    SamplerTopK,
    clipped_surrogate,
    loss_metrics,
    normalize_loss,
    score_centered_surrogate,
)
from asyncgrpo.core.metrics import MetricWindow, Observation, merge, record, summarize, value
from asyncgrpo.core.packing import PackedRow, pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.shell.config import AsyncGRPOConfig

CHECKPOINT_WEIGHTS = "dcp"
LEARNER_STATE = "learner_state.pt"


# --- process group -------------------------------------------------------------------------


def default_device(config: AsyncGRPOConfig | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available (and ``config.use_cpu`` is off), else the
    CPU."""
    if torch.cuda.is_available() and not (config is not None and config.use_cpu):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 1800) -> bool:
    """Initialise the default process group unless one exists (nccl on CUDA, gloo on CPU).

    Under ``torchrun`` it reads ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``
    from the environment; otherwise it makes a 1-process group on a free localhost port.

    Returns:
        True when this call created the group (the caller then destroys it).
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(
            backend, device_id=device if device.type == "cuda" else None, timeout=timeout
        )
    else:
        address = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend, init_method=address, rank=0, world_size=1, timeout=timeout)
    return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- the sharded model ---------------------------------------------------------------------


class PackedPolicy(nn.Module):
    """The FSDP2 root: its forward is :func:`packed_log_probs` on one row.

    Returns ``(logp [N], entropy [N], topk_logp [N, K] or None)`` in nats, as tensors so that
    FSDP2 hooks its backward.
    """

    def __init__(
        self, model: PreTrainedModel, temperature: float, chunk_size: int, backend: Backend | None
    ) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.backend = backend

    def forward(
        self, row: PackedRow, topk: SamplerTopK | None, candidate_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        out = packed_log_probs(
            self.model,
            row,
            self.temperature,
            topk=topk,
            candidate_mask=candidate_mask,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )
        return out.logp, out.entropy, out.topk_logp


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (or of the base model of a ``PeftModel``)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(base).__name__} has no decoder.layers ModuleList to shard with FSDP2; the "
            "learner supports transformers decoder-only causal LMs (Qwen3, Llama, ...)"
        )
    return layers


def shard(policy: PackedPolicy, mesh: DeviceMesh, precision: MixedPrecisionPolicy) -> None:
    """``fully_shard`` each decoder layer, then the root, with gradients summed over ranks."""
    for layer in decoder_layers(policy.model):
        fully_shard(layer, mesh=mesh, mp_policy=precision)
    fully_shard(policy, mesh=mesh, mp_policy=precision)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def uses_bf16(config: AsyncGRPOConfig, device: torch.device) -> bool:
    """``config.bf16``, or on CUDA only when it is None."""
    return device.type == "cuda" if config.bf16 is None else config.bf16


def mixed_precision(config: AsyncGRPOConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 reduction under ``bf16``; no casts (the weights' dtype) else."""
    if uses_bf16(config, device):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def upcast_trainable(model: nn.Module) -> None:
    """Trainable floating parameters to fp32 in place: FSDP2 then keeps fp32 master weights."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point():
            param.data = param.data.float()


# --- MoE router auxiliary loss -------------------------------------------------------------


@attrs.define
class RouterAuxLoss:
    """The load-balancing loss of a Mixture-of-Experts model over one packed row.

    Forward hooks on the router modules (those transformers records as ``router_logits``)
    collect each layer's router logits [T, E] while :meth:`capture` is active (not during the
    activation-checkpointing recomputation), and :meth:`loss` applies the model's own
    ``load_balancing_loss_func``.

    Attributes:
        coef: ``router_aux_loss_coef``.
        loss_fn: ``load_balancing_loss_func(gate_logits, num_experts, top_k)``.
        num_experts: experts per layer.
        top_k: experts each token is routed to.
        output_index: where the router logits sit in a router's output tuple.
    """

    coef: float
    loss_fn: Callable[..., Tensor]
    num_experts: int
    top_k: int
    output_index: int
    captured: list[Tensor] | None = None

    @classmethod
    def for_model(cls, model: PreTrainedModel, coef: float | None) -> RouterAuxLoss | None:
        """The aux loss of ``model`` with ``coef`` (None: the model config's value), or None
        for a dense model or a zero coefficient.

        Raises:
            ValueError: ``coef`` is set but ``model`` is not a Mixture-of-Experts model.
        """
        recorder = getattr(model, "_can_record_outputs", None) or {}
        recorder = recorder.get("router_logits")
        loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if recorder is None or loss_fn is None or recorder.target_class is None:
            if coef is not None:
                raise ValueError(
                    f"AsyncGRPOConfig.router_aux_loss_coef is {coef} but {type(model).__name__} "
                    "is not a Mixture-of-Experts model with router logits: leave it None"
                )
            return None
        coef = getattr(model.config, "router_aux_loss_coef", 0.0) if coef is None else coef
        if not coef:
            return None
        config = model.config
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        aux = cls(float(coef), loss_fn, int(experts), config.num_experts_per_tok, recorder.index)
        for module in model.modules():
            if isinstance(module, recorder.target_class):
                module.register_forward_hook(aux._record)
        return aux

    def _record(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self.captured is not None:
            logits = output[self.output_index] if isinstance(output, tuple) else output
            self.captured.append(logits)

    @contextmanager
    def capture(self) -> Iterator[list[Tensor]]:
        """Collect the router logits of the forwards run inside the block."""
        self.captured = []
        try:
            yield self.captured
        finally:
            self.captured = None

    def loss(self, router_logits: Sequence[Tensor]) -> Tensor:
        """The unscaled load-balancing loss (a scalar with grad) of one row."""
        return self.loss_fn(tuple(router_logits), self.num_experts, self.top_k)


# --- rows to tensors -----------------------------------------------------------------------


def sampler_topk(row: PackedRow, k: int, device: torch.device) -> SamplerTopK:
    """The sampler's ``k`` most probable tokens at each trained token of ``row``.

    Each position's table is cut to its ``k`` largest log-probs and padded with
    ``valid=False`` entries: ids long [N, k], logp float [N, k] (nats), valid bool [N, k].

    Raises:
        ValueError: a trained token has no table (score centering needs them all).
    """
    n = len(row.target_ids)
    tables = row.sampler_top_logprobs or (None,) * n
    ids = np.zeros((n, k), np.int64)
    logp = np.zeros((n, k), np.float32)
    valid = np.zeros((n, k), bool)
    for i, table in enumerate(tables):
        if table is None:
            raise ValueError(_missing_topk_message(row, i))
        best = sorted(table.items(), key=lambda item: (-item[1], item[0]))[:k]
        for j, (token, token_logp) in enumerate(best):
            ids[i, j], logp[i, j], valid[i, j] = token, token_logp, True
    return SamplerTopK(
        torch.from_numpy(ids).to(device),
        torch.from_numpy(logp).to(device),
        torch.from_numpy(valid).to(device),
    )


def _missing_topk_message(row: PackedRow, token: int) -> str:
    sample = row.samples[int(row.sample_index[token])]
    return (
        f"score_centering=True needs the sampler's top log-probs at every trained token, but "
        f"sample {sample.rollout_id!r} has none (TrainingSequence.sampler_top_logprobs): "
        "request num_sampler_logprobs from the server, or set score_centering=False"
    )


def candidate_mask(row: PackedRow, vocab_size: int, device: torch.device) -> Tensor | None:
    """bool [N, V]: the sampler's candidate set at each trained token (all True where a token
    has none), or None when no sample of ``row`` carries candidate sets. Memory: N x V bytes."""
    if row.candidate_sets is None:
        return None
    mask = np.zeros((len(row.target_ids), vocab_size), bool)
    for i, candidates in enumerate(row.candidate_sets):
        mask[i, list(candidates) if candidates is not None else slice(None)] = True
    return torch.from_numpy(mask).to(device)


def dummy_row(vocab_size: int) -> PackedRow:
    """A 2-token row with one trained token, forwarded by a process without samples."""
    token = vocab_size - 1
    sequence = TrainingSequence([token, token], [0, 1], [0.0, -1.0])
    return pack_row([TrainingSample(sequence, 0.0, 0, -1, -1, -1, "no-samples")])


# --- optimizer and schedule ----------------------------------------------------------------


def build_optimizer(model: nn.Module, config: AsyncGRPOConfig) -> Optimizer:
    """``config.optim`` over the trainable parameters, as transformers' ``Trainer`` builds it
    (``Trainer.get_optimizer_cls_and_kwargs``: learning rate, betas, epsilon, ``optim_args``);
    no weight decay on 1-D parameters (biases, norms)."""
    from transformers import Trainer

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(config)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    return optimizer_cls([g for g in groups if g["params"]], **kwargs)


def build_scheduler(optimizer: Optimizer, config: AsyncGRPOConfig) -> LRScheduler:
    """``transformers.get_scheduler(config.lr_scheduler_type)`` with the config's warmup and
    ``lr_scheduler_kwargs``.

    ``warmup_steps`` below 1 is a fraction of ``max_steps``, as in transformers.
    """
    total = config.max_steps if config.max_steps > 0 else None
    warmup = config.warmup_steps
    if 0 < warmup < 1:
        if total is None:
            raise ValueError(
                f"AsyncGRPOConfig.warmup_steps={warmup} is a fraction of max_steps, which is "
                "not set: set max_steps, or give warmup_steps as a number of steps"
            )
        warmup = math.ceil(warmup * total)
    return get_scheduler(
        config.lr_scheduler_type,
        optimizer,
        num_warmup_steps=int(warmup),
        num_training_steps=total,
        scheduler_specific_kwargs=config.lr_scheduler_kwargs or None,
    )


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``, to find a user optimizer's parameters after sharding."""
    return {id(p): name for name, p in model.named_parameters()}


def rebind_optimizer(optimizer: Optimizer, names: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer`` at ``model``'s sharded parameters (FSDP2 replaces them).

    Raises:
        ValueError: the optimizer already has state, or holds a parameter not in the model.
    """
    if optimizer.state:
        raise ValueError(
            "optimizers: the optimizer already has state; pass a fresh one (its state is "
            "restored by load_checkpoint)"
        )
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                "optimizers: the optimizer holds parameters that are not the model's; build it "
                "over model.parameters() of the model passed to the Learner"
            )
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


# --- RNG state -----------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA generator states (loadable with ``weights_only``)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), position, has_gauss, gauss),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(_as_tuples(state["python"]))
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), position, has_gauss, gauss))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(v) for v in value)
    return value


# --- step results --------------------------------------------------------------------------


@attrs.frozen
class StepOutput:
    """The metrics of one optimizer step, identical on every process.

    Attributes:
        metrics: one value per name (``summarize(window)``): the loss metrics of
            :func:`~asyncgrpo.core.losses.loss_metrics` (means over the step's trained tokens
            on all processes, extremes for ``_min``/``_max``), ``loss`` (the step's objective,
            summed over processes and micro-batches), ``grad_norm`` (before clipping),
            ``learning_rate`` (of this step), ``aux_loss`` (MoE only; unscaled, mean over
            rows), ``perf/fwd_bwd_s`` = ``perf/fwd_s`` + ``perf/bwd_s``, and ``perf/optimizer_s``
            (seconds, mean over processes).
        window: the same as a metric window, to merge into a logging window so that its means
            stay token-weighted over several steps.
    """

    metrics: dict[str, float]
    window: MetricWindow


@attrs.frozen
class _MicroBatch:
    """One micro-batch's loss on this process (with grad) and its metric observations."""

    loss: Tensor
    observations: tuple[Observation, ...]


# --- the learner ---------------------------------------------------------------------------


class Learner:
    """The trained model and its optimizer on one process (see the module docstring).

    Args:
        model: a causal LM with identical weights on every process (e.g. from
            :func:`asyncgrpo.adapters.models.load_causal_lm`), on the CPU or the device.
        config: learning rate, schedule, AdamW, clipping, precision, loss hyperparameters.
        peft_config: a LoraConfig to train adapters instead of the full model.
        optimizers: ``(optimizer, scheduler)`` built over ``model.parameters()`` (either may
            be None for the default AdamW and ``transformers.get_scheduler`` schedule), as
            TRL's ``optimizers`` argument; not with ``peft_config``.
        device: default :func:`default_device`.
        attention_backend: tree-attention backend; by device when None.
        chunk_size: trained positions per LM-head chunk.

    Example::

        learner = Learner(load_causal_lm(path), AsyncGRPOConfig(output_dir="out"))
        out = learner.train_step([pack_row(samples)])
        out.metrics["loss"], out.metrics["grad_norm"]
        learner.close()
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: AsyncGRPOConfig,
        *,
        peft_config: PeftConfig | None = None,
        optimizers: tuple[Optimizer | None, LRScheduler | None] = (None, None),
        device: torch.device | str | None = None,
        attention_backend: Backend | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        if peft_config is not None and optimizers[0] is not None:
            raise ValueError(
                "optimizers cannot be combined with peft_config: the adapters do not exist when "
                "the optimizer is built; leave optimizers=(None, None)"
            )
        self.config = config
        self.device = torch.device(device) if device is not None else default_device(config)
        self._owns_group = init_distributed(self.device, timeout_s=config.ddp_timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.bf16 = uses_bf16(config, self.device)
        self.loss_config = LossConfig(
            temperature=config.temperature,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            vllm_importance_sampling_clip_min=config.vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=config.vllm_importance_sampling_clip_max,
            score_centering=config.score_centering,
        )
        self.aux = RouterAuxLoss.for_model(model, config.router_aux_loss_coef)
        self.model = self._prepare(model, peft_config)
        names = parameter_names(self.model)
        self.policy = PackedPolicy(self.model, config.temperature, chunk_size, attention_backend)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        shard(self.policy, mesh, mixed_precision(config, self.device))
        self.optimizer, self.scheduler = self._optimizers(optimizers, names)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._dummy = dummy_row(self.vocab_size)
        self.step = 0

    def _prepare(self, model: PreTrainedModel, peft_config: PeftConfig | None) -> nn.Module:
        """Tree attention, gradient checkpointing, LoRA and the master-weight dtype."""
        enable_tree_attention(model)
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=self.config.gradient_checkpointing_kwargs
                or {"use_reentrant": False}
            )
        if peft_config is not None:
            set_seed(self.config.seed)
            model = wrap_with_lora(model, peft_config)
        if self.bf16 and self.config.dtype != "bfloat16":
            upcast_trainable(model)
        return model.train()

    def _optimizers(
        self, optimizers: tuple[Optimizer | None, LRScheduler | None], names: dict[int, str]
    ) -> tuple[Optimizer, LRScheduler]:
        optimizer, scheduler = optimizers
        if optimizer is None:
            optimizer = build_optimizer(self.model, self.config)
        else:
            rebind_optimizer(optimizer, names, self.model)
        return optimizer, scheduler or build_scheduler(optimizer, self.config)

    @property
    def is_peft(self) -> bool:
        return isinstance(self.model, PeftModel)

    # --- training ------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[PackedRow | None]) -> StepOutput:
        """One optimizer step over this process's row of each micro-batch (collective).

        Each micro-batch's loss is normalised by its trained tokens summed over all processes
        and by ``len(micro_batches)`` (normally ``gradient_accumulation_steps``); gradients
        are summed over processes, clipped to ``max_grad_norm`` (when > 0), and applied.

        Args:
            micro_batches: this process's rows, one per micro-batch; ``None`` where this
                process has no samples in a micro-batch. Every process passes as many.
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch (a row or None)")
        counts = self._global_counts(micro_batches)
        observations: list[Observation] = []
        loss_sum = torch.zeros((), device=self.device)
        fwd_s = fwd_bwd_s = 0.0
        for row, (tokens, rows) in zip(micro_batches, counts, strict=True):
            start = self._now()
            micro = self._micro_batch(row, tokens, rows, len(micro_batches))
            forward_done = self._now()
            micro.loss.backward()
            fwd_s += forward_done - start
            fwd_bwd_s += self._now() - start
            loss_sum += micro.loss.detach()
            observations.extend(micro.observations)
        observations += [value("perf/fwd_s", fwd_s), value("perf/bwd_s", fwd_bwd_s - fwd_s),
                         value("perf/fwd_bwd_s", fwd_bwd_s)]  # fmt: skip
        return self._finish_step(observations, loss_sum)

    def _global_counts(self, micro_batches: Sequence[PackedRow | None]) -> list[tuple[int, int]]:
        """Per micro-batch, (trained tokens, rows with samples) summed over all processes."""
        local = [(0, 0) if row is None else (len(row.target_ids), 1) for row in micro_batches]
        counts = torch.tensor(local, dtype=torch.int64, device=self.device)
        dist.all_reduce(counts)
        return [(int(t), int(r)) for t, r in counts.tolist()]

    def _micro_batch(
        self, row: PackedRow | None, tokens: int, rows: int, accumulation: int
    ) -> _MicroBatch:
        """Forward one row and build its loss: the policy loss, plus the aux loss for MoE."""
        real = row is not None
        row = row if real else self._dummy
        topk = self._topk(row)
        mask = candidate_mask(row, self.vocab_size, self.device)
        with self._capture_routers() as routers:
            logp, entropy, topk_logp = self.policy(row, topk, mask)
        if not real:
            dummy = logp.sum() + (self._aux_term(routers, 1, 1)[0] if self.aux else 0.0)
            return _MicroBatch(dummy * 0.0, ())
        per_token, sampler_logp = self._per_token_loss(row, logp, topk_logp, topk)
        loss = normalize_loss(per_token, tokens, accumulation)
        metrics = loss_metrics(
            logp,
            sampler_logp,
            entropy,
            torch.tensor(row.sample_index, device=self.device),
            self.loss_config,
            topk if self.loss_config.score_centering else None,
        )
        n = len(row.target_ids)
        observations = [value(name, v, weight=n) for name, v in metrics.items()]
        if self.aux is not None:
            aux_term, aux = self._aux_term(routers, rows, accumulation)
            loss = loss + aux_term
            observations.append(value("aux_loss", aux))
        return _MicroBatch(loss, tuple(observations))

    def _topk(self, row: PackedRow) -> SamplerTopK | None:
        if not self.loss_config.score_centering:
            return None
        if row is self._dummy:
            k = self.config.num_sampler_logprobs
            empty = torch.zeros(1, k, dtype=torch.long, device=self.device)
            return SamplerTopK(empty, empty.float(), empty.bool())
        return sampler_topk(row, self.config.num_sampler_logprobs, self.device)

    def _per_token_loss(
        self, row: PackedRow, logp: Tensor, topk_logp: Tensor | None, topk: SamplerTopK | None
    ) -> tuple[Tensor, Tensor]:
        """Per-token loss float [N] (score-centered or clipped) and the sampler log-probs."""
        sampler_logp = torch.tensor(row.sampler_logprobs, device=self.device).to(logp.dtype)
        advantages = torch.tensor(row.advantages, device=self.device).to(logp.dtype)
        if topk is not None and topk_logp is not None:
            per_token = score_centered_surrogate(
                logp, sampler_logp, advantages, topk_logp, topk, self.loss_config
            )
        else:
            per_token = clipped_surrogate(logp, sampler_logp, advantages, self.loss_config)
        return per_token, sampler_logp

    @contextmanager
    def _capture_routers(self) -> Iterator[list[Tensor]]:
        if self.aux is None:
            yield []
            return
        with self.aux.capture() as routers:
            yield routers

    def _aux_term(
        self, routers: list[Tensor], rows: int, accumulation: int
    ) -> tuple[Tensor, float]:
        """``coef * aux / (rows * accumulation)`` (with grad) and the unscaled aux value."""
        assert self.aux is not None
        aux = self.aux.loss(routers)
        return self.aux.coef * aux / (max(rows, 1) * accumulation), float(aux.detach())

    def _finish_step(self, observations: list[Observation], loss_sum: Tensor) -> StepOutput:
        """Clip, step the optimizer and the schedule, and gather the step's metrics."""
        start = self._now()
        learning_rate = float(self.optimizer.param_groups[0]["lr"])
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        observations.append(value("perf/optimizer_s", self._now() - start))
        window = self._gather_window(record(MetricWindow(), observations))
        dist.all_reduce(loss_sum)
        window = record(
            window,
            [
                value("loss", float(loss_sum)),
                value("grad_norm", grad_norm),
                value("learning_rate", learning_rate),
            ],
        )
        return StepOutput(summarize(window), window)

    def _clip_gradients(self) -> float:
        """Clip the summed gradients to ``max_grad_norm`` (> 0); the norm before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _gather_window(self, local: MetricWindow) -> MetricWindow:
        """Merge every process's window (token-weighted means, extremes) into one."""
        windows: list[MetricWindow | None] = [None] * self.world_size
        dist.all_gather_object(windows, local)
        merged = MetricWindow()
        for window in windows:
            merged = merge(merged, window or MetricWindow())
        return merged

    def _now(self) -> float:
        """Seconds, after the device has finished its queued work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # --- weights -------------------------------------------------------------------------

    @property
    def export_dtype(self) -> torch.dtype:
        """The dtype of exported weights: bf16 under bf16 training, else the weights' own."""
        if self.bf16:
            return torch.bfloat16
        return next(p for p in self.model.parameters() if p.is_floating_point()).dtype

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model weights on the CPU in :attr:`export_dtype`, for weight sync.

        With PEFT, the merged weights under the base model's keys (see
        :meth:`adapter_state_dict` for the adapters alone). Collective: every process must
        call it; rank 0 gets the weights, the others an empty dict.
        """
        full = self._gathered_state_dict()
        if self.rank != 0:
            return {}
        if self.is_peft:
            full = merged_state_dict(self.model, full)
        return {k: self._exported(v) for k, v in full.items()}

    def synced_state_dict(self) -> dict[str, Tensor]:
        """:meth:`full_state_dict` without the weights that never change (a vision-language
        model's frozen vision tower): what weight sync sends. Collective, like it."""
        prefixes = frozen_prefixes(self.model)
        return {k: v for k, v in self.full_state_dict().items() if is_synced_weight(k, prefixes)}

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of each tensor :meth:`iter_weights` yields, in order,
        without gathering anything (the same keys, dtypes and order as
        :meth:`full_state_dict`). Local: any process may call it alone."""
        shapes = {
            name: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
            for name, t in self.model.state_dict().items()
            if is_synced_weight(name, frozen_prefixes(self.model))
        }
        if self.is_peft:
            shapes = merged_state_dict(self.model, shapes)
        return [(name, self._exported(t).dtype, tuple(t.shape)) for name, t in shapes.items()]

    def iter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The unsharded weights one tensor at a time, on the learner's device, in
        :attr:`export_dtype`: what :meth:`full_state_dict` holds, without a CPU copy of the
        whole model.

        Collective: every process iterates it to the end in step (each tensor is all-gathered);
        rank 0 gets the weights. With PEFT the merged weights are built whole first, and only
        rank 0 yields them.
        """
        if self.is_peft:
            for name, tensor in self.full_state_dict().items():
                yield name, tensor.to(self.device)
            return
        for name, tensor in self.model.state_dict().items():
            if not is_synced_weight(name, frozen_prefixes(self.model)):
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, self._exported(full.detach())

    def _exported(self, tensor: Tensor) -> Tensor:
        return tensor.to(self.export_dtype) if tensor.is_floating_point() else tensor

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """The LoRA adapter weights under peft's saved keys (collective; rank 0 gets them)."""
        if not self.is_peft:
            raise ValueError("adapter_state_dict needs a Learner built with peft_config")
        full = self._gathered_state_dict()
        return adapter_state_dict(self.model, full) if self.rank == 0 else {}

    def _gathered_state_dict(self) -> dict[str, Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def save_pretrained(
        self, path: str | Path, tokenizer: Any = None, *, adapter_only: bool = False
    ) -> None:
        """Write the model (merged for PEFT) so ``AutoModelForCausalLM.from_pretrained(path)``
        loads it, or with ``adapter_only`` the PEFT adapter (``PeftModel.from_pretrained``);
        and the tokenizer when given. Collective; rank 0 writes."""
        if adapter_only and not self.is_peft:
            raise ValueError("save_pretrained(adapter_only=True) needs a Learner with peft_config")
        path = Path(path)
        if adapter_only:
            full = self._gathered_state_dict()
            if self.rank == 0:
                self.model.save_pretrained(str(path), state_dict=full)
        else:
            weights = self.full_state_dict()
            if self.rank == 0:
                self._write_model(path, weights)
        if self.rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        dist.barrier()

    def _write_model(self, path: Path, weights: dict[str, Tensor]) -> None:
        """Save ``weights`` through a fresh meta-device instance of the base architecture."""
        base = self.model.get_base_model() if self.is_peft else self.model
        config = copy.deepcopy(base.config)
        with torch.device("meta"):
            auto = (
                AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
            )
            fresh = auto.from_config(config, dtype=self.export_dtype)
        fresh.load_state_dict(weights, strict=True, assign=True)
        fresh.generation_config = base.generation_config
        fresh.save_pretrained(str(path))

    # --- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> None:
        """Save everything a resume needs under ``path`` (collective).

        ``dcp/``: model and optimizer states, sharded, with torch.distributed.checkpoint;
        ``learner_state.pt`` (rank 0): step counter and scheduler state;
        ``rng_state_<rank>.pth``: each process's RNG states.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(path / CHECKPOINT_WEIGHTS),
        )
        torch.save(rng_state(), path / f"rng_state_{self.rank}.pth")
        if self.rank == 0:
            state = {"step": self.step, "scheduler": self.scheduler.state_dict()}
            torch.save(state, path / LEARNER_STATE)
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (collective). The number of processes
        may differ; then RNG states are restored only on ranks that saved one."""
        path = Path(path)
        if not (path / LEARNER_STATE).is_file():
            raise FileNotFoundError(
                f"{path} holds no learner checkpoint ({LEARNER_STATE} is missing); pass a "
                "directory written by Learner.save_checkpoint"
            )
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(path / CHECKPOINT_WEIGHTS))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        learner_state = torch.load(path / LEARNER_STATE, weights_only=True)
        self.step = int(learner_state["step"])
        self.scheduler.load_state_dict(learner_state["scheduler"])
        self._load_rng(path / f"rng_state_{self.rank}.pth")

    def _load_rng(self, path: Path) -> None:
        if path.is_file():
            set_rng_state(torch.load(path, weights_only=True))
        else:
            warnings.warn(f"{path} is missing: RNG states not restored", stacklevel=3)

    # --- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group if this learner created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
