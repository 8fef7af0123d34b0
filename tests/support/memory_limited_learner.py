"""A learner under an address-space limit (``RLIMIT_AS``), run in its own process by
``tests/shell/test_learner_failures.py``: it trains a small row, saves a checkpoint and the
weights it holds, then limits its own memory to what it maps now plus ``MARGIN_MIB``, trains the
small row again (it fits) and then a row of ``LONG_ROW_TOKENS`` tokens in one sample (it does
not: its dense attention alone keeps heads x T x T values per layer, about 3 GiB more at its
peak, measured without the limit). It writes what happened as JSON to ``OUT/result.json``.

    python tests/support/memory_limited_learner.py MODEL OUT
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from on_policy import on_policy
from packing_strategies import make_sample

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner, RowOutOfMemoryError

MARGIN_MIB = 1024
"""Room left above what the process maps once it has trained the small row: the small row
needs none of it again; the long row needs about 3 GiB more (measured: 3.2 GiB at its peak)."""
LONG_ROW_TOKENS = 8192
PROMPT = [11, 12, 13, 14, 15]


def mapped_bytes() -> int:
    """The process's virtual memory now (``VmSize``), what ``RLIMIT_AS`` caps."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(model: str, out: Path) -> None:
    torch.set_num_threads(1)
    config = AsyncGRPOConfig(
        output_dir=str(out),
        learning_rate=1e-2,
        seed=0,
        token_budget=LONG_ROW_TOKENS,
        gradient_checkpointing=False,
        loss_type="clipped_surrogate",
    )
    stock = load_causal_lm(model)
    small = pack_row([on_policy(stock, make_sample([*PROMPT, 21, 22, 23], [0] * 5 + [1] * 3), 4)])
    tokens = [(7 * i) % 900 + 5 for i in range(LONG_ROW_TOKENS)]
    long = pack_row([make_sample(tokens, [0] * 8 + [1] * (LONG_ROW_TOKENS - 8))])
    learner = Learner(stock, config)
    learner.train_step([small])
    learner.save_checkpoint(out / "checkpoint-1")
    torch.save(learner.export.full_state_dict(), out / "weights-1.pt")
    limit = mapped_bytes() + MARGIN_MIB * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))  # the soft limit: raised again below
    result: dict[str, object] = {"limit_mib": limit // 2**20}
    learner.train_step([small])
    result["small_row_fits"] = True
    started = time.monotonic()
    try:
        learner.train_step([long])
    except RowOutOfMemoryError as error:
        result["error"] = str(error)
        result["cause"] = type(error.__cause__).__name__
        result["detected_s"] = round(time.monotonic() - started, 2)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    result["grads_released"] = all(p.grad is None for p in learner.model.parameters())
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
