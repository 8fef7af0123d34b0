"""Which weight-sync path a run uses: a pure decision over what the server offers.

The trainer asks the server once, at start (``/server_info``), which weight-transfer engine it
was started with, and picks:

- ``"nccl"``: vLLM's NCCL engine; the trainer must hold its weights on a CUDA device;
- ``"asyncgrpo_gloo"``: asyncgrpo's gloo engine, in memory between CPU processes;
- ``"disk"``: safetensors in the output directory, reloaded by the server (any server with
  ``VLLM_SERVER_DEV_MODE=1`` and a filesystem it shares with the trainer).

``weight_transfer_backend="auto"`` takes the engine the server runs when the trainer can drive
it, else the disk; naming a backend makes a mismatch an error at start.

The engines the trainer drives are declared once, in :data:`ENGINES`. A new one is a module of
``asyncgrpo.adapters.transfer`` (its ``trainer_init_info``, and its vLLM classes when vLLM does
not ship it) and one entry there: the config's choices, this decision, the servers ``train``
starts, the trainer's handshake and the vLLM plugin all read the entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from asyncgrpo.core.names import spoken_list

AUTO = "auto"
DISK = "disk"
NCCL = "nccl"
GLOO = "asyncgrpo_gloo"


@attrs.frozen
class Engine:
    """A vLLM weight-transfer engine the trainer drives (an entry of :data:`ENGINES`).

    Attributes:
        backend: its name: the ``"backend"`` of the server's ``--weight-transfer-config``, and
            a value of ``AsyncGRPOConfig.weight_transfer_backend``.
        needs_cuda: the trainer sends from a CUDA device, so its weights must live on one.
        module: the adapter module that drives it; its ``trainer_init_info(address, port,
            world_size, rank, timeout_s)`` builds the trainer's side of the handshake.
        vllm_classes: for an engine vLLM does not ship, the names of its worker-side and
            trainer-side classes in ``module``, which asyncgrpo's vLLM plugin registers; None
            for one of vLLM's own.
        parallel_sends: whether sends to several servers may run at once. vLLM's NCCL
            engine packs on CUDA streams it caches per device, shared by every sending
            thread: sends on them would queue behind each other (and behind a hung server's)
            whatever the threads, so they go one after another, each under its own timeout.
    """

    backend: str
    needs_cuda: bool
    module: str
    vllm_classes: tuple[str, str] | None = None
    parallel_sends: bool = True


ENGINES = (
    Engine(NCCL, needs_cuda=True, module="asyncgrpo.adapters.transfer.nccl", parallel_sends=False),
    Engine(
        GLOO,
        needs_cuda=False,
        module="asyncgrpo.adapters.transfer.gloo",
        vllm_classes=("GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine"),
    ),
)
WEIGHT_TRANSFER_BACKENDS = (AUTO, DISK, *(engine.backend for engine in ENGINES))


def engine_named(backend: str | None) -> Engine | None:
    """The entry of :data:`ENGINES` named ``backend``; None for any other name, or None.

    Example:
        >>> engine_named("nccl").needs_cuda, engine_named("disk")
        (True, None)
    """
    return next((engine for engine in ENGINES if engine.backend == backend), None)


@attrs.frozen
class TransferChoice:
    """The chosen path and why, for the run's log."""

    backend: str
    reason: str


def check_backend(requested: str) -> None:
    """Raise a ``ValueError`` naming the config field unless ``requested`` is a known value."""
    if requested not in WEIGHT_TRANSFER_BACKENDS:
        raise ValueError(
            f"AsyncGRPOConfig.weight_transfer_backend must be one of "
            f"{', '.join(WEIGHT_TRANSFER_BACKENDS)}; got {requested!r}"
        )


def choose_weight_transfer(
    requested: str, server_backend: str | None, trainer_on_cuda: bool
) -> TransferChoice:
    """Pick the weight-sync path.

    Args:
        requested: ``AsyncGRPOConfig.weight_transfer_backend``.
        server_backend: the server's ``--weight-transfer-config`` backend; ``None`` when it has
            none or does not say.
        trainer_on_cuda: whether the trainer's weights live on a CUDA device.

    Raises:
        ValueError: ``requested`` names an engine the server does not run, or ``"nccl"`` without
            CUDA on the trainer.

    Example:
        >>> choose_weight_transfer("auto", "asyncgrpo_gloo", trainer_on_cuda=False).backend
        'asyncgrpo_gloo'
        >>> choose_weight_transfer("auto", "nccl", trainer_on_cuda=False).backend
        'disk'
    """
    check_backend(requested)
    if requested == DISK:
        return TransferChoice(DISK, "weight_transfer_backend='disk'")
    engine = engine_named(server_backend)
    if requested == AUTO:
        if engine is None:
            offered = server_backend or "no --weight-transfer-config"
            return TransferChoice(DISK, f"the server runs no engine the trainer drives ({offered})")
        if engine.needs_cuda and not trainer_on_cuda:
            return TransferChoice(
                DISK, f"the server runs {engine.backend} but the trainer is not on CUDA"
            )
        return TransferChoice(engine.backend, f"the server runs the {engine.backend} engine")
    if engine is None or engine.backend != requested:
        raise ValueError(
            f"AsyncGRPOConfig.weight_transfer_backend={requested!r} but the server runs "
            f"{server_backend or 'no weight-transfer engine'}: start vLLM with "
            f'--weight-transfer-config \'{{"backend": "{requested}"}}\' (and '
            "VLLM_SERVER_DEV_MODE=1), or set weight_transfer_backend='auto'"
        )
    if engine.needs_cuda and not trainer_on_cuda:
        on_cpu = [repr(e.backend) for e in ENGINES if not e.needs_cuda] + [repr(DISK)]
        raise ValueError(
            f"AsyncGRPOConfig.weight_transfer_backend={requested!r} needs the trainer on a CUDA "
            f"device; on CPU use {spoken_list(on_cpu)}"
        )
    return TransferChoice(requested, f"weight_transfer_backend={requested!r}")


def local_server_engine(requested: str) -> str | None:
    """The weight-transfer engine a server the run starts itself runs
    (``--weight-transfer-config``): the one ``weight_transfer_backend`` names; none for
    ``"disk"``, and none for ``"auto"``, which then takes the disk path.

    Example:
        >>> local_server_engine("asyncgrpo_gloo"), local_server_engine("auto")
        ('asyncgrpo_gloo', None)
    """
    check_backend(requested)
    return requested if engine_named(requested) else None


def chunk_bounds(nbytes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Group consecutive tensors into broadcast chunks of at most ``limit`` bytes.

    Returns ``[(start, stop), ...]`` index ranges covering ``nbytes`` in order; a chunk closes
    when the next tensor would overflow it, and a tensor larger than ``limit`` is a chunk of its
    own. The trainer and the server compute the same bounds from the same sizes, so only the
    sizes (from the round's metadata) cross the wire.

    Example:
        >>> chunk_bounds([4, 4, 4, 10, 1], limit=8)
        [(0, 2), (2, 3), (3, 4), (4, 5)]
    """
    if limit < 1:
        raise ValueError(f"chunk limit must be >= 1 byte, got {limit}")
    bounds: list[tuple[int, int]] = []
    start, filled = 0, 0
    for index, size in enumerate(nbytes):
        if index > start and filled + size > limit:
            bounds.append((start, index))
            start, filled = index, 0
        filled += size
    if start < len(nbytes):
        bounds.append((start, len(nbytes)))
    return bounds


SNAPSHOT_HEADROOM = 2.0
"""A snapshot is taken only when this many times its size is free where it would live."""


@attrs.frozen
class PushPlan:
    """How the run pushes its weights after a step, and why (for the run's log).

    Attributes:
        overlapped: the push runs beside the next step from a snapshot of the weights;
            otherwise the step waits for it, as before.
        snapshot_bytes: the snapshot's size (one copy of the synced weights in their export
            dtype, on the trainer's rank 0).
        reason: the figures the choice was made on.
    """

    overlapped: bool
    snapshot_bytes: int
    reason: str


def plan_push(snapshot_bytes: int, free_bytes: int | None, where: str) -> PushPlan:
    """Overlap the push with the next step when a snapshot of ``snapshot_bytes`` fits
    :data:`SNAPSHOT_HEADROOM` times into the ``free_bytes`` measured ``where`` it would live
    (host memory, or the GPU for the NCCL engine); ``None``: not measurable, so no overlap.

    Example:
        >>> plan_push(100 << 20, 8 << 30, "host memory").overlapped
        True
        >>> plan_push(100 << 30, 8 << 30, "cuda:0").reason  # doctest: +ELLIPSIS
        'snapshot of 102400 MiB does not fit twice into the 8192 MiB free on cuda:0: ...'
    """
    mib = snapshot_bytes / 2**20
    if free_bytes is None:
        return PushPlan(
            False, snapshot_bytes, f"free memory on {where} unknown: the step waits for the push"
        )
    if snapshot_bytes * SNAPSHOT_HEADROOM > free_bytes:
        return PushPlan(
            False,
            snapshot_bytes,
            f"snapshot of {mib:.0f} MiB does not fit twice "
            f"into the {free_bytes / 2**20:.0f} MiB free on {where}: the step "
            "waits for the push",
        )
    return PushPlan(
        True,
        snapshot_bytes,
        f"snapshot of {mib:.0f} MiB in {where} "
        f"({free_bytes / 2**20:.0f} MiB free): the push runs beside the next step",
    )
