"""Foreign weights on the vLLM server: the trainer's side of
:mod:`asyncgrpo.core.weights.parity`.

After each step the trainer hands :class:`ParityGuard` the step's mean staleness-0 log-prob gap
(``sampling/staleness0_logp_difference/mean``). Above what the trainer's and the server's dtypes
explain, the step logs a loud warning; once ``foreign_weights_steps`` of the last
``foreign_weights_window`` checked steps (steps with staleness-0 samples) were such steps, the
run fails with :class:`ForeignWeightsError`, so a second trainer whose pushes land on every
other step fails the run too. A run that trained any step on foreign weights (fewer than that)
does not end as a success either: once its model is saved it fails with the same error, naming
the steps (:meth:`ParityGuard.after_training`); ``foreign_weights_steps=0`` only warns. Every
rank decides the same (the gap is gathered over ranks and the limit is rank 0's, broadcast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from asyncgrpo.adapters.process_group import decided_on_rank0
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.core.weights import parity as weight_parity
from asyncgrpo.shell.servers import run_async

log = structlog.get_logger("asyncgrpo.foreign_weights")


class ForeignWeightsError(RuntimeError):
    """The server's log-probs at staleness 0 are not the trainer's: it serves other weights."""


class ParityGuard:
    """Counts the steps whose staleness-0 gap exceeds ``limit`` (nats); see the module doc.

    Args:
        limit: :func:`~asyncgrpo.core.weights.parity.parity_limit` of the two dtypes.
        patience: ``foreign_weights_steps`` (0 only warns).
        server_url: named in the warning and the error.
        rank0: whether this process logs.
        window: ``foreign_weights_window``.
    """

    def __init__(
        self,
        limit: float,
        patience: int,
        server_url: str,
        rank0: bool,
        window: int = weight_parity.FOREIGN_WINDOW,
    ) -> None:
        self.limit = limit
        self.patience = patience
        self.window = window
        self.server_url = server_url
        self.rank0 = rank0
        self.watch = weight_parity.ParityWatch()
        self.foreign_steps: list[int] = []  # steps trained on samples of foreign weights

    @classmethod
    def for_run(cls, learner: Any, args: Any, client: Callable[[], VLLMClient]) -> ParityGuard:
        """The guard of a run: the trainer's compute dtype against the server's (from
        ``/server_info``; a server that does not say counts as bf16), on every rank."""

        async def served_dtype() -> str | None:
            async with client() as c:
                config = await c.server_config()
            return str((config or {}).get("model_config", {}).get("dtype") or "") or None

        def limit() -> float:
            trainer_dtype = (
                "bfloat16" if learner.bf16 else str(next(learner.model.parameters()).dtype)
            )
            return weight_parity.parity_limit(trainer_dtype, run_async(served_dtype))

        return cls(
            float(decided_on_rank0(limit)),
            args.foreign_weights_steps,
            ", ".join(args.server_urls),
            learner.rank == 0,
            args.foreign_weights_checked_steps,
        )

    def check(self, gap: float | None, step: int) -> None:
        """Count one step's gap (``None``/NaN: the step had no staleness-0 tokens)."""
        self.watch, verdict = weight_parity.check_parity(
            self.watch, gap, self.limit, self.patience, self.window
        )
        if verdict is weight_parity.Verdict.OK:
            return
        self.foreign_steps.append(step)
        what = (
            f"at staleness 0 the sampler's log-probs differ from the trainer's by {gap:.3g} "
            f"nats on average (the dtypes explain up to {self.limit:.3g}), "
            f"on {self.watch.bad_in_window} of the last {len(self.watch.recent)} checked "
            f"step(s): the vLLM server at "
            f"{self.server_url} serves other weights than this trainer's (another trainer "
            "pushing to the same server, a server restarted or started on another model)"
        )
        if verdict is weight_parity.Verdict.FAIL:
            raise ForeignWeightsError(
                f"{what}. Give each trainer its own server and check --model; "
                f"foreign_weights_steps={self.patience} of foreign_weights_window={self.window} "
                "checked steps stop the run"
            )
        if self.rank0:
            log.warning(
                "FOREIGN WEIGHTS ON THE vLLM SERVER",
                detail=what,
                step=step,
                fails_after_steps=self.patience or None,
            )

    def after_training(self, trained_steps: int, output_dir: str) -> None:
        """Fail a run that finished but trained a step on foreign weights: its samples came
        from weights other than this trainer's, so its result is not this trainer's own.
        ``foreign_weights_steps=0`` only warns."""
        if not self.foreign_steps or self.patience == 0:
            return
        steps = ", ".join(str(step) for step in self.foreign_steps)
        raise ForeignWeightsError(
            f"training finished, but {len(self.foreign_steps)} of its {trained_steps} steps "
            f"(step {steps}) trained on samples from other weights than this trainer's: the "
            f"vLLM server at {self.server_url} served another trainer's or another model's "
            f"weights then. The model is saved in {output_dir}; its result is not this run's "
            "alone. Give each trainer its own server; foreign_weights_steps=0 only warns"
        )
