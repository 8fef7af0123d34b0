"""The network of ``benchmarks/chaos.py``: a fault-injecting proxy between the trainer (and its
rollout process) and each server, the link faults it injects, and how soon the trainer showed
that it noticed a fault.

Each server is reached only through its own :class:`FaultProxy` (``tests/support/fault_proxy.py``,
on loopback): the trainer is given the proxies' URLs. A server restarted on its port is behind
its proxy again at once. The weights themselves never cross a proxy: the gloo engine's data
connections go from the server's workers to the trainer directly; its control calls
(``/pause``, ``/start_weight_update``, ``/update_weights``, ..., ``/resume``) and every
generation, ``/health`` and ``/metrics`` call do.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

# the network tests' proxy, kept beside them; a benchmark run as a script finds it on this path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from fault_proxy import FaultProxy

LINK_FAULTS = (
    "link_latency",
    "link_reset",
    "link_truncate",
    "link_black_hole_short",
    "link_black_hole_long",
    "link_capped",
)
STRUCK_AS = {
    "link_latency": "latency",
    "link_reset": "reset",
    "link_truncate": "truncate",
    "link_black_hole_short": "black_hole",
    "link_black_hole_long": "black_hole",
    "link_capped": "capped",
}
"""The :attr:`FaultProxy.struck` counter of each link fault."""
GENERATE = "POST /v1/completions"
PUSH_STARTS = "POST /pause"  # the first call of every weight push
RESET_AFTER_BYTES = 100
TRUNCATE_AFTER_BYTES = 300  # past a /health or a /pause reply, inside a generation's
POLL_S = 0.5
TAIL_BYTES = 256 * 1024  # of metrics.jsonl, enough for the rows of the last few steps
SERVER_SIGNS = re.compile(
    r"out of routing|unreachable|restarted \(its identity|has not answered|"
    r"ServerGone|ServerNotAnswering|ResponsesCut|WeightSendTimeout|"
    r"failed after \d+ retries|could not leave"
)
"""Log lines by which the trainer or its rollout process show that a server (named in the
line) went away, fell silent or cut its replies."""
ROLLOUT_SIGNS = re.compile(r"the rollout process died")
COUNTED_SIGNS = ("rollout/vllm_dropped_connection_count", "rollout/vllm_retry_count")
TIMESTAMP = re.compile(r"^(\d{4}-\d\d-\d\d)([T ])(\d\d:\d\d:\d\d(?:\.\d+)?)Z?\s")
"""A log line's time: ISO in UTC (the trainer's, ``...T...Z``), or local to the second (the
rollout process's structlog default, ``YYYY-MM-DD HH:MM:SS``)."""


def add_options(parser: argparse.ArgumentParser) -> None:
    """The link faults' settings."""
    parser.add_argument(
        "--link-fault-s",
        type=float,
        default=30.0,
        help="seconds a timed link fault lasts (latency, truncation, the cap)",
    )
    parser.add_argument(
        "--latency-s",
        type=float,
        default=3.0,
        help="seconds added inside every reply during link_latency",
    )
    parser.add_argument(
        "--cut-replies", type=int, default=5, help="replies reset (after 100 bytes) by link_reset"
    )
    parser.add_argument(
        "--hole-short-s",
        type=float,
        default=5.0,
        help="link_black_hole_short: below vllm_server_stall_timeout (10 s)",
    )
    parser.add_argument(
        "--hole-long-s",
        type=float,
        default=30.0,
        help="link_black_hole_long: above vllm_server_stall_timeout (10 s), "
        "below vllm_server_timeout (180 s)",
    )
    parser.add_argument(
        "--cap-bytes-per-s",
        type=float,
        default=4000.0,
        help="the link's bandwidth each way during link_capped",
    )


class Links:
    """One :class:`FaultProxy` per server port, up for the whole run."""

    def __init__(self, ports: list[int]) -> None:
        self.proxies = [FaultProxy(port) for port in ports]

    def start(self) -> None:
        for proxy in self.proxies:
            proxy.start()

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()

    def urls(self) -> list[str]:
        return [proxy.url for proxy in self.proxies]

    def forget_requests(self) -> None:
        """Drop the request lines the proxies noted so far (they are read from one injection
        on, and would grow for the whole run)."""
        for proxy in self.proxies:
            proxy.requests_seen.clear()


def strike(proxy: FaultProxy, kind: str, options: argparse.Namespace) -> float:
    """Arm the link fault ``kind`` on ``proxy``; the seconds until it is lifted (for
    ``link_reset``: the longest wait for its replies to be cut)."""
    if kind == "link_latency":
        proxy.add_latency(options.latency_s)
    elif kind == "link_reset":
        proxy.reset_after(RESET_AFTER_BYTES, times=options.cut_replies)
    elif kind == "link_truncate":
        proxy.truncate_after(TRUNCATE_AFTER_BYTES, requests=GENERATE, times=None)
    elif kind == "link_black_hole_short":
        proxy.black_hole(options.hole_short_s)
        return options.hole_short_s
    elif kind == "link_black_hole_long":
        proxy.black_hole(options.hole_long_s)
        return options.hole_long_s
    elif kind == "link_capped":
        proxy.cap_bandwidth(options.cap_bytes_per_s)
    else:
        raise ValueError(f"strike: no link fault {kind!r}; one of {', '.join(LINK_FAULTS)}")
    return options.link_fault_s


def struck(proxy: FaultProxy, kind: str) -> int:
    return proxy.struck[STRUCK_AS[kind]]


def what_struck(proxy: FaultProxy, kind: str, times: int, options: argparse.Namespace) -> str:
    """A note of what the fault did: how many replies (chunks, for a hole or a cap) it struck,
    and for the cap, the weight pushes that crossed it."""
    if kind == "link_capped":
        pushes = sum(line.startswith(PUSH_STARTS) for _, line in proxy.requests_seen)
        return (
            f"{times} chunks slowed to {options.cap_bytes_per_s:g} B/s, {pushes} weight "
            "pushes began under the cap"
        )
    unit = "chunks held" if kind.startswith("link_black_hole") else "replies struck"
    return f"{times} {unit}"


def logged_at(line: str) -> float:
    """When ``line`` was logged (``time.time()``), or now if it carries no time."""
    stamp = TIMESTAMP.match(line)
    if stamp is None:
        return time.time()
    when = datetime.datetime.fromisoformat(f"{stamp[1]}T{stamp[3]}")  # naive: local time
    if stamp[2] == "T":
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


class Noticed:
    """Watches, every ``POLL_S`` seconds from its start (a fault's injection) until
    :meth:`stop`, for the first sign that the trainer or its rollout process noticed the
    fault, and keeps the seconds to it (:attr:`seconds`, ``None`` while none) and what it was
    (:attr:`sign`):

    * a line of the trainer's log (timestamped) that names the fault's server (``url``) and
      says it went away, fell silent or cut its replies (``SERVER_SIGNS``), or, with
      ``rollout`` set, that the rollout process died;
    * a ``GET /health`` through the server's proxy (a probe of a silent server, or the wait
      for one that went away: nothing else asks for ``/health``);
    * a metrics row, of a step after the injection, that counts a reply sent again on a new
      connection or a retry (timed when this sees the row: up to a step late);
    * the trainer's exit.

    ``run`` is the chaos script's :class:`Run` (its log, metrics and trainer)."""

    def __init__(
        self, run: Any, url: str | None, proxy: FaultProxy | None, rollout: bool = False
    ) -> None:
        self.run, self.url, self.proxy, self.rollout = run, url, proxy, rollout
        self.started, self.started_wall = time.monotonic(), time.time()
        self.seconds: float | None = None
        self.sign = ""
        self._step = run.last_step()
        self._incarnation = run.incarnations
        self._offset = self._log_size()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="noticed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _log_size(self) -> int:
        path = self.run.out / f"trainer-{self.run.incarnations}.log"
        return path.stat().st_size if path.exists() else 0

    def _found(self, seconds: float, sign: str) -> None:
        self.seconds, self.sign = max(0.0, seconds), sign[:160]

    def _watch(self) -> None:
        while self.seconds is None and not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                self._look()
            if self.seconds is None and self.run.trainer_exited() is not None:
                self._found(time.monotonic() - self.started, "the trainer exited")
            self._stop.wait(POLL_S)

    def _look(self) -> None:
        """Take the earliest sign of those that appeared since the last look."""
        signs: list[tuple[float, str]] = []
        for line in self._new_log_lines():
            if self._names_it(line):
                at = logged_at(line)
                if at >= self.started_wall - 1.0:
                    signs.append((at - self.started_wall, f"logged: {line.strip()}"))
                    break
        if self.proxy is not None:
            probes = [
                at
                for at, request in list(self.proxy.requests_seen)
                if at >= self.started and request.startswith("GET /health")
            ]
            if probes:
                signs.append((probes[0] - self.started, "probed /health"))
        if self.url is not None and not signs:  # a row is timed late: only when nothing else
            for row in self._rows_after():
                counted = [key for key in COUNTED_SIGNS if (row.get(key) or 0) > 0]
                if counted:
                    signs.append(
                        (
                            time.monotonic() - self.started,
                            f"step {row['step']} counted {counted[0]}",
                        )
                    )
                    break
        if signs:
            self._found(*min(signs))

    def _names_it(self, line: str) -> bool:
        if self.rollout:
            return bool(ROLLOUT_SIGNS.search(line))
        if self.url is None or not SERVER_SIGNS.search(line):
            return False
        return re.search(re.escape(self.url) + r"(?!\d)", line) is not None  # not :80 in :8000

    def _new_log_lines(self) -> list[str]:
        """Lines the trainer logged since the last look (a new incarnation's from its start)."""
        if self.run.incarnations != self._incarnation:
            self._incarnation, self._offset = self.run.incarnations, 0
        path = self.run.out / f"trainer-{self._incarnation}.log"
        with path.open("rb") as log:
            log.seek(self._offset)
            text = log.read()
        whole = text.rfind(b"\n") + 1  # a line still being written waits for the next look
        self._offset += whole
        return text[:whole].decode(errors="replace").splitlines()

    def _rows_after(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl after the injection's step, from the file's tail."""
        path = self.run.run_dir / "metrics.jsonl"
        with path.open("rb") as metrics:
            start = max(0, path.stat().st_size - TAIL_BYTES)
            metrics.seek(start)
            lines = metrics.read().decode(errors="replace").splitlines()[1 if start else 0 :]
        rows = []
        for line in lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if int(row.get("step", 0)) > self._step:
                    rows.append(row)
        return rows
