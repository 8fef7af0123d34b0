"""The sampling settings of one generation request, as the config's generation fields give
them, and the fields every request sends (``/v1/completions`` and the token endpoint alike)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class SamplingParams:
    """The sampling settings of one request (the config's generation fields).

    ``top_k=0`` and ``top_p=1.0`` keep the full vocabulary; ``num_sampler_logprobs`` top
    log-probs are returned per token (0 for none). Training needs a stochastic sampler
    (``temperature > 0``); an evaluation may be greedy (``greedy_allowed``: ``temperature`` 0).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    num_sampler_logprobs: int = 8
    greedy_allowed: bool = False

    def __attrs_post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_completion_length must be >= 1")
        if self.greedy_allowed:
            if self.temperature < 0:
                raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        elif self.temperature <= 0:
            raise ValueError(
                "temperature must be > 0 (the importance ratio needs a stochastic sampler)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def request_fields(self, seed: int) -> dict[str, Any]:
        """The sampling fields of one request, every one explicit, the same for
        ``/v1/completions`` and the token endpoint (one completion, no penalties beyond
        ``repetition_penalty``, no special tokens skipped)."""
        return {
            "n": 1,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": int(seed),
            "skip_special_tokens": False,
        }
