"""Part models of the pipeline besides the generator (:mod:`.generator`): the trainer, the
weight push and the contention between the two sides. The simulator composes them.

* **Trainer** (:func:`fsdp_trainer`): forwarded tokens per second from the model's FLOPs per
  token (forward and backward: three forwards) at an MFU of each GPU's peak, all trainer GPUs
  together; FSDP2 gathers the bf16 weights twice per micro-batch (forward, and backward after
  resharding) and reduce-scatters fp32 gradients, ``8 x parameters x (n - 1) / n`` bytes per
  GPU over the slowest link the ranks span; a micro-batch takes the longer of its compute and
  its communication (prefetching overlaps them), so only the excess is added. The optimizer
  reads and writes each shard's fp32 state once (``32`` bytes per parameter over HBM).
  Besides, a step takes seconds that no number of GPUs removes (:func:`fit_trainer` of two
  GPU counts, or :data:`TRAINER_OVERHEAD_S_PER_SAMPLE`).
* **Push** (:class:`Push`): the bytes over the link's bandwidth, once per server (sent one
  after another from one snapshot), plus the pause (pause, reset of the prefix cache,
  resume). A delta push (``weight_sync_delta``) sends the changed elements' indices and
  values (:func:`~asyncgrpo.core.weights.delta.delta_push_bytes` of the changed fraction) and
  the server then reloads the whole policy from its host copy.
* **Contention** (:class:`Contention`): where trainer and server share cores (a CPU machine),
  each side runs slower while the other runs; on separate GPUs, none.

Example:
    >>> from asyncgrpo.core.experiments.hardware import GPUS, INTERCONNECTS, parameters_only
    >>> nvlink, ib = INTERCONNECTS["nvlink4"], INTERCONNECTS["ib-ndr"]
    >>> t = fsdp_trainer(parameters_only(7e9), GPUS["h100"], 4, nvlink, ib, gpus_per_node=8,
    ...                  micro_batch_tokens=16384, micro_batches=4)
    >>> round(t.tokens_per_s), round(t.fixed_s, 3)  # 40% MFU; the gathers hide behind compute
    (37676, 0.017)
    >>> round(Push(14e9, nvlink.bytes_per_s, pause_s=0.2, servers=2).seconds, 3)
    0.262
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from asyncgrpo.core.experiments.hardware import GPU, Interconnect, ModelSpec
from asyncgrpo.core.weights.delta import delta_push_bytes

TRAIN_MFU = 0.4
"""The trainer's share of peak FLOP/s, an assumption (well-tuned FSDP runs report 35-50%)."""
FSDP_BYTES_PER_PARAMETER = 8.0
"""Per micro-batch: two bf16 gathers (2 + 2 bytes) and one fp32 reduce-scatter (4 bytes)."""
OPTIMIZER_BYTES_PER_PARAMETER = 32.0
"""AdamW over fp32 shards: parameter, gradient and two moments read, three of them written."""
TRAINER_STATE_BYTES_PER_PARAMETER = 16.0
"""Sharded across the trainer: fp32 master weights, fp32 gradients, two fp32 Adam moments."""
ACTIVATION_BYTES_PER_TOKEN_AND_WIDTH = 34.0
"""One layer's activations recomputed under checkpointing, per token and hidden unit (bf16)."""
PUSH_PAUSE_S = 0.2
"""Seconds a push pauses a server besides the bytes (pause, prefix-cache reset, resume): an
assumption; measure it (``perf/weight_push_s`` less the bytes' time)."""
DISK_BYTES_PER_S = 2e9
"""The disk path's write and read, bytes/s: an assumption (a local NVMe; a network
filesystem can be ten times slower)."""
HOST_TO_DEVICE_BYTES_PER_S = 25e9
"""A delta push's reload on the server, from the policy it keeps in host memory to its GPUs,
bytes/s: PCIe Gen4 x16's ~25 GB/s (an assumption; Gen5 doubles it)."""
DELTA_CHANGED_FRAC = 0.02
"""The fraction of a bf16 policy's elements a push changes after one Adam step: measured
2026-12-07 on SmolLM2-135M-Instruct at learning rate 1e-5 (the real demo's settings), median
0.020 over 22 pushes of 2 seeds (``perf/weight_sync_unchanged_frac`` 0.980 [0.978, 0.981]:
``benchmarks/delta_sync.toml``). It grows with the learning rate and with ``weight_sync_steps``
(more steps between pushes); a workload gives its own as ``delta_changed_frac``."""


TRAINER_OVERHEAD_S_PER_SAMPLE = 69.32 / 8192
"""Seconds of a training step per sample that no number of trainer GPUs removes: ``a`` of
``a + b / GPUs`` (:func:`fit_trainer`) through verl's fully asynchronous runs of
Qwen2.5-Math-7B on 32 and 64 trainer GPUs, ``update_actor`` 157.0 and 113.16 s a step of
512 x 16 samples (``recipe/fully_async_policy/README.md``, 2025-12-25): 69.3 s, counted per
sample here (an assumption: the cost grows with the step's samples, as host-side work per
sample does). With its run on 16 GPUs (269.8 s) the three fit a = 56.8 s. verl does not
say what it is (per-micro-batch costs of dynamic batch sizes and Ulysses sequence
parallelism, the optimizer, offloading). A workload gives its own (``[trainer]
step_overhead_s``) or two measured steps to fit (``[trainer] measured``)."""


@attrs.frozen
class TrainerFit:
    """``a + b / GPUs``: a training step's seconds on ``GPUs`` trainer GPUs.

    Attributes:
        fixed_s: ``a``, seconds no number of GPUs removes.
        gpu_s: ``b``, GPU-seconds of the step's work, shared by the GPUs.
    """

    fixed_s: float
    gpu_s: float

    def step_s(self, gpus: int) -> float:
        return self.fixed_s + self.gpu_s / gpus


def fit_trainer(points: Sequence[tuple[int, float]]) -> TrainerFit:
    """``a + b / GPUs`` through measured ``(trainer GPUs, step seconds)`` of the same step, by
    least squares over two or more GPU counts (``a`` kept >= 0: without a fixed part, ``b``
    through the origin).

    Example (verl's asynchronous runs on 32 and 64 GPUs, :data:`TRAINER_OVERHEAD_S_PER_SAMPLE`):
        >>> fit = fit_trainer([(32, 157.0), (64, 113.16)])
        >>> round(fit.fixed_s, 2), round(fit.gpu_s, 1), round(fit.step_s(16), 1)
        (69.32, 2805.8, 244.7)
    """
    counts = {gpus for gpus, _ in points}
    if len(counts) < 2 or min(counts) < 1 or any(not s > 0 for _, s in points):
        raise ValueError(
            "fit_trainer: give step seconds (> 0) at two or more trainer GPU counts (>= 1), "
            f"got {list(points)}"
        )
    inverse = np.array([1.0 / gpus for gpus, _ in points])
    seconds = np.array([s for _, s in points])
    b, a = np.polyfit(inverse, seconds, 1)
    if a < 0 or b <= 0:
        return TrainerFit(0.0, float(np.sum(seconds * inverse) / np.sum(inverse**2)))
    return TrainerFit(float(a), float(b))


@attrs.frozen
class Trainer:
    """A training step's cost: ``fixed_s + forwarded_tokens / tokens_per_s``.

    Attributes:
        tokens_per_s: forwarded tokens per second, all the trainer's GPUs together.
        fixed_s: seconds per step besides (exposed communication, the optimizer).
        gpus: the trainer's GPUs.
        source: where the figures come from.
    """

    tokens_per_s: float
    fixed_s: float
    gpus: int
    source: str

    def step_s(self, forwarded_tokens: float) -> float:
        return self.fixed_s + forwarded_tokens / self.tokens_per_s


def collective_bytes_per_s(
    gpus: int, gpus_per_node: int, intra_node: Interconnect, inter_node: Interconnect
) -> float:
    """The bandwidth a ring over ``gpus`` ranks gets: the slowest link it crosses."""
    return (
        intra_node.bytes_per_s
        if gpus <= gpus_per_node
        else min(intra_node.bytes_per_s, inter_node.bytes_per_s)
    )


def fsdp_trainer(
    model: ModelSpec,
    gpu: GPU,
    gpus: int,
    intra_node: Interconnect,
    inter_node: Interconnect,
    gpus_per_node: int,
    micro_batch_tokens: float,
    micro_batches: int,
    mfu: float = TRAIN_MFU,
    step_overhead_s: float = 0.0,
) -> Trainer:
    """The trainer on ``gpus`` GPUs, each micro-batch ``micro_batch_tokens`` forwarded tokens
    per GPU, ``micro_batches`` per step (the module's docstring), and ``step_overhead_s``
    seconds a step that no number of GPUs removes."""
    if gpus < 1 or micro_batches < 1 or not 0 < mfu <= 1:
        raise ValueError(
            f"a trainer needs gpus >= 1, micro_batches >= 1 and 0 < mfu <= 1, got "
            f"{gpus}, {micro_batches}, {mfu}"
        )
    per_gpu = mfu * gpu.bf16_flops / (3.0 * model.flops_per_token)
    bandwidth = collective_bytes_per_s(gpus, gpus_per_node, intra_node, inter_node)
    gathers_s = FSDP_BYTES_PER_PARAMETER * model.parameters * (gpus - 1) / gpus / bandwidth
    exposed_s = max(0.0, gathers_s - micro_batch_tokens / per_gpu)
    optimizer_s = OPTIMIZER_BYTES_PER_PARAMETER * model.parameters / gpus / gpu.memory_bytes_per_s
    link = intra_node.name if gpus <= gpus_per_node else inter_node.name
    return Trainer(
        tokens_per_s=per_gpu * gpus,
        fixed_s=micro_batches * exposed_s + optimizer_s + step_overhead_s,
        gpus=gpus,
        source=(
            f"PREDICTED: {gpus} {gpu.name} at {mfu:.0%} MFU of the data-sheet peak, FSDP2 "
            f"collectives over {link}, {step_overhead_s:.1f} s a step no GPU count removes"
        ),
    )


def trainer_memory_bytes(model: ModelSpec, gpus: int, token_budget: int) -> float:
    """Bytes per trainer GPU: its shard of the fp32 training state, plus (when the model's
    shape is known) the checkpointed layer inputs of a ``token_budget`` row and one layer's
    activations recomputed."""
    state = TRAINER_STATE_BYTES_PER_PARAMETER * model.parameters / gpus
    if model.shape is None:
        return state
    width = model.shape.hidden
    checkpoints = token_budget * width * model.shape.layers * 2.0
    return state + checkpoints + token_budget * width * ACTIVATION_BYTES_PER_TOKEN_AND_WIDTH


@attrs.frozen
class Push:
    """One weight push: ``pause_s + servers x bytes / bytes_per_s`` (plus the trainer's
    gather, ``gather_s``).

    Attributes:
        bytes: sent to each server.
        bytes_per_s: the link's bandwidth.
        pause_s: the servers' pause besides the bytes.
        servers: servers sent to, one after another.
        gather_s: seconds to gather the sharded weights on the sending rank.
    """

    bytes: float
    bytes_per_s: float
    pause_s: float = PUSH_PAUSE_S
    servers: int = 1
    gather_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.gather_s + self.pause_s + self.servers * self.bytes / self.bytes_per_s


WEIGHT_PATHS = ("nccl", "delta", "disk", "lora")


def weight_push(
    model: ModelSpec,
    path: str,
    servers: int,
    trainer_gpus: int,
    trainer_link: Interconnect,
    server_link: Interconnect,
    lora_bytes: float | None = None,
    changed_frac: float = DELTA_CHANGED_FRAC,
) -> Push:
    """The push of ``path``: ``nccl`` sends the bf16 weights GPU to GPU over ``server_link``
    (the link between the trainer's rank 0 and the servers) after gathering them over
    ``trainer_link``; ``delta`` sends over the same link only the ``changed_frac`` of elements
    that changed (indices and values, ``asyncgrpo_gloo`` with ``weight_sync_delta``) and each
    server reloads the whole policy from host memory (:data:`HOST_TO_DEVICE_BYTES_PER_S`);
    ``disk`` writes them once and each server reads them (:data:`DISK_BYTES_PER_S`); ``lora``
    writes and reads ``lora_bytes`` of adapters.

    Example:
        >>> from asyncgrpo.core.experiments.hardware import INTERCONNECTS, parameters_only
        >>> ib = INTERCONNECTS["ib-ndr"]
        >>> full = weight_push(parameters_only(7e9), "nccl", 1, 8, ib, ib)
        >>> delta = weight_push(parameters_only(7e9), "delta", 1, 8, ib, ib, changed_frac=0.01)
        >>> round(delta.bytes / full.bytes, 2)
        0.03
    """
    gather = model.weight_bytes * (trainer_gpus - 1) / trainer_gpus / trainer_link.bytes_per_s
    if path == "nccl":
        return Push(model.weight_bytes, server_link.bytes_per_s, servers=servers, gather_s=gather)
    if path == "delta":
        return Push(
            delta_push_bytes(model.weight_bytes, changed_frac, value_bytes=2),
            server_link.bytes_per_s,
            pause_s=PUSH_PAUSE_S + model.weight_bytes / HOST_TO_DEVICE_BYTES_PER_S,
            servers=servers,
            gather_s=gather,
        )
    if path == "disk":
        return Push(2 * model.weight_bytes, DISK_BYTES_PER_S, gather_s=gather)
    if path == "lora":
        if not lora_bytes:
            raise ValueError(
                "the lora weight path needs the adapters' size: [settings] "
                "lora_bytes (2 x r x (d_in + d_out) x layers x modules)"
            )
        return Push(2 * lora_bytes, DISK_BYTES_PER_S)
    raise ValueError(f"weight_path is one of {', '.join(WEIGHT_PATHS)}, got {path!r}")


@attrs.frozen
class Contention:
    """How much longer each side takes while the other runs on shared cores (1: no effect).

    Attributes:
        training_slowdown: training time beside generation over training time alone.
        generation_slowdown: decode time beside training over decode time alone.
    """

    training_slowdown: float = 1.0
    generation_slowdown: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.training_slowdown < 1.0 or self.generation_slowdown < 1.0:
            raise ValueError(f"a slowdown is >= 1 (1: none), got {self}")

    def training_rate(self, generating: bool) -> float:
        """Seconds of training work done per second of time.

        Example:
            >>> c = Contention(1.5, 1.2)
            >>> round(c.training_rate(True), 3), c.training_rate(False)
            (0.667, 1.0)
        """
        return 1.0 / self.training_slowdown if generating else 1.0

    def generation_rate(self, training: bool) -> float:
        """Seconds of decoding done per second of time."""
        return 1.0 / self.generation_slowdown if training else 1.0


SEPARATE_DEVICES = Contention()
MEASURED_ON_2_CORES = Contention(training_slowdown=1.5, generation_slowdown=1.3)
"""Measured 2026-12-02 on 2 CPU cores (hidden-512 model, docs/experiments.md): forward and
backward 1.41-1.59x slower beside generation, generation 1.18-1.48x slower beside training."""
