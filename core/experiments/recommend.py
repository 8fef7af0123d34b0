"""Which settings to run on a machine: the candidates ``asyncgrpo plan`` simulates, the
throughputs each would have, and the rule that picks one.

A machine is a number of devices (CPU cores, or GPUs) split between the trainer and the vLLM
servers. A **candidate** is a split (``train_devices``; the rest go to ``servers`` servers of
equal share), a ``max_staleness`` and a ``weight_sync_steps``. The shell simulates each
candidate with the throughputs a calibration run measured, scaled to the candidate's devices
(:func:`scaled_throughputs`), and :func:`recommend` picks one from the predictions.

**The rule.** The most trained samples per second wins, except that a staler setting must earn
its staleness, and none may waste generation: among the candidates within ``tolerance`` (5%)
of the best samples per second, those whose share of generated samples dropped as stale is
within :data:`WASTE_TOLERANCE` (1 point) of the least are kept, and of those the one with the
lowest mean staleness is recommended (then the fewest pushes' worth of lag, then the fewest
servers). A dropped sample cost its generation and teaches nothing. Stale samples teach less
per sample than fresh ones (measured on the objectives sweeps, docs/benchmarks.md), so a
setting that buys under 5% more samples per second with older ones is not worth it; the
prediction does not say how much less they teach.

**Scaling** (:func:`scaled_throughputs`) is an assumption, stated in every plan: the trainer's
throughput per forwarded token and a server's generation throughput grow in proportion to
their devices, the fixed and per-sample step costs and the push's seconds stay as measured.
On CPU cores that is an upper bound (torch's intra-op threads and vLLM's OpenMP threads scale
sublinearly on small models). For GPUs without a calibration run, :func:`gpu_throughputs`
gives throughputs from a GPU's published peak figures: predictions, never measurements.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import attrs

from asyncgrpo.core.experiments.generator import Generator
from asyncgrpo.core.experiments.hardware import GPU, GPUS, INTERCONNECTS, parameters_only
from asyncgrpo.core.experiments.parts import fsdp_trainer

__all__ = [
    "GPU",
    "GPUS",
    "Candidate",
    "Prediction",
    "Throughputs",
    "candidates",
    "gpu_throughputs",
    "paced_to_confirm",
    "recommend",
    "scaled_throughputs",
]

STALENESS_CHOICES = (0, 1, 2, 4)
SYNC_STEP_CHOICES = (1, 2, 4)
TOLERANCE = 0.05
WASTE_TOLERANCE = 0.01
"""How much more of its generation a recommended setting may drop as stale than the least
wasteful setting within :data:`TOLERANCE` of the most samples per second (a share)."""
PACED_STALENESS = 1
"""Up to this ``max_staleness`` a step waits on the last groups the pacing admitted, and a
share of the cluster (:mod:`asyncgrpo.core.experiments.scale`) admits fewer of them and ends
its steps sooner: its prediction is optimistic (measured on 128 GPUs of a long-response math
run: 12-57% more samples per second at max_staleness 0 and 1, on 1/2 to 1/8 of the cluster;
within 4% at 2 and 4). Such a setting's prediction from a share only rules it out
(:func:`paced_to_confirm`)."""


@attrs.frozen
class Candidate:
    """One setting of the machine and the pipeline.

    Attributes:
        train_devices: devices (cores or GPUs) of the trainer.
        servers: vLLM servers, sharing the other devices equally.
        max_staleness, weight_sync_steps: as in ``AsyncGRPOConfig``.
        tensor_parallel: GPUs per server (a GPU plan; 1 on CPU).
    """

    train_devices: int
    servers: int
    max_staleness: int
    weight_sync_steps: int
    tensor_parallel: int = 1

    def generation_devices(self, devices: int) -> int:
        """Devices of the servers on a machine of ``devices``."""
        return devices - self.train_devices

    def label(self) -> str:
        tp = f",tensor_parallel={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return (
            f"max_staleness={self.max_staleness},weight_sync_steps={self.weight_sync_steps},"
            f"train_devices={self.train_devices},servers={self.servers}{tp}"
        )


def candidates(
    devices: int,
    staleness_choices: Sequence[int] = STALENESS_CHOICES,
    sync_step_choices: Sequence[int] = SYNC_STEP_CHOICES,
    max_servers: int | None = None,
) -> tuple[Candidate, ...]:
    """Every split of ``devices`` (at least one to each side), every number of servers that
    shares the generation devices equally (up to ``max_servers``), and every pair of
    ``max_staleness`` and ``weight_sync_steps`` the config accepts
    (``max_staleness >= weight_sync_steps - 1``).

    Example:
        >>> [c.label() for c in candidates(2, (0, 1), (1, 2))]  # doctest: +NORMALIZE_WHITESPACE
        ['max_staleness=0,weight_sync_steps=1,train_devices=1,servers=1',
         'max_staleness=1,weight_sync_steps=1,train_devices=1,servers=1',
         'max_staleness=1,weight_sync_steps=2,train_devices=1,servers=1']
    """
    if devices < 2:
        raise ValueError(
            f"a plan needs at least 2 devices (one to train, one to generate), got {devices}"
        )
    out = []
    for train in range(1, devices):
        generation = devices - train
        for servers in range(1, min(generation, max_servers or generation) + 1):
            if generation % servers:
                continue
            for staleness in staleness_choices:
                for sync_steps in sync_step_choices:
                    if staleness >= sync_steps - 1:
                        out.append(Candidate(train, servers, staleness, sync_steps))
    return tuple(out)


@attrs.frozen
class Throughputs:
    """What the simulator needs to know of the hardware (names as in ``SimulationConfig``).

    Attributes:
        training_tokens_per_s: the trainer's forwarded tokens per second.
        training_fixed_s, training_per_sample_s: step costs beside the tokens.
        generation_tokens_per_s: one server's completion tokens per second.
        weight_sync_s: seconds a push takes.
        server_pause_s: seconds of it that hold the servers still (None: all of it).
    """

    training_tokens_per_s: float
    training_fixed_s: float
    training_per_sample_s: float
    generation_tokens_per_s: float
    weight_sync_s: float
    server_pause_s: float | None = None

    def as_settings(self) -> dict[str, float | None]:
        return attrs.asdict(self)


def scaled_throughputs(
    measured: Throughputs,
    measured_train_devices: int,
    measured_server_devices: int,
    candidate: Candidate,
    devices: int,
) -> Throughputs:
    """``measured`` (a run with ``measured_train_devices`` to the trainer and
    ``measured_server_devices`` per server) scaled to ``candidate`` on ``devices``: per-token
    throughputs in proportion to the devices, the rest as measured (the module's docstring).

    Example:
        >>> m = Throughputs(1000.0, 0.1, 0.0, 500.0, 0.2)
        >>> s = scaled_throughputs(m, 1, 1, Candidate(3, 2, 1, 1), devices=7)
        >>> s.training_tokens_per_s, s.generation_tokens_per_s, s.training_fixed_s
        (3000.0, 1000.0, 0.1)
    """
    if measured_train_devices < 1 or measured_server_devices < 1:
        raise ValueError("the calibration run's devices must be >= 1 on each side")
    per_server = candidate.generation_devices(devices) / candidate.servers
    return attrs.evolve(
        measured,
        training_tokens_per_s=measured.training_tokens_per_s
        * candidate.train_devices
        / measured_train_devices,
        generation_tokens_per_s=measured.generation_tokens_per_s
        * per_server
        / measured_server_devices,
    )


def gpu_throughputs(
    gpu: GPU,
    parameters: float,
    concurrency: int,
    train_mfu: float = 0.4,
    decode_mfu: float = 0.5,
    weight_sync_s: float = 1.0,
) -> Throughputs:
    """Predicted throughputs of one GPU for a model of ``parameters`` in bf16, from its peak
    figures, **not measured**: training ``train_mfu x peak / (6 x parameters)`` forwarded
    tokens per second (forward and backward); decoding ``concurrency`` requests per server,
    each decode step reads the weights once (``2 x parameters`` bytes over the bandwidth) or
    computes ``2 x parameters`` FLOPs per request at ``decode_mfu``, whichever is slower.
    Prefill, the KV cache's reads and the trainer's step costs beside its tokens are left out,
    so both are upper bounds.

    Example:
        >>> t = gpu_throughputs(GPUS["h100"], 1.5e9, concurrency=256)
        >>> round(t.training_tokens_per_s), round(t.generation_tokens_per_s)
        (43956, 164833)
    """
    if parameters <= 0 or concurrency < 1:
        raise ValueError("parameters must be > 0 and concurrency >= 1")
    model = parameters_only(parameters)
    link = INTERCONNECTS["nvlink4"]  # one GPU: no collective crosses it
    trainer = fsdp_trainer(
        model, gpu, 1, link, link, 1, micro_batch_tokens=0.0, micro_batches=1, mfu=train_mfu
    )
    decode = Generator(
        compute_s_per_request=model.flops_per_token / (decode_mfu * gpu.bf16_flops),
        weight_read_s=model.weight_bytes / gpu.memory_bytes_per_s,
        roofline=True,
    )
    return Throughputs(
        trainer.tokens_per_s, 0.0, 0.0, decode.tokens_per_s(concurrency), weight_sync_s
    )


@attrs.frozen
class Prediction:
    """A candidate's simulated figures.

    Attributes:
        candidate: the setting.
        samples_per_s: trained samples per second of the run (after its first window).
        step_s: mean step seconds.
        staleness: mean staleness of trained samples (versions).
        trainer_idle_frac: share of the step the trainer waited for samples.
        generator_idle_frac: share of the servers' time with no request running (None: not
            simulated).
        dropped_per_step: samples dropped as stale per step.
        samples_per_step: trained samples per step.
    """

    candidate: Candidate
    samples_per_s: float
    step_s: float
    staleness: float
    trainer_idle_frac: float
    generator_idle_frac: float | None = None
    dropped_per_step: float = 0.0
    samples_per_step: float | None = None

    @property
    def wasted_frac(self) -> float:
        """The share of the generated samples dropped as stale (0 without a sample count)."""
        if not self.samples_per_step:
            return 0.0
        return self.dropped_per_step / (self.samples_per_step + self.dropped_per_step)


def paced_to_confirm(
    predictions: Iterable[Prediction], whole: Collection[Candidate], tolerance: float = TOLERANCE
) -> list[Candidate]:
    """The paced settings (``max_staleness`` <= :data:`PACED_STALENESS`) predicted from a
    share of the cluster (not in ``whole``) that come within ``tolerance`` of the most samples
    per second: :func:`recommend` could choose them, and a share overrates them, so they are
    to be simulated whole. One that falls short is ruled out as it is (whole, it would fall
    shorter still).

    Example:
        >>> fast = Prediction(Candidate(8, 4, 4, 1), 100.0, 1.0, 2.0, 0.0)
        >>> close = Prediction(Candidate(8, 4, 1, 1), 96.0, 1.0, 0.5, 0.0)
        >>> far = Prediction(Candidate(8, 4, 0, 1), 80.0, 1.0, 0.0, 0.0)
        >>> [c.max_staleness for c in paced_to_confirm([fast, close, far], whole=())]
        [1]
        >>> paced_to_confirm([fast, close, far], whole=(close.candidate,))
        []
    """
    predictions = list(predictions)
    top = max(p.samples_per_s for p in predictions)
    return [
        p.candidate
        for p in predictions
        if p.candidate not in whole
        and p.candidate.max_staleness <= PACED_STALENESS
        and p.samples_per_s >= (1.0 - tolerance) * top
    ]


def recommend(predictions: Sequence[Prediction], tolerance: float = TOLERANCE) -> Prediction:
    """The recommended prediction (the module's docstring gives the rule).

    Example:
        >>> a = Prediction(Candidate(1, 1, 0, 1), 10.0, 1.0, 0.0, 0.3)
        >>> b = Prediction(Candidate(1, 1, 4, 1), 10.3, 1.0, 2.5, 0.0)
        >>> c = Prediction(Candidate(1, 1, 1, 1), 14.0, 0.8, 0.9, 0.0)
        >>> recommend([a, b]).candidate.max_staleness, recommend([a, b, c]).candidate.max_staleness
        (0, 1)
        >>> # fresher, but 8% of what it generates is dropped as stale, against 3.5%
        >>> d = Prediction(Candidate(1, 1, 2, 1), 14.2, 0.8, 1.2, 0.0, None, 662.0, 7530.0)
        >>> e = Prediction(Candidate(1, 1, 4, 1), 14.5, 0.8, 2.4, 0.0, None, 290.0, 7902.0)
        >>> recommend([d, e]).candidate.max_staleness
        4
    """
    if not predictions:
        raise ValueError("no predictions to recommend from")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    best = max(p.samples_per_s for p in predictions)
    close = [p for p in predictions if p.samples_per_s >= (1.0 - tolerance) * best]
    least_waste = min(p.wasted_frac for p in close)
    thrifty = [p for p in close if p.wasted_frac <= least_waste + WASTE_TOLERANCE]
    return min(
        thrifty,
        key=lambda p: (
            round(p.staleness, 2),
            p.candidate.weight_sync_steps,
            p.candidate.servers,
            -p.samples_per_s,
        ),
    )
