"""The rollout process: the rollout loop (:mod:`.loop`), when it starts a group and where
(:mod:`.admission`), a group's rollouts (:mod:`.groups`) and what the current task works for
(:mod:`.context`), tools and environments (:mod:`.tools`), group scoring (:mod:`.scoring`),
evaluations (:mod:`.evaluation`), what it is doing (:mod:`.heartbeat`), prompt rows
(:mod:`.prompts`), the messages to the trainer (:mod:`.messages`) and the forked process that
runs the loop (:mod:`.process`, the trainer's side; :mod:`.child`, the child's; :mod:`.spec`,
what is sent into it).
"""

from __future__ import annotations

from asyncgrpo.shell.rollout import context
from asyncgrpo.shell.rollout.evaluation import evaluate_now
from asyncgrpo.shell.rollout.loop import AsyncRolloutLoop, root_cause
from asyncgrpo.shell.rollout.messages import EvalOutcome, GroupOutcome, LoopReport
from asyncgrpo.shell.rollout.process import RolloutProcess
from asyncgrpo.shell.rollout.prompts import (
    PROMPT_FIX,
    PromptRows,
    check_conversational,
    check_row,
)
from asyncgrpo.shell.rollout.spec import LoopSpec, RolloutWorkerError

__all__ = [
    "PROMPT_FIX",
    "AsyncRolloutLoop",
    "EvalOutcome",
    "GroupOutcome",
    "LoopReport",
    "LoopSpec",
    "PromptRows",
    "RolloutProcess",
    "RolloutWorkerError",
    "check_conversational",
    "check_row",
    "context",
    "evaluate_now",
    "root_cause",
]
