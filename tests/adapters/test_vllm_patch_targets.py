"""asyncgrpo's vLLM plugin refuses, by name, a vLLM whose patched internals are gone
(:mod:`asyncgrpo.adapters.vllm.patch_targets`), instead of serving with a patch silently
undone; the route-wide API-key patch applies only on a server given a key. In this process,
with each vLLM attribute taken away (and put back) by ``monkeypatch``; no server."""

from __future__ import annotations

import importlib
import sys
import tomllib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from asyncgrpo.adapters.transfer.plugin import (
    leave_earlier_group_on_init,
    register,
    repack_cpu_experts_on_update,
)
from asyncgrpo.adapters.vllm import patch_targets
from asyncgrpo.adapters.vllm.auth import API_KEY_ENV, PATCHED, guard_every_route
from asyncgrpo.adapters.vllm.fork_start import FORK_ENV, fork_cpu_processes
from asyncgrpo.adapters.vllm.patch_targets import (
    SUPPORTED_VLLM,
    VLLMPatchTargetMissing,
    is_supported,
)

IMPORTS_VLLM = "imports vLLM's layers in this process: 10-40 s on 2 busy cores"
MOE_METHOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
NCCL_ENGINE = "vllm.distributed.weight_transfer.nccl_engine"
AUTHENTICATE = "vllm.entrypoints.serve.middleware.authenticate"


def refused(target: str) -> AbstractContextManager[Any]:
    """The error that names ``target``, the vLLM found and the supported range."""
    import vllm

    return pytest.raises(
        VLLMPatchTargetMissing,
        match=rf"{target}.*vLLM {vllm.__version__}; asyncgrpo supports vLLM >=0\.32,<0\.33",
    )


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(FORK_ENV, raising=False)


@pytest.mark.slow(reason=IMPORTS_VLLM)
def test_a_renamed_expert_setup_is_refused_not_skipped(monkeypatch) -> None:
    """The repack left undone would serve scrambled experts after the first weight sync."""
    method = importlib.import_module(MOE_METHOD).UnquantizedFusedMoEMethod
    monkeypatch.delattr(method, "_setup_kernel")
    with refused(r"UnquantizedFusedMoEMethod\._setup_kernel"):
        repack_cpu_experts_on_update()


@pytest.mark.slow(reason=IMPORTS_VLLM)
def test_a_renamed_nccl_engine_method_is_refused(monkeypatch) -> None:
    engine = importlib.import_module(NCCL_ENGINE).NCCLWeightTransferEngine
    monkeypatch.delattr(engine, "init_transfer_engine")
    with refused(r"NCCLWeightTransferEngine\.init_transfer_engine"):
        leave_earlier_group_on_init()


@pytest.mark.slow(reason=IMPORTS_VLLM)
def test_a_moved_factory_module_fails_the_plugin(monkeypatch, no_key) -> None:
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", None)
    with refused(r"weight_transfer\.factory\.WeightTransferEngineFactory\.register_engine"):
        register()


@pytest.mark.slow(reason=IMPORTS_VLLM)
def test_the_cpu_fork_patch_is_checked_only_where_asked(monkeypatch, no_key) -> None:
    platform = importlib.import_module("vllm.platforms.cpu").CpuPlatform
    monkeypatch.delattr(platform, "check_and_update_config")
    fork_cpu_processes()  # not asked: vLLM left as it is
    monkeypatch.setenv(FORK_ENV, "1")
    with refused(r"CpuPlatform\.check_and_update_config"):
        fork_cpu_processes()


@pytest.mark.slow(reason=IMPORTS_VLLM)
def test_the_route_wide_key_check_applies_only_on_a_keyed_server(monkeypatch, no_key) -> None:
    authenticate = importlib.import_module(AUTHENTICATE)
    original = authenticate.AuthenticationMiddleware
    # put back after the test whatever guard_every_route puts in its place
    monkeypatch.setattr(authenticate, "AuthenticationMiddleware", original)

    guard_every_route(["vllm", "serve", "m"])
    assert authenticate.AuthenticationMiddleware is original

    guard_every_route(["vllm", "serve", "m", "--api-key", "k"])
    guarded = authenticate.AuthenticationMiddleware
    assert getattr(guarded, PATCHED, False) and issubclass(guarded, original)
    guard_every_route(["vllm", "serve", "m", "--api-key", "k"])  # idempotent
    assert authenticate.AuthenticationMiddleware is guarded

    monkeypatch.setattr(authenticate, "AuthenticationMiddleware", original)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    guard_every_route(["vllm", "serve", "m"])
    assert getattr(authenticate.AuthenticationMiddleware, PATCHED, False)


@pytest.mark.slow(reason=IMPORTS_VLLM)
def test_a_keyed_server_refuses_a_vllm_without_the_key_middleware(monkeypatch, no_key) -> None:
    authenticate = importlib.import_module(AUTHENTICATE)
    monkeypatch.delattr(authenticate, "AuthenticationMiddleware")
    guard_every_route(["vllm", "serve", "m"])  # no key: nothing to patch, nothing refused
    monkeypatch.setenv(API_KEY_ENV, "k")
    with refused(r"authenticate\.AuthenticationMiddleware"):
        guard_every_route(["vllm", "serve", "m"])


@pytest.mark.slow(reason=IMPORTS_VLLM)
def test_a_vllm_outside_the_range_is_warned_about(monkeypatch) -> None:
    import vllm

    patch_targets.warn_if_unsupported.cache_clear()
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    try:
        with pytest.warns(RuntimeWarning, match=r"vLLM >=0\.32,<0\.33, this is vLLM 0\.33\.0"):
            patch_targets.warn_if_unsupported()
    finally:
        patch_targets.warn_if_unsupported.cache_clear()


def test_the_supported_range_is_the_gpu_extras() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    gpu = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["gpu"]]
    assert [r.specifier for r in gpu if r.name == "vllm"] == [SUPPORTED_VLLM]
    assert [is_supported(v) for v in ("0.32.0", "0.32.3+cpu", "0.32.1.dev4", "0.31.9")] == [
        True,
        True,
        True,
        False,
    ]
    assert not is_supported("0.33.0") and not is_supported("dev")
