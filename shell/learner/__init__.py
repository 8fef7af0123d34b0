"""The learner: the trained model, its optimizer and FSDP2 sharding on one process
(:mod:`.learner`), the packed forward and loss of a step, weight export (:mod:`.export`), the
optimizer and schedule (:mod:`.optimization`) and the learner's checkpoint (:mod:`.checkpoint`).
"""

from __future__ import annotations

from asyncgrpo.shell.learner.checkpoint import check_learner_files
from asyncgrpo.shell.learner.export import LoraPrecisionError
from asyncgrpo.shell.learner.failures import DivergedError, RowOutOfMemoryError
from asyncgrpo.shell.learner.learner import Learner, StepOutput

__all__ = [
    "DivergedError",
    "Learner",
    "LoraPrecisionError",
    "RowOutOfMemoryError",
    "StepOutput",
    "check_learner_files",
]
