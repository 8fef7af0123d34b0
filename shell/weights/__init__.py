"""How the trainer's weights reach the vLLM server: the sync paths (disk reload and the
weight-transfer engines, :mod:`.paths`; LoRA adapters, :mod:`.lora_path`), the choice among
them (:mod:`.choice`), the push (:mod:`.push`; beside the step, by :mod:`.push_thread`) and
the check that the server serves the trainer's weights (:mod:`.parity`).
"""

from __future__ import annotations

from asyncgrpo.shell.weights.choice import open_weight_sync
from asyncgrpo.shell.weights.parity import ParityGuard
from asyncgrpo.shell.weights.paths import WeightSync
from asyncgrpo.shell.weights.push import Pushed, Resynced, WeightPusher

__all__ = [
    "ParityGuard",
    "Pushed",
    "Resynced",
    "WeightPusher",
    "WeightSync",
    "open_weight_sync",
]
