"""Whether the vLLM servers of one run can stand in for each other: a pure comparison of what
each offers.

A run with several servers routes any group to any of them and pushes one policy to all, so
each must serve the same model name and length, weights of the same dtype (else the
staleness-0 log-prob gap differs by server), return the same log-probs (``--logprobs-mode``,
``--max-logprobs``, ``--generation-config``), offer the same candidate sets under top-k/top-p
(``--return-sampling-mask``, ``--enable-scale-out``), the same weight-transfer engine and the
same LoRA serving. The trainer reads a :class:`ServerFlags` from each server at start (the
adapter reads ``/v1/models`` and ``/server_info``) and :func:`check_servers` names the first
server and flag that differ from the first server's.

Example:
    >>> a = ServerFlags(models=("m",), max_model_len=1024, dtype="torch.float32")
    >>> b = attrs.evolve(a, dtype="torch.bfloat16")
    >>> [m.flag for m in mismatches(a, b)]
    ['--dtype']
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

FLAGS: dict[str, str] = {
    "max_model_len": "--max-model-len",
    "described": "VLLM_SERVER_DEV_MODE=1 (its /server_info)",
    "dtype": "--dtype",
    "logprobs_mode": "--logprobs-mode",
    "max_logprobs": "--max-logprobs",
    "generation_config": "--generation-config",
    "sampling_mask": "--return-sampling-mask",
    "token_endpoint": "--enable-scale-out",
    "weight_transfer": "--weight-transfer-config",
    "lora": "--enable-lora",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
}
"""Each compared field and the ``vllm serve`` flag (or setting) that decides it. The names a
server serves are not compared (LoRA adapters loaded at run time come and go); each server
must serve the run's model (:func:`check_servers`)."""


@attrs.frozen
class ServerFlags:
    """What one server offers that the run relies on (``None``: the server does not say).

    Attributes:
        models: the names it serves (``/v1/models``): the model, and any adapters loaded.
        max_model_len: the run's model's ``max_model_len`` there.
        described: whether it answers ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``); the
            fields below come from it.
        dtype, logprobs_mode, max_logprobs, generation_config, sampling_mask: its
            ``model_config`` entries.
        token_endpoint: whether it serves the token endpoint (``--enable-scale-out``); only
            read when the run asks for candidate sets.
        weight_transfer: its ``--weight-transfer-config`` backend.
        lora, max_loras, max_lora_rank: whether it serves LoRA adapters, and its limits.
    """

    models: tuple[str, ...]
    max_model_len: int | None = None
    described: bool = True
    dtype: str | None = None
    logprobs_mode: str | None = None
    max_logprobs: int | None = None
    generation_config: str | None = None
    sampling_mask: bool | None = None
    token_endpoint: bool | None = None
    weight_transfer: str | None = None
    lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None


@attrs.frozen
class Mismatch:
    """One flag in which a server differs from the reference server."""

    flag: str
    expected: object
    found: object


def mismatches(reference: ServerFlags, other: ServerFlags) -> tuple[Mismatch, ...]:
    """Every flag in which ``other`` differs from ``reference``, in :data:`FLAGS` order."""
    return tuple(
        Mismatch(flag, getattr(reference, name), getattr(other, name))
        for name, flag in FLAGS.items()
        if getattr(reference, name) != getattr(other, name)
    )


class ServerMismatch(ValueError):
    """A server of the run cannot stand in for the first one."""


def check_servers(urls: Sequence[str], flags: Sequence[ServerFlags], model: str) -> None:
    """Raise :class:`ServerMismatch` naming the first server that does not serve ``model`` or
    differs from the first server in a flag (and the flag, both values and every other flag
    that differs); return when all can stand in for each other.

    Example:
        >>> a = ServerFlags(models=("m",), max_model_len=1024)
        >>> check_servers(["http://a", "http://b"], [a, a], "m")
        >>> check_servers(["http://a", "http://b"], [a, attrs.evolve(a, lora=True)], "m")
        Traceback (most recent call last):
        ...
        asyncgrpo.core.servers.match.ServerMismatch: the vLLM server at http://b differs from \
the one at http://a in --enable-lora: True (http://a: False); every server of a run must be \
started with the same model and flags
    """
    if len(urls) != len(flags):
        raise ValueError(f"check_servers: {len(urls)} URLs but {len(flags)} flag sets")
    for url, found in zip(urls, flags, strict=True):
        if model not in found.models:
            raise ServerMismatch(
                f"the vLLM server at {url} does not serve model {model!r} (it serves "
                f"{list(found.models)}); start every server of the run with the same model and "
                f"--served-model-name"
            )
    reference = flags[0]
    for url, found in zip(urls[1:], flags[1:], strict=True):
        differ = mismatches(reference, found)
        if not differ:
            continue
        first = differ[0]
        also = "".join(
            f"; also {m.flag}: {m.found!r} ({urls[0]}: {m.expected!r})" for m in differ[1:]
        )
        raise ServerMismatch(
            f"the vLLM server at {url} differs from the one at {urls[0]} in {first.flag}: "
            f"{first.found!r} ({urls[0]}: {first.expected!r}){also}; every server of a run "
            "must be started with the same model and flags"
        )
