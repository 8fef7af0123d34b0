"""asyncgrpo's vLLM plugin (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in each of its processes. It registers the ``asyncgrpo_gloo``
weight-transfer backend (:mod:`asyncgrpo.adapters.gloo_transfer`) by module path, so nothing is
imported until a server is started with ``--weight-transfer-config '{"backend":
"asyncgrpo_gloo"}'``.
"""

from __future__ import annotations

from contextlib import suppress

from asyncgrpo.core.weight_sync import GLOO

MODULE = "asyncgrpo.adapters.gloo_transfer"


def register() -> None:
    """Register the backend with vLLM's worker and trainer factories (idempotent; a vLLM
    without weight-transfer engines is left alone)."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return
    for factory, engine in (
        (WeightTransferEngineFactory, "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine"),
    ):
        with suppress(ValueError):  # already registered in this process
            factory.register_engine(GLOO, MODULE, engine)
