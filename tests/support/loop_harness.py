"""Run an AsyncRolloutLoop in-process and collect what it publishes."""

from __future__ import annotations

import time

import anyio
import attrs

from asyncgrpo.shell.rollout import GroupOutcome, LoopReport


@attrs.define
class LocalChannels:
    """In-process channels: the trainer side is the test. ``consume`` plays a trainer that
    takes every sample as soon as it is published, one step per group."""

    stop_after: int
    consume: bool = True
    outcomes: list[GroupOutcome] = attrs.field(factory=list)
    reports: list[LoopReport] = attrs.field(factory=list)
    version: int = 0
    step_tokens: float | None = None
    taken: int = 0
    in_flight: int = 0
    beats: int = 0
    activity: str = ""
    moved: anyio.Event | None = None

    def publish(self, message) -> None:
        if isinstance(message, LoopReport):
            self.reports.append(message)
            return
        self.outcomes.append(message)
        if self.consume and message.samples:
            self.taken += message.forwarded_tokens
            self.step_tokens = float(message.forwarded_tokens)
            self.version += 1
        if self.moved is not None:
            self.moved.set()  # the trainer's side changed

    def model_version(self) -> int:
        return self.version

    def tokens_per_step(self) -> float | None:
        return self.step_tokens

    def tokens_taken(self) -> int:
        return self.taken

    def steps_taken(self) -> int:
        return self.version  # each step's weights are published as it is taken

    def report_in_flight(self, in_flight) -> None:
        self.in_flight = in_flight.groups

    def beat(self, activity: str = "") -> None:
        self.beats += 1
        self.activity = activity

    def stop_requested(self) -> bool:
        return len(self.outcomes) >= self.stop_after

    async def wait_for_trainer(self) -> None:
        self.moved = anyio.Event()
        await self.moved.wait()


def run_loop(loop, timeout_s: float = 240.0) -> float:
    """Run ``loop`` until its channels ask to stop; returns the seconds it took."""
    start = time.monotonic()

    async def main() -> None:
        with anyio.fail_after(timeout_s):
            await loop.run()

    anyio.run(main)
    return time.monotonic() - start


def recorded_rollouts(loop) -> list:
    """The rollouts ``loop.generate_one`` returns from now on, in the order they finish (the
    hook is wrapped on this instance)."""
    recorded = []
    original = loop.generate_one

    async def recording(prompt, tools, group_id=0):
        rollout = await original(prompt, tools, group_id)
        recorded.append(rollout)
        return rollout

    loop.generate_one = recording
    return recorded
