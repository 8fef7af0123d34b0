"""A vLLM logits processor that holds a request before each token until the test allows it:
the one way to act at a known token of an in-flight request.

On this machine the engine can generate a whole 1,000-token request before the API server
has streamed its first token, so a client that acts on what it sees is always late. A request
that carries ``vllm_xargs={"token_gate": "<file>"}`` samples its ``n``-th token only once
``<file>`` holds a number >= ``n`` (the test writes it with :func:`allow`); other requests
are not touched. The logits are returned unchanged, so log-probs are the model's.

The server loads it with ``--logits-processors token_gate:TokenGate`` and this directory on
its ``PYTHONPATH``. A gate not opened within ``GIVE_UP_S`` lets the token through, so a
test that died cannot freeze the server.
"""

import os
import time
from pathlib import Path

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

GIVE_UP_S = 120.0
POLL_S = 0.001


def allow(gate: Path, tokens: int) -> None:
    """Let the gated request sample up to ``tokens`` tokens (written atomically)."""
    partial = gate.with_suffix(".partial")
    partial.write_text(str(tokens))
    os.replace(partial, gate)


def allowed(gate: str) -> int:
    try:
        return int(Path(gate).read_text())
    except (FileNotFoundError, ValueError):
        return 0


class TokenGate(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.gated: dict[int, tuple[str, list[int]]] = {}  # batch index -> (gate, output ids)

    def is_argmax_invariant(self) -> bool:
        return False  # greedy requests must wait at the gate too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.gated.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            gate = (params.extra_args or {}).get("token_gate")
            if gate:
                self.gated[index] = (gate, output_ids)
            else:
                self.gated.pop(index, None)
        for a, b, direction in batch_update.moved:
            moved_a, moved_b = self.gated.pop(a, None), self.gated.pop(b, None)
            if moved_a is not None:
                self.gated[b] = moved_a
            if moved_b is not None and direction == MoveDirectionality.SWAP:
                self.gated[a] = moved_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for gate, output_ids in self.gated.values():
            deadline = time.monotonic() + GIVE_UP_S
            while allowed(gate) < len(output_ids) + 1 and time.monotonic() < deadline:
                time.sleep(POLL_S)
        return logits
