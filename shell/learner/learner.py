"""The learner: the trained model and its optimizer on one process, sharded with FSDP2.

Every process of a ``torchrun`` job (or a lone process) owns one :class:`Learner`. A step is
one call of :meth:`Learner.train_step` with this process's tree-packed row of each micro-batch
(:mod:`asyncgrpo.core.run.planner`); every process must call it with the same number of
micro-batches, since the sharded forward and backward are collective.

The pieces live where their seams are: the process group in
:mod:`asyncgrpo.adapters.process_group`; FSDP2 sharding, precision, and gradients summed (not
averaged) over processes in :mod:`asyncgrpo.adapters.models.fsdp`; the packed forward and the MoE
auxiliary loss in :mod:`asyncgrpo.adapters.kernels.packed_policy`; optimizer and schedule in
:mod:`asyncgrpo.shell.learner.optimization`; the checkpoint files in
:mod:`asyncgrpo.shell.learner.checkpoint`. LoRA adapters are initialised under
``config.seed``, so every process starts from identical weights.

**Empty rows.** ``None`` in ``micro_batches`` means this process has no samples in that
micro-batch. It still runs the forward and backward of a 2-token dummy row whose loss is
multiplied by 0, so that its all-gathers and reduce-scatters pair with the other processes';
it adds 0 to every gradient, 0 trained tokens to the global count and no metrics.

**Precision.** ``bf16`` trains in FSDP2 mixed precision with fp32 master weights (see
:mod:`asyncgrpo.adapters.models.fsdp`); unset, it is on with CUDA, and on a CPU for a model of
50M parameters or more when this CPU multiplies bf16 matrices at least twice as fast as fp32
(:mod:`asyncgrpo.core.packing.precision`; rank 0 measures and decides for every rank, and the
choice is logged). On a CPU the process keeps the memory a step frees for the next one
(:mod:`asyncgrpo.core.packing.host_memory`, logged as ``freed memory``). Exported weights
(``learner.export``, a :class:`~asyncgrpo.shell.learner.export.WeightExport`) are in bf16
then, as TRL's AsyncGRPOTrainer documentation says; checkpoints for resuming keep the master
weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch
import torch.distributed as dist
from peft import PeftConfig, PeftModel
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PreTrainedModel, set_seed

from asyncgrpo.adapters.host_memory import give_back_freed_memory, keep_freed_memory
from asyncgrpo.adapters.kernels.architecture_support import training_path
from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.kernels.backends import (
    BackendUnavailableError,
    ModelAttention,
    choose_backend,
)
from asyncgrpo.adapters.kernels.layout import Backend
from asyncgrpo.adapters.kernels.packed_forward import DEFAULT_CHUNK_SIZE
from asyncgrpo.adapters.kernels.packed_policy import (
    PackedPolicy,
    RouterAuxLoss,
    candidate_mask,
    dummy_row,
    empty_sampler_topk,
    sampler_topk,
)
from asyncgrpo.adapters.models.causal_lm import disable_dropout
from asyncgrpo.adapters.models.fsdp import (
    built_on_meta,
    decoder_shape,
    load_from_rank0,
    mixed_precision,
    precision_for,
    shard,
    sharded_model,
    upcast_trainable,
)
from asyncgrpo.adapters.models.lora import wrap_with_lora
from asyncgrpo.adapters.process_group import (
    HOST_MEMORY,
    control_group,
    decided_on_rank0,
    default_device,
    destroy_process_groups,
    free_bytes,
    init_distributed,
    local_processes,
    on_any_rank,
)
from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.loss.losses import normalize_loss
from asyncgrpo.core.loss.metrics import LOSS_METRICS, loss_metrics
from asyncgrpo.core.loss.objectives import TokenInputs
from asyncgrpo.core.loss.objectives.weights import OBJECTIVE_METRICS, trl_loss_config
from asyncgrpo.core.metrics import (
    MetricWindow,
    Observation,
    declared,
    mean,
    merge,
    record,
    summarize,
)
from asyncgrpo.core.packing.host_memory import trim_due
from asyncgrpo.core.packing.memory import (
    ActivationRow,
    CheckpointingChoice,
    DeviceMemory,
    choose_checkpointing,
    push_snapshot_bytes,
    reserved_after_sharding,
    row_tokens,
)
from asyncgrpo.core.packing.tree import PackedRow
from asyncgrpo.core.rollout.metrics import token_length_quarters
from asyncgrpo.core.weights.parity import STALENESS0_GAP, staleness0_tokens
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner.checkpoint import load_learner, save_learner
from asyncgrpo.shell.learner.export import WeightExport
from asyncgrpo.shell.learner.failures import out_of_memory_named
from asyncgrpo.shell.learner.optimization import optimizer_step, optimizers_for, parameter_names

log = structlog.get_logger("asyncgrpo.learner")

LEARNER_METRICS = {**LOSS_METRICS, **OBJECTIVE_METRICS}
"""How the loss's and the objective's metrics of a micro-batch aggregate (declared beside their
names in :mod:`asyncgrpo.core.loss.metrics` and :mod:`asyncgrpo.core.loss.objectives.weights`)."""

# --- step results --------------------------------------------------------------------------


@attrs.frozen
class StepOutput:
    """The metrics of one optimizer step, identical on every process.

    Attributes:
        metrics: one value per name (``summarize(window)``): the loss metrics of
            :func:`~asyncgrpo.core.loss.metrics.loss_metrics` (means over the step's trained tokens
            on all processes, or the extremes they declare), ``loss`` (the step's objective,
            summed over processes and micro-batches), ``grad_norm`` (before clipping),
            ``learning_rate`` (of this step), ``aux_loss`` (MoE only; unscaled, mean over
            rows), ``perf/fwd_bwd_s`` = ``perf/fwd_s`` + ``perf/bwd_s``, ``perf/optimizer_s``
            (seconds, mean over processes), ``train/nonfinite_step_count`` (1: skipped). A
            skipped step's window has only these timings, the learning rate and the count.
        window: the same as a metric window, to merge into a logging window so that its means
            stay token-weighted over several steps.
        skipped: the loss or the gradient norm was not finite, so the optimizer did not step
            (:mod:`asyncgrpo.core.run.divergence`).
    """

    metrics: dict[str, float]
    window: MetricWindow
    skipped: bool = False


class DeviceClock:
    """Time on the device's own timeline without waiting for it: on a GPU a mark is a CUDA
    event recorded on the current stream, read (after the work before it has finished) when
    the step's figures are taken; elsewhere it is the host clock, in seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A point in the work queued so far."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any = None) -> float:
        """Seconds from ``start`` to ``end`` (a new mark when None); on a GPU this waits for
        the work up to ``end``."""
        end = self.mark() if end is None else end
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


@attrs.frozen(eq=False)
class _MicroBatch:
    """One micro-batch's loss on this process (with grad) and its metrics, still where they
    were computed (0-d float64 tensors): :func:`_to_host` takes every micro-batch's at once.

    Attributes:
        loss: the loss term with grad.
        metrics: the declared metrics (``LEARNER_METRICS``), each over the row's ``tokens``.
        tokens: the row's trained tokens, the weight of its metrics.
        staleness0: the summed ``|logp - sampler_logp|`` over the tokens of staleness-0
            samples, and how many tokens that is; None when there are none.
        aux: the unscaled load-balancing loss (MoE), or None.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = attrs.field(factory=dict)
    tokens: int = 0
    staleness0: tuple[Tensor, int] | None = None
    aux: Tensor | None = None


def _to_host(micro_batches: Sequence[_MicroBatch]) -> list[Observation]:
    """The micro-batches' metrics as observations, copied to the host in one transfer."""
    values = [
        value
        for micro in micro_batches
        for value in [
            *micro.metrics.values(),
            *([micro.staleness0[0]] if micro.staleness0 else []),
            *([micro.aux] if micro.aux is not None else []),
        ]
    ]
    if not values:
        return []
    floats = iter(torch.stack([v.detach().reshape(()).double() for v in values]).tolist())
    observations = []
    for micro in micro_batches:
        observations += [
            declared(name, next(floats), micro.tokens, LEARNER_METRICS) for name in micro.metrics
        ]
        if micro.staleness0:
            count = micro.staleness0[1]
            observations.append(mean(STALENESS0_GAP, next(floats) / count, weight=count))
        if micro.aux is not None:
            observations.append(mean("aux_loss", next(floats)))
    return observations


# --- the learner ---------------------------------------------------------------------------


class Learner:
    """The trained model and its optimizer on one process (see the module docstring).

    Args:
        model: a causal LM with identical weights on every process (e.g. from
            :func:`asyncgrpo.adapters.models.causal_lm.load_causal_lm`), on the CPU or the device.
        config: learning rate, schedule, AdamW, clipping, precision, loss hyperparameters.
        peft_config: a LoraConfig to train adapters instead of the full model.
        optimizers: ``(optimizer, scheduler)`` built over ``model.parameters()`` (either may
            be None for the default AdamW and ``transformers.get_scheduler`` schedule), as
            TRL's ``optimizers`` argument; not with ``peft_config``.
        device: default :func:`default_device`.
        attention_backend: tree-attention backend; by device when None. Chosen once, here
            (:func:`~asyncgrpo.adapters.kernels.backends.choose_backend`, logged as
            ``attention backend``), for every row the learner forwards.
        chunk_size: trained positions per LM-head chunk.
        max_model_len: asks the server's ``max_model_len`` (tokens), the length of the rows
            when ``token_budget`` is unset; rank 0 calls it once, at start, only to decide
            gradient checkpointing. None: the model's own context length
            (``max_position_embeddings``, what ``vllm serve`` serves by default).

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
        max_model_len: Callable[[], int] | None = None,
    ) -> None:
        if peft_config is not None and optimizers[0] is not None:
            raise ValueError(
                "optimizers cannot be combined with peft_config: the adapters do not exist when "
                "the optimizer is built; leave optimizers=(None, None)"
            )
        self.config = config
        self.device = torch.device(device) if device is not None else default_device(config.use_cpu)
        self._owns_group = init_distributed(self.device, timeout_s=config.ddp_timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # every rank must compute alike: rank 0's measurement decides for all
        precision = decided_on_rank0(lambda: precision_for(config.bf16, self.device, model))
        self.bf16 = precision.bf16
        self.host_memory = keep_freed_memory(self.device.type)  # each process its own allocator
        if self.rank == 0:
            log.info("precision", bf16=precision.bf16, reason=precision.reason)
            log.info("freed memory", kept=self.host_memory.retain, reason=self.host_memory.reason)
        self.objective = config.objective()
        self.objective_settings = config.objective_settings()
        self.loss_config = trl_loss_config(config.trl_settings())  # for TRL's loss metrics
        self.aux = RouterAuxLoss.for_model(model, config.router_aux_loss_coef)
        self.path = training_path(model)
        if self.rank == 0 and self.path.kind == "per_sample":
            log.warning(
                "tree packing given up",
                path="per_sample",
                reasons=list(self.path.reasons),
                given_up="each sample forwards its own prompt: batch/packing_ratio of the work",
            )
        # once, with the parts the model's layers need: every row's; rank 0's choice for all
        # (a kernel that loads on one rank and not on another must not split the ranks)
        self.attention = decided_on_rank0(
            lambda: choose_backend(self.device, attention_backend, ModelAttention.of(model)),
            refusals=(BackendUnavailableError,),
        )
        if self.rank == 0:
            log.info("attention backend", backend=self.attention.name, reason=self.attention.reason)
        self.model = self._prepare(model, peft_config)
        names = parameter_names(self.model)
        self.policy = PackedPolicy(
            self.model, config.temperature, chunk_size, self.attention, self.path
        )
        from_rank0 = self._loads_from_rank0(model)
        # rank 0's weights whole, kept through sharding to be sent to the ranks built on meta
        weights = self.model.state_dict() if from_rank0 and self.rank == 0 else {}
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        shard(self.policy, mesh, mixed_precision(self.bf16))
        if from_rank0:
            load_from_rank0(self.policy, weights, self.device)
        del weights
        self._enable_checkpointing(model, max_model_len, lora=peft_config is not None)
        self.optimizer, self.scheduler = optimizers_for(self.model, config, optimizers, names)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._dummy = dummy_row(self.vocab_size)
        self.export = WeightExport(self.model, self.rank, self.device, self.bf16)
        self.step = 0
        self._clock = DeviceClock(self.device)

    @property
    def is_peft(self) -> bool:
        """LoRA adapters are trained (the model is a ``PeftModel``)."""
        return self.export.is_peft

    @property
    def lora_config(self) -> dict[str, Any] | None:
        """The LoRA adapters' config as a dict (a checkpoint's record of it); None when the
        whole model is trained."""
        if not isinstance(self.model, PeftModel):
            return None
        return self.model.peft_config["default"].to_dict()

    def _prepare(
        self, model: PreTrainedModel, peft_config: PeftConfig | None
    ) -> PreTrainedModel | PeftModel:
        """Dropout off, tree attention (on the tree path), LoRA and the master-weight dtype."""
        dropped = disable_dropout(model)
        if dropped and self.rank == 0:
            log.info("dropout off", modules=len(dropped), reason="vLLM samples without dropout")
        if self.path.kind == "tree":
            enable_tree_attention(model)
        prepared: PreTrainedModel | PeftModel = model
        if peft_config is not None:
            set_seed(self.config.seed)
            prepared = wrap_with_lora(model, peft_config)
        if self.bf16 and self.config.dtype != "bfloat16":
            upcast_trainable(prepared)
        return prepared.train()

    def _loads_from_rank0(self, model: PreTrainedModel) -> bool:
        """Whether a rank built ``model`` on the meta device, so that rank 0's weights are sent
        to every rank after sharding (the same answer on every rank).

        Raises:
            ValueError: rank 0's model has no weights (it is the one that sends them).
        """
        on_meta = built_on_meta(model)
        if self.rank == 0 and on_meta:
            raise ValueError(
                "rank 0's model is on the meta device: rank 0 loads the weights and sends them "
                "to the other ranks, which may build theirs on meta (load_causal_lm(..., "
                "on_meta=True)); load the model's weights on rank 0"
            )
        return on_any_rank(on_meta)

    def _enable_checkpointing(
        self, model: PreTrainedModel, max_model_len: Callable[[], int] | None, lora: bool
    ) -> None:
        """Decide gradient checkpointing (:meth:`_checkpointing`, on rank 0 for all) and turn
        it on in ``model``'s layers when chosen."""
        # a failed ask of the server (a RuntimeError) stops every rank, not rank 0 alone
        checkpointing = decided_on_rank0(
            lambda: self._checkpointing(model, max_model_len, lora), refusals=(RuntimeError,)
        )
        if self.rank == 0:
            log.info(
                "gradient checkpointing", enabled=checkpointing.enabled, reason=checkpointing.reason
            )
        self.gradient_checkpointing = checkpointing.enabled
        if checkpointing.enabled:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=self.config.gradient_checkpointing_kwargs
                or {"use_reentrant": False}
            )

    def _checkpointing(
        self, model: PreTrainedModel, max_model_len: Callable[[], int] | None, lora: bool
    ) -> CheckpointingChoice:
        """``gradient_checkpointing``, or (None) by the activations the longest row keeps with
        the run's attention backend against the memory left free after the training state and
        the push snapshot (:mod:`asyncgrpo.core.packing.memory`): a row of ``token_budget``
        tokens, or of the server's ``max_model_len`` when it is unset (rows are filled up to
        it). The model is sharded and on its device here, so the free memory measured already
        excludes this process's shards; on the host it is shared by the node's processes."""
        requested = self.config.gradient_checkpointing
        shape = decoder_shape(model)
        config = model.config.get_text_config()
        budget, context = self.config.token_budget, getattr(config, "max_position_embeddings", 0)
        served = max_model_len() if requested is None and not budget and max_model_len else None
        tokens, source = row_tokens(budget, served, context)
        sharded = sharded_model(self.model, self.bf16, self.world_size)
        row = ActivationRow(
            tokens, source, self.attention.name, self.attention.memory, sharded.compute_bytes
        )
        on_host = self.device.type != "cuda"
        free = free_bytes(HOST_MEMORY if on_host else str(self.device))
        if on_host and free is not None:
            free //= local_processes()
        snapshot = push_snapshot_bytes(sharded.parameters, sharded.compute_bytes, lora, on_host)
        reserved = reserved_after_sharding(sharded, snapshot)
        return choose_checkpointing(
            requested, row, shape, DeviceMemory(self.device.type, free), reserved
        )

    # --- training ------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[PackedRow | None]) -> StepOutput:
        """One optimizer step over this process's row of each micro-batch (collective).

        Each micro-batch's loss is normalised by its trained tokens summed over all processes
        and by ``len(micro_batches)`` (normally ``gradient_accumulation_steps``); gradients
        are summed over processes, clipped to ``max_grad_norm`` (when > 0), and applied, unless
        the loss or the gradient norm is not finite: then the step is skipped on every process
        (:mod:`asyncgrpo.core.run.divergence`).

        Raises:
            RowOutOfMemoryError: a row's forward or backward ran out of memory.
            DivergedError: the optimizer step made the weights non-finite.

        Args:
            micro_batches: this process's rows, one per micro-batch; ``None`` where this
                process has no samples in a micro-batch. Every process passes as many.
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch (a row or None)")
        counts = self._global_counts(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        done: list[_MicroBatch] = []
        marks = []  # (start, forward done, backward done) per micro-batch, read after the loop
        for row, (tokens, rows) in zip(micro_batches, counts, strict=True):
            start = self._clock.mark()
            with out_of_memory_named(
                row or self._dummy,
                self.config.token_budget,
                self.gradient_checkpointing,
                self.device,
                release=lambda: self.optimizer.zero_grad(set_to_none=True),
            ):
                micro = self._micro_batch(row, tokens, rows, len(micro_batches))
                forward_done = self._clock.mark()
                micro.loss.backward()
            marks.append((start, forward_done, self._clock.mark()))
            loss_sum += micro.loss.detach()
            done.append(micro)
        fwd_s = sum(self._clock.seconds(start, forward) for start, forward, _ in marks)
        fwd_bwd_s = sum(self._clock.seconds(start, end) for start, _, end in marks)
        observations = [
            *_to_host(done),
            mean("perf/fwd_s", fwd_s),
            mean("perf/bwd_s", fwd_bwd_s - fwd_s),
            mean("perf/fwd_bwd_s", fwd_bwd_s),
        ]
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
        if row is None:
            row = self._dummy
        topk = self._topk(row)
        mask = candidate_mask(row, self.vocab_size, self.device)
        with self._capture_routers(row) as routers:
            logp, entropy, topk_logp = self.policy(row, topk, mask)
        if not real:
            dummy = logp.sum() + (self._aux_term(routers, 1, 1)[0] if self.aux else 0.0)
            return _MicroBatch(dummy * 0.0)
        inputs = self._token_inputs(row, logp, entropy, topk_logp, topk)
        per_token = self.objective.per_token_loss(inputs, self.objective_settings)
        loss = normalize_loss(per_token, tokens, accumulation)
        sampler_logp = inputs.sampler_logp
        quarters = token_length_quarters(
            row.sample_index, row.samples, self.config.max_completion_length
        )
        metrics = {
            **loss_metrics(
                logp,
                sampler_logp,
                entropy,
                inputs.sample_index,
                self.loss_config,
                topk,
                torch.from_numpy(quarters).to(self.device, non_blocking=True),
            ),
            **self.objective.metrics(inputs, self.objective_settings),
        }
        fresh = staleness0_tokens(
            row.sample_index, [s.model_version for s in row.samples], self.step
        )
        staleness0 = None
        if fresh.any():
            on_device = torch.from_numpy(fresh).to(self.device, non_blocking=True)
            gap = (logp.detach() - sampler_logp).abs().double()[on_device].sum()
            staleness0 = (gap, int(fresh.sum()))
        aux = None
        if self.aux is not None:
            aux_term, aux = self._aux_term(routers, rows, accumulation)
            loss = loss + aux_term
        return _MicroBatch(loss, metrics, len(row.target_ids), staleness0, aux)

    def _topk(self, row: PackedRow) -> SamplerTopK | None:
        if not self.objective.needs.sampler_topk:
            return None
        if row is self._dummy:
            return empty_sampler_topk(self.config.num_sampler_logprobs, self.device)
        return sampler_topk(row, self.config.num_sampler_logprobs, self.device)

    def _token_inputs(
        self,
        row: PackedRow,
        logp: Tensor,
        entropy: Tensor,
        topk_logp: Tensor | None,
        topk: SamplerTopK | None,
    ) -> TokenInputs:
        """The objective's per-token inputs of one row: the policy's log-probs (with grad), the
        sampler's, each token's advantage and sample, and the top-K when the objective needs
        them."""
        return TokenInputs(
            logp=logp,
            sampler_logp=torch.tensor(row.sampler_logprobs, device=self.device).to(logp.dtype),
            advantages=torch.tensor(row.advantages, device=self.device).to(logp.dtype),
            sample_index=torch.tensor(row.sample_index, device=self.device),
            entropy=entropy.detach(),
            topk_logp=topk_logp,
            topk=topk,
        )

    @contextmanager
    def _capture_routers(self, row: PackedRow) -> Iterator[list[Tensor]]:
        if self.aux is None:
            yield []
            return
        with self.aux.capture(self.policy.forwarded_tokens(row)) as routers:
            yield routers

    def _aux_term(
        self, routers: list[Tensor], rows: int, accumulation: int
    ) -> tuple[Tensor, Tensor]:
        """``coef * aux / (rows * accumulation)`` (with grad) and the unscaled aux value
        (detached, on the device)."""
        assert self.aux is not None
        aux = self.aux.loss(routers)
        return self.aux.coef * aux / (max(rows, 1) * accumulation), aux.detach()

    def _finish_step(self, observations: list[Observation], loss_sum: Tensor) -> StepOutput:
        """Clip, step the optimizer and the schedule (or skip a non-finite step), and gather
        the step's metrics."""
        start = self._clock.mark()
        learning_rate = float(self.optimizer.param_groups[0]["lr"])
        applied = optimizer_step(
            self.model, self.optimizer, self.scheduler, self.config, loss_sum, self.step + 1
        )
        self.step += 1
        observations.append(mean("perf/optimizer_s", self._clock.seconds(start)))
        if trim_due(self.host_memory, self.step):
            give_back_freed_memory()
        if applied.skipped:  # what the forward measured describes a step not taken
            observations = [o for o in observations if o.name.startswith("perf/")]
            if self.rank == 0:
                log.warning(
                    "skipped a step: its loss or gradient norm is not finite",
                    step=self.step,
                    loss=applied.loss,
                    grad_norm=applied.grad_norm,
                    learning_rate=learning_rate,
                )
        window = record(
            self._gather_window(record(MetricWindow(), observations)),
            applied.observations(learning_rate),
        )
        skipped = {"loss": applied.loss, "grad_norm": applied.grad_norm} if applied.skipped else {}
        return StepOutput(summarize(window) | skipped, window, skipped=applied.skipped)

    def _gather_window(self, local: MetricWindow) -> MetricWindow:
        """Merge every process's window (token-weighted means, extremes) into one."""
        windows: list[MetricWindow | None] = [None] * self.world_size
        dist.all_gather_object(windows, local, group=control_group())
        merged = MetricWindow()
        for window in windows:
            merged = merge(merged, window or MetricWindow())
        return merged

    # --- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> None:
        """Save everything a resume needs under ``path`` (collective): the sharded model and
        optimizer, the step and schedule, every process's RNG states
        (:mod:`asyncgrpo.shell.learner.checkpoint` has the layout)."""
        save_learner(path, self.model, self.optimizer, self.scheduler, self.step, self.rank)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (collective). The number of processes
        may differ; then RNG states are restored only on ranks that saved one."""
        self.step = load_learner(path, self.model, self.optimizer, self.scheduler, self.rank)

    # --- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group if this learner created it."""
        if self._owns_group:
            destroy_process_groups()
        self._owns_group = False

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
