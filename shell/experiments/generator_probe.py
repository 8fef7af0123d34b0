"""A sweep's generator probe: its vLLM server's throughput at several concurrencies, alone and
beside a training load, for the simulator (``asyncgrpo simulate`` and ``asyncgrpo plan``).

A calibration run at ``max_staleness`` 0 has one or two groups in flight, so it measures the
server at one concurrency; a run allowed to go ahead keeps more requests in flight, and a
server generates faster with more (docs/experiments.md). On shared cores the two sides also
slow each other. A sweep file with a ``[probe]`` table measures both with the sweep's own
server, after its runs::

    [probe]
    concurrency = [1, 4, 16, 64]   # requests kept in flight, one setting after another
    seconds = 8                    # each setting's measuring window, after a warm-up
    beside_training = true         # also measure beside a training load (shared cores only)

For each concurrency, that many requests are kept in flight (a new one is sent as one ends);
after every slot has finished one request, the completion tokens of the requests that end
within the window, over its length, are that concurrency's tokens per second. The prompts are
random token ids of the runs' measured mean prompt length; each request asks for the runs'
``max_completion_length``, sampled as the runs sample (temperature 1, their log-probs).

With ``beside_training``, a training load (:mod:`asyncgrpo.shell.experiments.training_load`:
the sweep's model, forward and backward over rows of the runs' token budget, on the cores the
CPU plan gives the trainer) runs alone, then beside the server at the highest concurrency:
``training_slowdown`` is its step time beside generation over alone, ``generation_slowdown``
the server's tokens per second alone over beside it. The load is the model's plain forward and
backward, not the learner's packed one: it stands for the trainer's use of the cores and memory
bandwidth, and only its ratio is used.

Everything is written to ``<output_dir>/generator_probe.json`` (:data:`PROBE_FILE`), which the
calibration reads for every run of the sweep (:func:`read_probe`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import structlog
import torch

from asyncgrpo.adapters.vllm.auth import bearer
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.run import read_metrics
from asyncgrpo.shell.servers import run_async

log = structlog.get_logger("asyncgrpo.probe")

PROBE_FILE = "generator_probe.json"
PROBE_KEYS = ("concurrency", "seconds", "beside_training")
TRAINING_LOAD = "asyncgrpo.shell.experiments.training_load"  # run as its own process
WARMUP_TIMEOUT_S = 600.0  # the longest a concurrency's first requests may take


class ProbeError(ValueError):
    """A ``[probe]`` table, or a probe file, that cannot be used; the message says the fix."""


@attrs.frozen
class ProbeSettings:
    """A sweep's ``[probe]`` table, checked.

    Attributes:
        concurrency: requests kept in flight, one setting after another (each >= 1).
        seconds: each setting's measuring window, seconds (> 0).
        beside_training: also measure beside a training load on the trainer's cores.
    """

    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    seconds: float = 8.0
    beside_training: bool = True

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str) -> ProbeSettings:
        """The settings of a ``[probe]`` table (keys already checked against PROBE_KEYS)."""
        given = dict(table)
        if "concurrency" in given:
            values = given["concurrency"]
            if (
                not isinstance(values, list)
                or not values
                or not all(isinstance(v, int) and v >= 1 for v in values)
            ):
                raise ProbeError(
                    f"{where}: [probe] concurrency must be a list of integers >= 1 "
                    f"(e.g. [1, 4, 16, 64]), got {values!r}"
                )
            given["concurrency"] = tuple(sorted(set(values)))
        seconds = given.get("seconds", attrs.fields(cls).seconds.default)
        if not isinstance(seconds, int | float) or not seconds > 0:
            raise ProbeError(f"{where}: [probe] seconds must be a number > 0, got {seconds!r}")
        if not isinstance(given.get("beside_training", True), bool):
            raise ProbeError(f"{where}: [probe] beside_training must be true or false")
        return cls(**given)


@attrs.frozen
class LoadSpec:
    """What the training load trains (:mod:`asyncgrpo.shell.experiments.training_load`).

    Attributes:
        model: the model's directory.
        tokens: tokens of the row each step forwards (the runs' ``token_budget``).
        bf16: compute in bf16 under autocast, as the learner does where it chose bf16.
        server_url: the server the CPU plan shares the cores with.
    """

    model: str
    tokens: int
    bf16: bool
    server_url: str

    def argv(self, steps_file: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            TRAINING_LOAD,
            self.model,
            str(self.tokens),
            "1" if self.bf16 else "0",
            self.server_url,
            str(steps_file),
        ]


@attrs.frozen
class ProbePoint:
    """The server at one concurrency.

    Attributes:
        concurrency: requests kept in flight.
        tokens_per_s: completion tokens per second over the window.
        requests: requests that ended within the window.
        seconds: the window's length.
    """

    concurrency: int
    tokens_per_s: float
    requests: int
    seconds: float


@attrs.frozen
class Probe:
    """A probe file: the points alone, and the contention factors (1 when not measured).

    Attributes:
        points: the server alone, one per concurrency.
        training_slowdown: the training load's step time beside generation over alone.
        generation_slowdown: the server's tokens/s alone over beside the training load.
        prompt_tokens, max_completion_tokens: the requests' shape.
        note: how the contention was measured, or why not.
    """

    points: tuple[ProbePoint, ...]
    training_slowdown: float = 1.0
    generation_slowdown: float = 1.0
    prompt_tokens: int = 0
    max_completion_tokens: int = 0
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Probe:
        points = tuple(ProbePoint(**p) for p in data["points"])
        return cls(**{**data, "points": points})


def read_probe(run_dir: Path) -> Probe | None:
    """The probe of a run's sweep (the run's folder or one above it), or None."""
    for folder in (run_dir, *run_dir.resolve().parents):
        if (folder / PROBE_FILE).exists():
            try:
                return Probe.from_json(json.loads((folder / PROBE_FILE).read_text()))
            except (ValueError, KeyError, TypeError) as error:
                raise ProbeError(
                    f"{folder / PROBE_FILE}: not a probe file ({error}); "
                    "delete it and run the sweep again"
                ) from error
    return None


async def _measure(
    client: VLLMClient,
    concurrency: int,
    seconds: float,
    prompt_tokens: int,
    params: SamplingParams,
    vocab_size: int,
    seed: int,
) -> ProbePoint:
    """Keep ``concurrency`` requests in flight; tokens/s over the window after the warm-up.

    The window is ``seconds`` long, or runs on until a request ends in it (on a loaded machine
    a request can outlast a short window: a window with no request ended measures nothing)."""
    rng = np.random.default_rng(seed)
    ended: list[tuple[float, int]] = []  # (monotonic end time, completion tokens)
    finished_first = [False] * concurrency
    warm = anyio.Event()
    window: list[float] = []  # the window's start, once it started
    ended_in_window = anyio.Event()

    async def slot(index: int) -> None:
        while True:
            prompt = rng.integers(0, vocab_size, prompt_tokens).tolist()
            generation = await client.generate(prompt, params, seed=int(rng.integers(2**31)))
            ended.append((time.monotonic(), len(generation.output_ids)))
            if window:
                ended_in_window.set()
            if not finished_first[index]:
                finished_first[index] = True
                if all(finished_first):
                    warm.set()

    async with anyio.create_task_group() as group:
        for index in range(concurrency):
            group.start_soon(slot, index)
        with anyio.fail_after(WARMUP_TIMEOUT_S):
            await warm.wait()
        start = time.monotonic()
        window.append(start)
        await anyio.sleep(seconds)
        with anyio.move_on_after(WARMUP_TIMEOUT_S):
            await ended_in_window.wait()
        end = time.monotonic()
        group.cancel_scope.cancel()
    tokens = [n for t, n in ended if start < t <= end]
    if not tokens:
        raise ProbeError(
            f"no request ended within {end - start:.0f} s at {concurrency} requests in flight "
            "(the server stalled): check the server's log"
        )
    return ProbePoint(concurrency, sum(tokens) / (end - start), len(tokens), end - start)


LOAD_WINDOW_MAX_S = 120.0
"""The longest a window of the contention measurement runs on, waiting for the training load's
2 steps."""


def _load_rate(lines: Sequence[str], start: float, end: float) -> float | None:
    """The training load's median step seconds among the steps that ended in [start, end]."""
    steps = [float(s) for t, s in (line.split() for line in lines) if start <= float(t) <= end]
    return statistics.median(steps) if len(steps) >= 2 else None


def probe_server(
    base_url: str,
    settings: ProbeSettings,
    *,
    prompt_tokens: int,
    max_completion_tokens: int,
    num_sampler_logprobs: int,
    vocab_size: int,
    headers: Mapping[str, str] | None = None,
    training: LoadSpec | None = None,
) -> Probe:
    """Probe the server at ``base_url`` (see the module's docstring); ``training``: the load
    to measure contention with (None: not measured)."""
    params = SamplingParams(
        max_tokens=max_completion_tokens, num_sampler_logprobs=num_sampler_logprobs
    )

    async def served() -> str:
        async with VLLMClient(base_url, "", headers=headers) as client:
            return (await client.served_models())[0]

    model = run_async(served)

    async def measure(concurrency: int, seconds: float = settings.seconds) -> ProbePoint:
        async with VLLMClient(base_url, model, headers=headers) as client:
            point = await _measure(
                client,
                concurrency,
                seconds,
                prompt_tokens,
                params,
                vocab_size,
                seed=concurrency,
            )
        log.info(
            "probe",
            concurrency=concurrency,
            tokens_per_s=round(point.tokens_per_s, 1),
            requests=point.requests,
        )
        return point

    points = tuple(run_async(measure, c) for c in settings.concurrency)
    shape = {"prompt_tokens": prompt_tokens, "max_completion_tokens": max_completion_tokens}
    if training is None:
        return Probe(points, note="contention not measured", **shape)
    with tempfile.TemporaryDirectory() as folder:
        steps_file = Path(folder) / "steps"
        load = subprocess.Popen(training.argv(steps_file))
        try:
            _wait_for_steps(load, steps_file, 3)
            # each window runs on until the load took 2 steps in it (a loaded machine steps
            # slower than the window), up to LOAD_WINDOW_MAX_S
            alone_start = time.monotonic()
            time.sleep(settings.seconds)
            alone_end = _after_two_steps(load, steps_file, alone_start)
            window = settings.seconds
            while True:
                beside = run_async(measure, settings.concurrency[-1], window)
                beside_end = time.monotonic()
                lines = steps_file.read_text().splitlines()
                start = beside_end - beside.seconds
                if (
                    _load_rate(lines, start, beside_end) is not None
                    or 2 * window > LOAD_WINDOW_MAX_S
                ):
                    break
                window *= 2
        finally:  # never left behind: terminated, else killed
            load.terminate()
            try:
                load.wait(30)
            except subprocess.TimeoutExpired:
                load.kill()
                load.wait()
    alone_s = _load_rate(lines, alone_start, alone_end)
    beside_s = _load_rate(lines, beside_end - beside.seconds, beside_end)
    if alone_s is None or beside_s is None:
        why = f"the training load took fewer than 2 steps in {LOAD_WINDOW_MAX_S:.0f} s"
        return Probe(points, note=f"contention not measured: {why}; raise [probe] seconds", **shape)
    alone = points[-1].tokens_per_s
    return Probe(
        points,
        training_slowdown=max(1.0, beside_s / alone_s),
        generation_slowdown=max(1.0, alone / max(beside.tokens_per_s, 1e-9)),
        note=(
            f"training load {alone_s:.3f} s/step alone, {beside_s:.3f} beside "
            f"{beside.concurrency} requests; the server {alone:.1f} tokens/s alone, "
            f"{beside.tokens_per_s:.1f} beside the load"
        ),
        **shape,
    )


def _after_two_steps(load: subprocess.Popen[bytes], steps_file: Path, start: float) -> float:
    """The time once the training load has ended 2 steps since ``start`` (at most
    :data:`LOAD_WINDOW_MAX_S` after it, or when the load ends)."""
    while time.monotonic() < start + LOAD_WINDOW_MAX_S and load.poll() is None:
        lines = steps_file.read_text().splitlines()
        if _load_rate(lines, start, time.monotonic()) is not None:
            break
        time.sleep(0.1)
    return time.monotonic()


def _wait_for_steps(
    load: subprocess.Popen[bytes], steps_file: Path, steps: int, timeout_s: float = 600.0
) -> None:
    """Wait until the training load has logged ``steps`` steps (raise if it ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if load.poll() is not None:
            raise ProbeError(
                f"the training load ended with exit code {load.returncode} before "
                "its first steps; its output is above"
            )
        if steps_file.exists() and len(steps_file.read_text().splitlines()) >= steps:
            return
        time.sleep(0.5)
    raise ProbeError(f"the training load took no {steps} steps in {timeout_s:.0f} s")


def runs_prompt_tokens(run_dirs: Sequence[Path]) -> int:
    """The runs' median prompt tokens (a sample's forwarded tokens less its completion)."""
    prompts = []
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").exists():
            continue
        for row in read_metrics(run_dir):
            sample, completion = (
                row.get("sample/forwarded_tokens_mean"),
                row.get("completions/mean_length"),
            )
            if sample is not None and completion is not None:
                prompts.append(sample - completion)
    if not prompts:
        raise ProbeError(
            "no run of the sweep logged sample/forwarded_tokens_mean and "
            "completions/mean_length: the probe takes the prompt length from the "
            "runs, so run at least one step first"
        )
    return max(1, round(statistics.median(prompts)))


def probe_sweep(
    settings: ProbeSettings, config: AsyncGRPOConfig, model: str, run_dirs: Sequence[Path]
) -> Path:
    """Probe the server ``config.vllm_server_base_url`` after a sweep's runs (``run_dirs``:
    they give the requests' shape), into ``config.output_dir``; the training load runs where
    the server shares this host's cores."""
    from asyncgrpo.adapters.models.causal_lm import meta_model
    from asyncgrpo.adapters.models.fsdp import precision_for
    from asyncgrpo.shell.servers import server_on_host

    url = config.server_urls[0]
    prompt_tokens = runs_prompt_tokens(run_dirs)
    longest = config.max_completion_length
    shape = meta_model(model)
    training = None
    if settings.beside_training and server_on_host(url):
        bf16 = precision_for(config.bf16, torch.device("cpu"), shape).bf16
        tokens = config.token_budget or (prompt_tokens + longest)
        training = LoadSpec(model=model, tokens=tokens, bf16=bf16, server_url=url)
    probe = probe_server(
        url,
        settings,
        prompt_tokens=prompt_tokens,
        max_completion_tokens=longest,
        num_sampler_logprobs=max(config.num_sampler_logprobs, 0),
        vocab_size=shape.config.get_text_config().vocab_size,
        headers=bearer(config.server_api_key),
        training=training,
    )
    return write_probe(config.output_path, probe)


def write_probe(out: Path, probe: Probe) -> Path:
    path = out / PROBE_FILE
    path.write_text(json.dumps(probe.as_json(), indent=1))
    log.info(
        "probe written",
        path=str(path),
        training_slowdown=round(probe.training_slowdown, 3),
        generation_slowdown=round(probe.generation_slowdown, 3),
    )
    return path
