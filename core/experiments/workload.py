"""A workload: what ``asyncgrpo plan --workload FILE`` plans a GPU run from, without running it.

The file (TOML; the shell reads it, and the model's ``config.json`` when named) has these
tables; every error names the table, the key and the fix:

* ``[model]``: ``name`` (what ``vllm serve`` and the trainer load), and either ``config`` (an
  HF ``config.json``: FLOPs and KV bytes per token from the shape) or ``parameters`` with
  ``kv_bytes_per_token``;
* ``[cluster]``: ``gpu`` (:data:`~asyncgrpo.core.experiments.hardware.GPUS`), ``gpus`` (the
  default of ``--gpus``), ``gpus_per_node`` (8), ``intra_node`` and ``inter_node`` (a name of
  :data:`~asyncgrpo.core.experiments.hardware.INTERCONNECTS` or GB/s per GPU);
* ``[batch]``: ``prompts_per_step`` x ``num_generations`` samples per optimizer step;
* ``[lengths]``: ``prompt`` and ``response``, each a number (every length the same), a table
  of ``mean``, quantiles (``p50``, ``p90``, ``p99``, ...) and ``max`` (``min`` 1), a table of
  ``min``, ``mean`` and ``max`` (uniform, the end on the mean's side heavier), or
  ``{histogram = {edges = [...], counts = [...]}}`` (:mod:`.lengths`); and optionally
  ``group_correlation``, how alike a prompt's responses are in length, from 0 (each drawn
  alone, the default) to 1 (the prompt sets it: hard problems draw long answers), which decides
  whether the long groups are the ones that go stale (:func:`.lengths.group_quantiles`);
* ``[settings]`` (optional): ``max_staleness`` and ``weight_sync_steps`` to fix them (left out:
  the plan chooses), ``weight_path`` (``nccl``, ``delta`` with ``delta_changed_frac``,
  ``disk`` or ``lora`` with ``lora_bytes``);
* ``[generator]`` (optional): a decode figure, ``tokens_per_s`` of one server at
  ``concurrency`` requests (``context_tokens`` KV tokens each; default: the workload's mean in
  flight) with its ``source``, which scales the roofline, and/or ``step_overhead_s``, seconds
  every decode step takes besides the roofline (kernel launches, the tensor-parallel
  all-reduces, sampling); without the table, the roofline with the overhead a published
  figure of the GPU kind implies (:mod:`.decode_figures`), else
  :data:`~asyncgrpo.core.experiments.generator.DECODE_STEP_OVERHEAD_S` (``step_overhead_s =
  0`` gives the roofline alone, an upper bound);
* ``[trainer]`` (optional): ``mfu`` (the share of peak FLOP/s), ``step_overhead_s`` (seconds
  of a step no number of GPUs removes; default
  :data:`~asyncgrpo.core.experiments.parts.TRAINER_OVERHEAD_S_PER_SAMPLE` per sample), or
  ``measured``, ``[{gpus = N, train_s = S}, ...]`` at two or more trainer GPU counts, fitted
  as ``a + b / GPUs`` instead of the FLOPs;
  ``[contention]`` ``training_slowdown`` and ``generation_slowdown`` (shared cores only).

Example:
    >>> w = workload_from_mapping({
    ...     "model": {"name": "m", "parameters": 1.5e9, "kv_bytes_per_token": 28672},
    ...     "cluster": {"gpu": "h100"},
    ...     "batch": {"prompts_per_step": 32, "num_generations": 8},
    ...     "lengths": {"prompt": 256,
    ...                 "response": {"mean": 2200, "p50": 1500, "p90": 4000, "max": 8192}}})
    >>> w.samples_per_step, w.intra_node.name, w.response_lengths.maximum
    (256, 'nvlink4', 8192.0)
    >>> try:
    ...     workload_from_mapping({"model": {"name": "m"}})
    ... except WorkloadError as error:
    ...     print(error)  # doctest: +ELLIPSIS
    [cluster]: missing; a workload needs the tables model, cluster, batch, lengths ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from asyncgrpo.core.experiments import decode_figures
from asyncgrpo.core.experiments import lengths as length_models
from asyncgrpo.core.experiments.hardware import (
    GPU,
    GPUS,
    INTERCONNECTS,
    Interconnect,
    ModelSpec,
    model_spec,
    parameters_only,
)
from asyncgrpo.core.experiments.parts import (
    DELTA_CHANGED_FRAC,
    TRAIN_MFU,
    TRAINER_OVERHEAD_S_PER_SAMPLE,
    WEIGHT_PATHS,
    Contention,
)
from asyncgrpo.core.names import did_you_mean, spoken_list

TABLES: Mapping[str, tuple[str, ...]] = {
    "model": ("name", "config", "parameters", "kv_bytes_per_token"),
    "cluster": ("gpu", "gpus", "gpus_per_node", "intra_node", "inter_node"),
    "batch": ("prompts_per_step", "num_generations"),
    "lengths": ("prompt", "response", "group_correlation"),
    "settings": (
        "max_staleness",
        "weight_sync_steps",
        "weight_path",
        "lora_bytes",
        "delta_changed_frac",
    ),
    "generator": ("tokens_per_s", "concurrency", "context_tokens", "step_overhead_s", "source"),
    "trainer": ("mfu", "step_overhead_s", "measured"),
    "contention": ("training_slowdown", "generation_slowdown"),
}
REQUIRED_TABLES = ("model", "cluster", "batch", "lengths")
INTRA_NODE_OF = {
    "a100": "nvlink3",
    "h100": "nvlink4",
    "h200": "nvlink4",
    "h20": "nvlink4",
    "b200": "nvlink5",
    "l40s": "pcie4",
}


class WorkloadError(ValueError):
    """A workload that cannot be planned from; the message names the table, key and fix."""


@attrs.frozen
class DecodeFigure:
    """A published or measured decode figure of one server: ``tokens_per_s`` at
    ``concurrency`` requests holding ``context_tokens`` KV tokens each (None: the workload's
    mean in flight), from ``source``."""

    tokens_per_s: float
    concurrency: float
    context_tokens: float | None
    source: str


@attrs.frozen
class Workload:
    """A GPU run to plan (the module's docstring gives the file's keys).

    Attributes:
        model_name: what the servers and the trainer load.
        model: parameters, FLOPs and KV bytes per token.
        gpu: the GPU type; ``gpus``: how many (None: ``--gpus`` says).
        gpus_per_node: GPUs per node.
        intra_node, inter_node: links within and between nodes.
        prompts_per_step, num_generations: a step's samples are their product.
        prompt_lengths, response_lengths: token lengths.
        response_group_correlation: how alike a group's response lengths are, in [0, 1]
            (:func:`~asyncgrpo.core.experiments.lengths.group_quantiles`).
        max_staleness, weight_sync_steps: fixed by the workload, or None (the plan chooses).
        weight_path: ``nccl``, ``delta``, ``disk`` or ``lora``; ``lora_bytes`` the adapters'
            size; ``delta_changed_frac`` the fraction of elements a delta push sends.
        decode_figure: a decode figure that scales the roofline (None: the roofline).
        decode_step_overhead_s: seconds every decode step takes besides the roofline (None,
            without a ``[generator]`` table:
            :data:`~asyncgrpo.core.experiments.generator.DECODE_STEP_OVERHEAD_S`).
        train_mfu: the trainer's share of peak FLOP/s.
        train_overhead_s: seconds of a step no number of trainer GPUs removes (None:
            :data:`~asyncgrpo.core.experiments.parts.TRAINER_OVERHEAD_S_PER_SAMPLE` per
            sample).
        train_measured: measured ``(trainer GPUs, training seconds)`` of this workload's step
            at two or more GPU counts; when given, the trainer is their fit
            (:func:`~asyncgrpo.core.experiments.parts.fit_trainer`), not the FLOPs.
        contention: slowdowns where trainer and servers share cores.
    """

    model_name: str
    model: ModelSpec
    gpu: GPU
    gpus: int | None
    gpus_per_node: int
    intra_node: Interconnect
    inter_node: Interconnect
    prompts_per_step: int
    num_generations: int
    prompt_lengths: length_models.Lengths
    response_lengths: length_models.Lengths
    response_group_correlation: float = 0.0
    max_staleness: int | None = None
    weight_sync_steps: int | None = None
    weight_path: str = "nccl"
    lora_bytes: float | None = None
    delta_changed_frac: float = DELTA_CHANGED_FRAC
    decode_figure: DecodeFigure | None = None
    decode_step_overhead_s: float | None = None
    train_mfu: float = TRAIN_MFU
    train_overhead_s: float | None = None
    train_measured: tuple[tuple[int, float], ...] = ()
    contention: Contention = attrs.field(factory=Contention)

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def decode_overhead_s(self) -> float:
        """Seconds every decode step takes besides the roofline: the workload's, else the
        default of its GPU kind and model size
        (:func:`~asyncgrpo.core.experiments.decode_figures.default_overhead`)."""
        if self.decode_step_overhead_s is not None:
            return self.decode_step_overhead_s
        return decode_figures.default_overhead(self.gpu.name, self.model.parameters)[0]

    @property
    def decode_overhead_source(self) -> str:
        """Where :attr:`decode_overhead_s` comes from, as the plan states it."""
        if self.decode_step_overhead_s is not None:
            return "the workload's"
        return decode_figures.default_overhead(self.gpu.name, self.model.parameters)[1]

    @property
    def trainer_overhead_s(self) -> float:
        """Seconds of a training step no number of GPUs removes: the workload's, else the
        default per sample (:data:`~.parts.TRAINER_OVERHEAD_S_PER_SAMPLE`)."""
        if self.train_overhead_s is not None:
            return self.train_overhead_s
        return TRAINER_OVERHEAD_S_PER_SAMPLE * self.samples_per_step

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus the longest response: the servers' ``--max-model-len``."""
        return int(self.prompt_lengths.maximum + self.response_lengths.maximum)


def _number(
    table: str,
    key: str,
    value: Any,
    *,
    integer: bool = False,
    minimum: float | None = None,
    fix: str = "",
) -> Any:
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise WorkloadError(
            f"[{table}] {key}: must be {kind}{bound}, got {value!r}" + (f" ({fix})" if fix else "")
        )
    return value


def _group_correlation(lengths: Mapping[str, Any]) -> dict[str, Any]:
    """``[lengths] group_correlation`` as the :class:`Workload`'s keyword, where given."""
    if "group_correlation" not in lengths:
        return {}
    correlation = float(_number("lengths", "group_correlation", lengths["group_correlation"]))
    try:
        length_models.check_correlation(correlation, "[lengths] group_correlation")
    except length_models.LengthsError as error:
        raise WorkloadError(str(error)) from error
    return {"response_group_correlation": correlation}


def _table(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, Mapping):
        raise WorkloadError(f"[{name}]: must be a table of {spoken_list(TABLES[name])}")
    unknown = sorted(set(table) - set(TABLES[name]))
    if unknown:
        raise WorkloadError(
            f"[{name}] {unknown[0]}: not a key of [{name}]"
            f"{did_you_mean(unknown[0], TABLES[name])}; its keys are "
            f"{spoken_list(TABLES[name])}"
        )
    return table


def lengths_from(where: str, spec: Any) -> length_models.Lengths:
    """A length distribution from its workload form (the module's docstring).

    Example:
        >>> lengths_from("[lengths] prompt", {"min": 100, "mean": 300, "max": 500}).mean
        300.0
        >>> try:
        ...     lengths_from("[lengths] response", {"mean": 900, "max": 4096})
        ... except WorkloadError as error:
        ...     print(error)  # doctest: +ELLIPSIS
        [lengths] response: mean and max alone do not give the shape; add quantiles (p50 = ...
    """
    try:
        if isinstance(spec, int | float) and not isinstance(spec, bool):
            return length_models.constant(float(spec))
        if not isinstance(spec, Mapping):
            raise length_models.LengthsError(
                "must be a number, or a table of mean, quantiles "
                "(p50, p90, ...) and max, or a histogram"
            )
        if "histogram" in spec:
            histogram = spec["histogram"]
            return length_models.from_histogram(histogram["edges"], histogram["counts"])
        quantiles, other = {}, {}
        for key, value in spec.items():
            if key.startswith("p") and key[1:].replace(".", "", 1).isdigit():
                quantiles[float(key[1:]) / 100.0] = float(value)
            elif key in ("min", "mean", "max"):
                other[key] = float(value)
            else:
                raise length_models.LengthsError(
                    f"{key!r} is not a length key: mean, min, max, p50 (any pNN) or histogram"
                )
        if "max" not in other or "mean" not in other:
            raise length_models.LengthsError("give mean and max (and quantiles or min)")
        if quantiles:
            return length_models.from_quantiles(
                quantiles, other["max"], other["mean"], other.get("min", 1.0)
            )
        if "min" not in other:
            raise length_models.LengthsError(
                "mean and max alone do not give the shape; add quantiles (p50 = ..., p90 = "
                "...), or min for a uniform spread"
            )
        return length_models.uniform_with_mean(other["min"], other["max"], other["mean"])
    except (KeyError, TypeError) as error:
        raise WorkloadError(
            f"{where}: a histogram is {{edges = [...], counts = [...]}} ({error})"
        ) from error
    except length_models.LengthsError as error:
        raise WorkloadError(f"{where}: {error}") from error


def _link(table: str, key: str, value: Any) -> Interconnect:
    if isinstance(value, str):
        if value not in INTERCONNECTS:
            raise WorkloadError(
                f"[{table}] {key}: {value!r} is not a known link"
                f"{did_you_mean(value, INTERCONNECTS)}; give one of "
                f"{spoken_list(INTERCONNECTS)}, or GB/s per GPU as a number"
            )
        return INTERCONNECTS[value]
    gb_per_s = _number(table, key, value, minimum=1e-3, fix="a link name or GB/s per GPU")
    return Interconnect(f"{gb_per_s:g} GB/s", gb_per_s * 1e9)


def _model(table: Mapping[str, Any]) -> tuple[str, ModelSpec]:
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise WorkloadError(
            "[model] name: give the model vllm serve and the trainer load, "
            'e.g. name = "Qwen/Qwen2.5-7B"'
        )
    config = table.get("config")
    if config is not None:
        if not isinstance(config, Mapping):
            raise WorkloadError(
                "[model] config: the path of an HF config.json (the shell "
                f"reads it), got {config!r}"
            )
        try:
            spec = model_spec(config)
        except (ValueError, TypeError) as error:
            raise WorkloadError(f"[model] config: {error}") from error
        if "parameters" in table:
            parameters = _number("model", "parameters", table["parameters"], minimum=1)
            spec = attrs.evolve(spec, parameters=float(parameters))
        return name, spec
    if "parameters" not in table or "kv_bytes_per_token" not in table:
        raise WorkloadError(
            "[model]: give config (an HF config.json) or parameters with kv_bytes_per_token"
        )
    parameters = _number("model", "parameters", table["parameters"], minimum=1)
    kv = _number(
        "model",
        "kv_bytes_per_token",
        table["kv_bytes_per_token"],
        minimum=1,
        fix="2 x layers x kv_heads x head_dim x 2 bytes in bf16",
    )
    return name, parameters_only(float(parameters), float(kv))


def _settings(table: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "max_staleness" in table:
        out["max_staleness"] = _number(
            "settings", "max_staleness", table["max_staleness"], integer=True, minimum=0
        )
    if "weight_sync_steps" in table:
        out["weight_sync_steps"] = _number(
            "settings", "weight_sync_steps", table["weight_sync_steps"], integer=True, minimum=1
        )
    staleness, sync = out.get("max_staleness"), out.get("weight_sync_steps")
    if staleness is not None and sync is not None and staleness < sync - 1:
        raise WorkloadError(
            f"[settings] max_staleness: {staleness} is below weight_sync_steps "
            f"- 1 ({sync - 1}): samples between pushes would all be dropped; "
            "raise max_staleness or lower weight_sync_steps"
        )
    path = table.get("weight_path", "nccl")
    if path not in WEIGHT_PATHS:
        raise WorkloadError(
            f"[settings] weight_path: {path!r} is not one of "
            f"{spoken_list(WEIGHT_PATHS)}{did_you_mean(str(path), WEIGHT_PATHS)}"
        )
    out["weight_path"] = path
    if "lora_bytes" in table:
        out["lora_bytes"] = float(_number("settings", "lora_bytes", table["lora_bytes"], minimum=1))
    if "delta_changed_frac" in table:
        frac = float(
            _number("settings", "delta_changed_frac", table["delta_changed_frac"], minimum=0)
        )
        if frac > 1:
            raise WorkloadError(
                f"[settings] delta_changed_frac: {frac} is a fraction of the policy's elements, "
                "in [0, 1] (perf/weight_sync_unchanged_frac of a run is 1 minus it)"
            )
        out["delta_changed_frac"] = frac
    if path == "lora" and "lora_bytes" not in out:
        raise WorkloadError(
            "[settings] lora_bytes: the lora weight path needs the adapters' size in bytes"
        )
    return out


def _trainer(table: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"train_mfu": _mfu(table.get("mfu", TRAIN_MFU))}
    if "step_overhead_s" in table:
        overhead = _number("trainer", "step_overhead_s", table["step_overhead_s"], minimum=0)
        out["train_overhead_s"] = float(overhead)
    if "measured" in table:
        out["train_measured"] = _measured(table["measured"])
    return out


def _measured(value: Any) -> tuple[tuple[int, float], ...]:
    fix = (
        "give a list of {gpus = N, train_s = S} tables, the trainer's seconds a step "
        "(perf/step_s less perf/rollout_wait_s) at two or more trainer GPU counts"
    )
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise WorkloadError(f"[trainer] measured: {fix}")
    points = []
    for entry in value:
        if set(entry) != {"gpus", "train_s"}:
            raise WorkloadError(f"[trainer] measured: {dict(entry)}: {fix}")
        gpus = _number("trainer", "measured gpus", entry["gpus"], integer=True, minimum=1)
        seconds = float(_number("trainer", "measured train_s", entry["train_s"], minimum=1e-9))
        points.append((gpus, seconds))
    if len({g for g, _ in points}) < 2:
        raise WorkloadError(f"[trainer] measured: only one GPU count; {fix}")
    return tuple(points)


def _mfu(value: Any) -> float:
    mfu = float(_number("trainer", "mfu", value, minimum=1e-3))
    if mfu > 1:
        raise WorkloadError(f"[trainer] mfu: a share of peak FLOP/s, at most 1, got {mfu}")
    return mfu


def workload_from_mapping(data: Mapping[str, Any]) -> Workload:
    """The workload of a parsed file (``[model] config`` already read into a mapping).

    Raises:
        WorkloadError: a missing or bad key, naming the table, the key and the fix.
    """
    unknown = sorted(set(data) - set(TABLES))
    if unknown:
        raise WorkloadError(
            f"[{unknown[0]}]: not a table of a workload"
            f"{did_you_mean(unknown[0], TABLES)}; the tables are "
            f"{spoken_list(TABLES)}"
        )
    for name in REQUIRED_TABLES:
        if name not in data:
            raise WorkloadError(
                f"[{name}]: missing; a workload needs the tables "
                f"{', '.join(REQUIRED_TABLES)} (docs/experiments.md)"
            )
    tables = {name: _table(data, name) for name in TABLES}
    model_name, model = _model(tables["model"])
    cluster = tables["cluster"]
    gpu_name = cluster.get("gpu")
    if not isinstance(gpu_name, str) or gpu_name not in GPUS:
        raise WorkloadError(
            f"[cluster] gpu: {gpu_name!r} is not one of {spoken_list(GPUS)}"
            f"{did_you_mean(str(gpu_name), GPUS)}"
        )
    gpus = cluster.get("gpus")
    if gpus is not None:
        gpus = _number(
            "cluster",
            "gpus",
            gpus,
            integer=True,
            minimum=2,
            fix="one to train and one to generate at least",
        )
    batch = tables["batch"]
    for key in TABLES["batch"]:
        if key not in batch:
            raise WorkloadError(
                f"[batch] {key}: missing; a step trains prompts_per_step x num_generations samples"
            )
    lengths = tables["lengths"]
    for key in ("prompt", "response"):
        if key not in lengths:
            raise WorkloadError(
                f"[lengths] {key}: missing; give its tokens (a number, or mean, "
                "quantiles and max, or a histogram)"
            )
    figure, overhead = None, None if not tables["generator"] else 0.0
    g = tables["generator"]
    if g and not isinstance(g.get("source"), str):
        raise WorkloadError(
            "[generator] source: say where the decode figures come from "
            "(a paper, a benchmark, a measured run)"
        )
    if "step_overhead_s" in g:
        overhead = float(_number("generator", "step_overhead_s", g["step_overhead_s"], minimum=0))
    if g and ("tokens_per_s" in g or "concurrency" in g or "step_overhead_s" not in g):
        context = g.get("context_tokens")
        figure = DecodeFigure(
            float(_number("generator", "tokens_per_s", g.get("tokens_per_s"), minimum=1e-9)),
            float(_number("generator", "concurrency", g.get("concurrency"), minimum=1)),
            None
            if context is None
            else float(_number("generator", "context_tokens", context, minimum=0)),
            g["source"],
        )
    try:
        contention = Contention(**{k: float(v) for k, v in tables["contention"].items()})
    except ValueError as error:
        raise WorkloadError(f"[contention]: {error}") from error
    return Workload(
        model_name=model_name,
        model=model,
        gpu=GPUS[gpu_name],
        gpus=gpus,
        gpus_per_node=_number(
            "cluster", "gpus_per_node", cluster.get("gpus_per_node", 8), integer=True, minimum=1
        ),
        intra_node=_link(
            "cluster", "intra_node", cluster.get("intra_node", INTRA_NODE_OF[gpu_name])
        ),
        inter_node=_link("cluster", "inter_node", cluster.get("inter_node", "ib-ndr")),
        prompts_per_step=_number(
            "batch", "prompts_per_step", batch["prompts_per_step"], integer=True, minimum=1
        ),
        num_generations=_number(
            "batch",
            "num_generations",
            batch["num_generations"],
            integer=True,
            minimum=2,
            fix="GRPO compares a prompt's responses",
        ),
        prompt_lengths=lengths_from("[lengths] prompt", lengths["prompt"]),
        response_lengths=lengths_from("[lengths] response", lengths["response"]),
        decode_figure=figure,
        decode_step_overhead_s=overhead,
        contention=contention,
        **_group_correlation(lengths),
        **_settings(tables["settings"]),
        **_trainer(tables["trainer"]),
    )
