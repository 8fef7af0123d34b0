"""How the trainer's weights reach the vLLM server: the sync paths (disk reload, the
weight-transfer engines, LoRA adapters; :mod:`.paths`), the push (:mod:`.push`) and the check
that the server serves the trainer's weights (:mod:`.parity`).
"""

from __future__ import annotations

from asyncgrpo.shell.weights.parity import ParityGuard
from asyncgrpo.shell.weights.paths import WeightSync, open_weight_sync
from asyncgrpo.shell.weights.push import Pushed, Resynced, WeightPusher

__all__ = [
    "ParityGuard",
    "Pushed",
    "Resynced",
    "WeightPusher",
    "WeightSync",
    "open_weight_sync",
]
