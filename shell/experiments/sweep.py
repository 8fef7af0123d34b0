"""``asyncgrpo sweep SWEEP_FILE``: many runs over settings and seeds, resumable, on shared servers.

A sweep file (TOML, YAML or JSON) holds what ``asyncgrpo train --config`` holds (``model``,
``dataset``, ``reward_funcs`` and config fields, at the top level or in an ``asyncgrpo``
table: the base of every run) and::

    seeds = [0, 1, 2, 3, 4]
    loop = "tasks:VariedLengthLoop"       # optional: an AsyncRolloutLoop subclass
    claims = ["time_to(0.9)[max_staleness=1] <= 0.8 * time_to(0.9)[max_staleness=0]"]

    [grid]                                # every combination of these values
    max_staleness = [0, 1, 4]

    # or, instead of or beside the grid, a list of setting sets:
    # [[runs]]
    # loss_type = "cispo"

    [stop]                                # when a run ends (the first rule that applies)
    max_steps = 40
    reward_threshold = 0.9                # a logged window's reward at or above it
    threshold_metric = "reward"           # or an evaluation's, e.g. "eval/held_out/reward"
    wall_time_s = 300                     # seconds of training
    spreadless_steps = 5                  # stop_after_spreadless_steps

    [server]                              # the vLLM server the runs share (local, started here)
    max_model_len = 1024                  # cut to the model's own context length
    dtype = "as_trainer"                  # the server's dtype (default: the runs' dtype);
                                          # as_trainer: the one the learner computes in here
    enforce_eager = false                 # true: no torch.compile (starts sooner, runs slower)

    [probe]                               # optional: after the runs, measure the server for the
    concurrency = [1, 4, 16, 64]          # simulator (asyncgrpo simulate, asyncgrpo plan) at these
    seconds = 8                           # requests in flight, alone and beside a training load
    beside_training = true                # (asyncgrpo.shell.experiments.generator_probe)

``model`` is a model id or directory, or a tiny random model built here:
``model = {tiny = "qwen3", hidden_size = 128, num_layers = 2, seed = 0}``. ``dataset`` is a
``.json``/``.jsonl`` file, a ``datasets.save_to_disk`` folder, or ``"module:function"`` returning
a dataset. ``eval_dataset`` (optional) is one such dataset, a list of ``[NAME=]PATH`` strings or
a table of named ones (as ``asyncgrpo train --eval_dataset``), evaluated as the runs' config says
(``eval_strategy``, ``eval_steps``; docs/evaluation.md) and scored by ``eval_reward_funcs``
(optional; default: the ``reward_funcs``). ``module:name``
strings import from the sweep file's folder too (and from the current directory), in the run and
in its rollout process.

Each run has its own directory, ``<output_dir>/<setting>=<value>,.../seed=<seed>``, and its own
process. ``<output_dir>/index.json`` lists every run with its status. A sweep started again
skips finished runs, resumes an interrupted one from its last checkpoint (``save_steps``; from
scratch without one) and leaves failed ones (``--retry-failed`` runs them again). Runs whose
servers would be the same share one server, started by the sweep with the cores the CPU plan
gives a server (or ``--vllm-url``, once per server to use: runs then go side by side, one per
server). Settings interleave (:mod:`asyncgrpo.core.experiments.sweep_plan`).

From Python, :func:`run_sweep` (``asyncgrpo.experiments.run_sweep``) does the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog

from asyncgrpo.adapters.atomic_files import write_text_whole
from asyncgrpo.core.experiments.sweep_plan import Action, PlannedRun, Status, next_action, plan_runs
from asyncgrpo.core.names import did_you_mean
from asyncgrpo.shell.config import (
    AsyncGRPOConfig,
    NamedObjectError,
    eval_dataset_specs,
    read_config,
)
from asyncgrpo.shell.experiments.generator_probe import (
    PROBE_FILE,
    PROBE_KEYS,
    ProbeError,
    ProbeSettings,
    probe_sweep,
)
from asyncgrpo.shell.run import checkpoints, signals_interrupt

log = structlog.get_logger("asyncgrpo.sweep")

SWEEP_KEYS = (
    "model",
    "dataset",
    "eval_dataset",
    "reward_funcs",
    "eval_reward_funcs",
    "loop",
    "seeds",
    "grid",
    "runs",
    "stop",
    "server",
    "probe",
    "claims",
    "compare",
)
STOP_KEYS = ("max_steps", "reward_threshold", "threshold_metric", "wall_time_s", "spreadless_steps")
SERVER_KEYS = ("max_model_len", "max_logprobs", "dtype", "enforce_eager", "extra_args")
INDEX = "index.json"
RUN_SPEC = "run_spec.json"
RUN_RESULT = "run.json"
SWEEP_COPY = "sweep.json"
SET_BY_SWEEP = ("seed", "output_dir", "vllm_server_base_url")
DEFAULT_SAVE_STEPS = 10  # a checkpoint this often, so an interrupted run resumes
RUN_STOP_GRACE_S = 120.0  # a run asked to stop gets this long before it is killed
RUN_MODULE = "asyncgrpo.shell.experiments.sweep_run"  # the process of one run


class SweepError(ValueError):
    """A sweep file or a sweep directory that cannot be used; the message says what to fix."""


@attrs.frozen
class StopRule:
    """When each run of a sweep ends.

    Attributes:
        max_steps: optimizer steps at most (the runs' ``max_steps``).
        reward_threshold: end after the first logged window whose ``threshold_metric``
            reaches it.
        threshold_metric: the metric ``reward_threshold`` reads: ``reward`` (default), or any
            logged one, e.g. an evaluation's ``eval/held_out/reward``.
        wall_time_s: end after this many seconds of training.
        spreadless_steps: the runs' ``stop_after_spreadless_steps`` (a collapsed policy).
    """

    max_steps: int
    reward_threshold: float | None = None
    threshold_metric: str = "reward"
    wall_time_s: float | None = None
    spreadless_steps: int | None = None


@attrs.frozen
class Sweep:
    """A sweep file, read and checked."""

    path: Path
    base: Mapping[str, Any]
    model: str | Mapping[str, Any]
    dataset: str
    reward_funcs: tuple[str, ...]
    loop: str | None
    runs: tuple[PlannedRun, ...]
    stop: StopRule
    server: Mapping[str, Any]
    claims: tuple[str, ...]
    compare: Mapping[str, Any]
    eval_dataset: Mapping[str, str] | None = None  # name -> PATH
    eval_reward_funcs: tuple[str, ...] = ()  # empty: the reward_funcs
    probe: ProbeSettings | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "base": dict(self.base),
            "model": self.model,
            "dataset": self.dataset,
            "reward_funcs": list(self.reward_funcs),
            "loop": self.loop,
            "stop": attrs.asdict(self.stop),
            "server": dict(self.server),
            "claims": list(self.claims),
            "compare": dict(self.compare),
            "probe": None if self.probe is None else attrs.asdict(self.probe),
        }


def read_sweep(path: str | Path) -> Sweep:
    """Read a sweep file; every run's config is built once here, so a bad value fails before
    any server starts, naming the run and the field."""
    path = Path(path)
    base, extra = read_config(path, AsyncGRPOConfig)
    unknown = sorted(set(extra) - set(SWEEP_KEYS))
    if unknown:
        raise SweepError(
            f"{path}: {unknown[0]!r} is neither a sweep key nor an AsyncGRPOConfig "
            "field" + did_you_mean(unknown[0], [*SWEEP_KEYS])
        )
    for key in ("model", "dataset", "reward_funcs"):
        if key not in extra:
            raise SweepError(f"{path}: {key} is required (as in asyncgrpo train --config)")
    stop = _table(extra, "stop", path, STOP_KEYS)
    if "max_steps" not in stop and base.get("max_steps", -1) <= 0:
        raise SweepError(f"{path}: give [stop] max_steps (or max_steps in the base config)")
    rule = StopRule(
        max_steps=int(stop.get("max_steps", base.get("max_steps", 0))),
        reward_threshold=stop.get("reward_threshold"),
        threshold_metric=str(stop.get("threshold_metric", "reward")),
        wall_time_s=stop.get("wall_time_s"),
        spreadless_steps=stop.get("spreadless_steps"),
    )
    grid = _table(extra, "grid", path, None)
    overrides = extra.get("runs") or []
    if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
        raise SweepError(f"{path}: runs must be a list of tables of settings ([[runs]])")
    for key in [*grid, *(k for o in overrides for k in o)]:
        if key in SET_BY_SWEEP:
            raise SweepError(
                f"{path}: {key} is set by the sweep itself (seeds, output dir, "
                "server); remove it from grid/runs"
            )
    seeds = extra.get("seeds", [base.get("seed", 0)])
    try:
        planned = plan_runs(grid, overrides, [int(s) for s in seeds])
    except ValueError as error:
        raise SweepError(f"{path}: {error}") from error
    sweep = Sweep(
        path=path,
        base=base,
        model=extra["model"],
        dataset=str(extra["dataset"]),
        reward_funcs=tuple(_strings(extra["reward_funcs"], "reward_funcs", path)),
        loop=extra.get("loop"),
        runs=tuple(planned),
        stop=rule,
        server=_table(extra, "server", path, SERVER_KEYS),
        claims=tuple(_strings(extra.get("claims", []), "claims", path)),
        compare=_table(extra, "compare", path, ("threshold", "baseline")),
        eval_dataset=_eval_datasets(extra.get("eval_dataset"), path),
        eval_reward_funcs=tuple(
            _strings(extra.get("eval_reward_funcs", []), "eval_reward_funcs", path)
        ),
        probe=_probe_settings(extra, path),
    )
    for run in planned:
        try:
            run_config(sweep, run, Path("."), "http://127.0.0.1:1")
        except (TypeError, ValueError) as error:
            raise SweepError(f"{path}: the run {run.name}: {error}") from error
    return sweep


def _probe_settings(extra: Mapping[str, Any], path: Path) -> ProbeSettings | None:
    if "probe" not in extra:
        return None
    try:
        return ProbeSettings.from_table(_table(extra, "probe", path, PROBE_KEYS), str(path))
    except ProbeError as error:
        raise SweepError(str(error)) from error


def _table(
    extra: Mapping[str, Any], key: str, path: Path, known: Sequence[str] | None
) -> dict[str, Any]:
    table = extra.get(key, {})
    if not isinstance(table, dict):
        raise SweepError(f"{path}: {key} must be a table ([{key}])")
    if known is not None:
        for name in table:
            if name not in known:
                raise SweepError(
                    f"{path}: [{key}] {name!r} is not one of {list(known)}"
                    + did_you_mean(name, list(known))
                )
    return dict(table)


def _eval_datasets(value: Any, path: Path) -> dict[str, str] | None:
    """The sweep's ``eval_dataset`` by name (:func:`~asyncgrpo.shell.config.eval_dataset_specs`)."""
    if value is None:
        return None
    try:
        return eval_dataset_specs(value, f"{path}: eval_dataset")
    except NamedObjectError as error:
        raise SweepError(str(error)) from error


def _strings(value: Any, key: str, path: Path) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise SweepError(f"{path}: {key} must be a string or a list of strings")
    return values


def run_config(sweep: Sweep, run: PlannedRun, run_dir: Path, base_url: str) -> AsyncGRPOConfig:
    """The config of one run: the base, the run's settings, its seed, the stop rule."""
    values = {
        "save_steps": DEFAULT_SAVE_STEPS,
        "save_total_limit": 1,
        "disable_tqdm": True,
        **sweep.base,
        **run.settings,
        "seed": run.seed,
        "output_dir": str(run_dir),
        "vllm_server_base_url": base_url,
        "max_steps": sweep.stop.max_steps,
    }
    if sweep.stop.spreadless_steps is not None:
        values["stop_after_spreadless_steps"] = sweep.stop.spreadless_steps
    return AsyncGRPOConfig(**values)


# ----------------------------------------------------------------------------- the sweep


@attrs.frozen
class SweepResult:
    """What a sweep ended with: each run's status by name."""

    output_dir: Path
    statuses: Mapping[str, str]

    @property
    def finished(self) -> int:
        return sum(s == Status.FINISHED.value for s in self.statuses.values())


def run_sweep(
    sweep_file: str | Path,
    output_dir: str | Path,
    vllm_urls: Sequence[str] = (),
    retry_failed: bool = False,
) -> SweepResult:
    """Run (or finish) a sweep; see the module docstring."""
    sweep = read_sweep(sweep_file)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SWEEP_COPY).write_text(json.dumps(sweep.as_json(), indent=1))
    index = _Index(out, sweep)
    todo: list[tuple[PlannedRun, Action]] = []
    for run in sweep.runs:
        run_dir = out / run.name
        action = next_action(
            index.status(run.name), checkpoints.latest(run_dir) is not None, retry_failed
        )
        if action is not Action.SKIP:
            todo.append((run, action))
    log.info("sweep", runs=len(sweep.runs), to_run=len(todo), output_dir=str(out))
    probe = sweep.probe is not None and not (out / PROBE_FILE).exists()
    if todo or probe:
        model = _model_dir(sweep, out)
        with signals_interrupt(), _servers(sweep, model, out, vllm_urls) as urls:
            if todo:
                _run_all(sweep, model, out, todo, urls, index)
            if sweep.probe is not None and probe and not index.stopping.is_set():
                probe_sweep(
                    sweep.probe,
                    AsyncGRPOConfig(
                        **{**sweep.base, "output_dir": str(out), "vllm_server_base_url": urls[0]}
                    ),
                    model,
                    [out / run.name for run in sweep.runs],
                )
    return SweepResult(out, index.statuses())


def _run_all(
    sweep: Sweep,
    model: str,
    out: Path,
    todo: list[tuple[PlannedRun, Action]],
    urls: list[str],
    index: _Index,
) -> None:
    """The runs, one per server at a time, in the planned order."""
    work: queue.SimpleQueue[tuple[PlannedRun, Action] | None] = queue.SimpleQueue()
    for item in todo:
        work.put(item)
    for _ in urls:
        work.put(None)
    errors: list[BaseException] = []
    done = [threading.Event() for _ in urls]

    def worker(url: str, finished: threading.Event) -> None:
        try:
            while (item := work.get()) is not None and not index.stopping.is_set():
                run, action = item
                _run_one(sweep, model, out, run, action, url, index)
        except BaseException as error:  # surfaced by the main thread below
            errors.append(error)
        finally:
            finished.set()

    for url, finished in zip(urls, done, strict=True):
        threading.Thread(target=worker, args=(url, finished), daemon=True).start()
    try:
        for finished in done:
            while not finished.wait(0.5):  # the main thread stays interruptible
                pass
    except BaseException:
        index.stopping.set()  # the workers stop their runs (interrupted, resumable) and return
        for finished in done:  # Event.wait, unlike Thread.join, may be interrupted safely
            while not finished.wait(0.5):
                pass
        raise
    if errors:
        raise errors[0]


def _run_one(
    sweep: Sweep, model: str, out: Path, run: PlannedRun, action: Action, url: str, index: _Index
) -> None:
    run_dir = out / run.name
    if action is Action.START and run_dir.exists():
        shutil.rmtree(run_dir)  # a run started over is counted once
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_config(sweep, run, run_dir, url)
    spec = {
        "config": {k: v for k, v in config.to_dict().items() if k in _given(sweep, run)},
        "model": model,
        "dataset": sweep.dataset,
        "reward_funcs": list(sweep.reward_funcs),
        "eval_dataset": sweep.eval_dataset,
        "eval_reward_funcs": list(sweep.eval_reward_funcs),
        "loop": sweep.loop,
        "stop": attrs.asdict(sweep.stop),
        "resume": action is Action.RESUME,
        "import_path": _import_path(sweep),
    }
    (run_dir / RUN_SPEC).write_text(json.dumps(spec, indent=1))
    index.update(run, Status.RUNNING)
    log.info("run", run=run.name, action=action.value, server=url)
    started = time.monotonic()
    with (run_dir / "run.log").open("ab") as output:
        command = [sys.executable, "-m", RUN_MODULE, str(run_dir), str(os.getpid())]
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        while (code := _wait(process, 0.5)) is None:
            if index.stopping.is_set():  # the sweep was interrupted: end the run cleanly
                process.send_signal(signal.SIGTERM)
                code = _wait(process, RUN_STOP_GRACE_S)
                if code is None:
                    process.kill()
                    code = process.wait()
                index.update(run, Status.INTERRUPTED, exit_code=code)
                return
    status = (
        Status.FINISHED
        if code == 0
        else (Status.INTERRUPTED if code < 0 or code in (130, 143) else Status.FAILED)
    )
    index.update(run, status, wall_s=time.monotonic() - started, exit_code=code)
    log.info("run ended", run=run.name, status=status.value, exit_code=code)


def _wait(process: subprocess.Popen[bytes], seconds: float) -> int | None:
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def _given(sweep: Sweep, run: PlannedRun) -> set[str]:
    """The config fields a run sets (the rest keep their defaults, whatever version of
    asyncgrpo reads the run's ``run_spec.json``)."""
    return {
        *sweep.base,
        *run.settings,
        *SET_BY_SWEEP,
        "max_steps",
        "save_steps",
        "save_total_limit",
        "disable_tqdm",
        "stop_after_spreadless_steps",
    }


def _import_path(sweep: Sweep) -> list[str]:
    return [str(sweep.path.resolve().parent), os.getcwd()]


def _model_dir(sweep: Sweep, out: Path) -> str:
    """The model's id or directory (a packaged model's name or a ``.gguf`` file becomes its
    checkpoint); a tiny random model is built under the sweep once."""
    if isinstance(sweep.model, str):
        from asyncgrpo.adapters.models.packaged import resolve_model

        return resolve_model(sweep.model)
    options = dict(sweep.model)
    architecture = options.pop("tiny", None)
    if architecture is None:
        raise SweepError(
            f"{sweep.path}: model must be an id/path or a table with tiny = '<architecture>'"
        )
    name = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    path = out / "models" / f"tiny-{architecture}{',' + name if name else ''}"
    if not (path / "config.json").exists():
        from asyncgrpo.adapters.models.causal_lm import save_tiny_model

        seed = int(options.pop("seed", 0))
        save_tiny_model(path, architecture, seed=seed, **options)
    return str(path)


@contextlib.contextmanager
def _servers(sweep: Sweep, model: str, out: Path, urls: Sequence[str]) -> Iterator[list[str]]:
    """The servers the runs use: the given URLs, or one local server with the CPU plan's
    cores."""
    if urls:
        yield list(urls)
        return
    from asyncgrpo.shell.servers import (
        AS_TRAINER,
        dtype_as_trainer,
        local_server_spec,
        local_servers,
        servers_cpus_for,
        servers_gpus_for,
    )

    config = AsyncGRPOConfig(
        **{**sweep.base, "output_dir": str(out), "vllm_server_base_url": "http://127.0.0.1"}
    )
    options = dict(sweep.server)
    if "dtype" in options:  # the server's own, e.g. bf16 beside a trainer computing in bf16
        dtype = str(options["dtype"])
        dtype = dtype_as_trainer(model, config) if dtype == AS_TRAINER else dtype
        config = dataclasses.replace(config, dtype=dtype)
    spec = local_server_spec(
        model,
        config,
        max_model_len=int(options.get("max_model_len", 1024)),
        max_logprobs=int(options.get("max_logprobs", 20)),
        enforce_eager=bool(options.get("enforce_eager", False)),
        extra_args=options.get("extra_args", ()),
    )
    with local_servers(
        spec, servers_cpus_for(config, 1), out, servers_gpus_for(config, 1)
    ) as servers:
        yield [servers[0].base_url]


class _Index:
    """``index.json``: every run of the sweep with its status, written whole on each change."""

    def __init__(self, out: Path, sweep: Sweep) -> None:
        self.path = out / INDEX
        self._lock = threading.Lock()
        self.stopping = threading.Event()  # the sweep was interrupted
        old = json.loads(self.path.read_text()) if self.path.exists() else {"runs": []}
        known = {r["name"]: r for r in old.get("runs", [])}
        self.runs = {
            run.name: known.get(run.name)
            or {
                "name": run.name,
                "settings": dict(run.settings),
                "seed": run.seed,
                "status": Status.PLANNED.value,
            }
            for run in sweep.runs
        }
        self._write()

    def status(self, name: str) -> Status:
        return Status(self.runs[name]["status"])

    def statuses(self) -> dict[str, str]:
        return {name: entry["status"] for name, entry in self.runs.items()}

    def update(self, run: PlannedRun, status: Status, **fields: Any) -> None:
        with self._lock:
            self.runs[run.name] = {**self.runs[run.name], "status": status.value, **fields}
            self._write()

    def _write(self) -> None:
        write_text_whole(self.path, json.dumps({"runs": list(self.runs.values())}, indent=1))


def read_index(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The runs of a sweep directory (name, settings, seed, status, ...)."""
    path = Path(sweep_dir) / INDEX
    if not path.exists():
        raise SweepError(f"{sweep_dir}: not a sweep directory (no {INDEX})")
    return list(json.loads(path.read_text())["runs"])
