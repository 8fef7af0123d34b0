"""The dependency rule of ARCHITECTURE.md: core does no I/O and knows nothing of the shell;
adapters never import the shell."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CORE_ALLOWED_THIRD_PARTY = {"attrs", "numpy", "torch"}
CORE_FORBIDDEN_STDLIB = {
    "asyncio",
    "socket",
    "subprocess",
    "multiprocessing",
    "threading",
    "concurrent",
    "os",
    "shutil",
    "io",
    "pathlib",
    "time",
    "random",
    "urllib",
    "http",
    "logging",
    "tempfile",
    "signal",
    "select",
    "selectors",
    "ssl",
    "sqlite3",
    "pickle",
}
TORCH_FORBIDDEN = ("torch.distributed", "torch.multiprocessing", "torch.cuda", "torch.utils.data")


HOMES = {"core": "asyncgrpo.core", "adapters": "asyncgrpo.adapters"}
"""The folders checked here and the package each one is (pyproject's package-dir)."""


def module_name(path: Path) -> str:
    """The dotted name of a module of core/ or adapters/ (a package's is its ``__init__``'s)."""
    top, *inside = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((HOMES[top], *inside)).removesuffix(".__init__")


def imported_modules(path: Path, module: str | None = None) -> list[str]:
    """The modules that the file at ``path``, the module named ``module`` (default: its name
    under ROOT), imports. A relative import counts as the module it names: ``from ..x import
    y`` as ``<package two up>.x``, ``from .. import y`` as ``<package two up>.y``; one that
    climbs above the top-level package stays relative (a leading dot), a violation."""
    module = module or module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            if node.level > len(package):
                names.append("." * node.level + (node.module or ""))
                continue
            base = ".".join(package[: len(package) - node.level + 1])
            if node.module:
                names.append(f"{base}.{node.module}")
            else:
                names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def core_violation(module: str) -> str | None:
    top = module.split(".")[0]
    if module.startswith("."):
        return "a relative import above the top-level package"
    if module.startswith("asyncgrpo."):
        return None if module.startswith("asyncgrpo.core") else "imports the shell or adapters"
    if top == "asyncgrpo":
        return "imports the public package (which pulls in the shell)"
    if top in CORE_FORBIDDEN_STDLIB:
        return "does I/O, keeps time or owns processes"
    if module.startswith(TORCH_FORBIDDEN):
        return "uses a torch subsystem with side effects"
    if top in CORE_ALLOWED_THIRD_PARTY:
        return None
    import sys

    if top in sys.stdlib_module_names or top == "__future__":
        return None
    return "imports a third-party package outside attrs/numpy/torch"


CORE_FILES = sorted((ROOT / "core").rglob("*.py"))
ADAPTER_FILES = sorted((ROOT / "adapters").rglob("*.py"))


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_imports_nothing_that_does_io(path: Path) -> None:
    bad = [(m, why) for m in imported_modules(path) if (why := core_violation(m))]
    assert not bad, f"{path.relative_to(ROOT)}: {bad}"


@pytest.mark.parametrize("path", ADAPTER_FILES, ids=lambda p: p.name)
def test_adapters_never_import_the_shell(path: Path) -> None:
    bad = [
        m
        for m in imported_modules(path)
        if m.startswith(("asyncgrpo.shell", "asyncgrpo"))
        and not m.startswith(("asyncgrpo.core", "asyncgrpo.adapters"))
    ]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_rule_checker_catches_violations() -> None:
    assert core_violation("httpx") is not None
    assert core_violation("anyio") is not None
    assert core_violation("transformers") is not None
    assert core_violation("torch.distributed") is not None
    assert core_violation("subprocess") is not None
    assert core_violation("asyncgrpo.shell.commands.cli") is not None
    assert core_violation("asyncgrpo.adapters.vllm.client") is not None
    assert core_violation("numpy") is None
    assert core_violation("asyncgrpo.core.records") is None
    assert core_violation("collections.abc") is None


# The sub-packages of core and adapters, lowest first: a module imports only its own package,
# the shared modules at the root ("") and packages before its own. Core's mirror the shell's
# wings they serve (ARCHITECTURE.md, "The wings").
PACKAGE_ORDER = {
    "core": ("", "packing", "loss", "rollout", "run", "servers", "weights", "experiments"),
    "adapters": ("", "vllm", "transfer", "kernels", "models"),
}


def package_of(top: str, dotted: str) -> str | None:
    """The sub-package of ``asyncgrpo.<top>`` that the module ``dotted`` lives in ("" for the
    root's modules); None outside ``asyncgrpo.<top>``."""
    parts = dotted.split(".")
    if parts[:2] != ["asyncgrpo", top]:
        return None
    if len(parts) > 2 and (ROOT / top / parts[2]).is_dir():
        return parts[2]
    return ""


def order_violations(top: str, path: Path, module: str | None = None) -> list[str]:
    """What the file at ``path``, the module named ``module`` (default: its name under ROOT)
    of ``asyncgrpo.<top>``, imports against :data:`PACKAGE_ORDER`."""
    module = module or module_name(path)
    own = package_of(top, module)
    order = PACKAGE_ORDER[top]
    bad = []
    for imported in imported_modules(path, module):
        target = package_of(top, imported)
        if target is None or target == own:
            continue
        if target not in order or own not in order or order.index(target) > order.index(own):
            bad.append(f"{imported}: {own or 'the root'} may not import {target} (order {order})")
    return bad


@pytest.mark.parametrize("path", CORE_FILES + ADAPTER_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_and_adapter_packages_import_one_way(path: Path) -> None:
    top = path.relative_to(ROOT).parts[0]
    assert not order_violations(top, path), order_violations(top, path)


def test_every_sub_package_has_a_place_in_the_order() -> None:
    for top, order in PACKAGE_ORDER.items():
        found = {p.name for p in (ROOT / top).iterdir() if (p / "__init__.py").exists()}
        assert found == set(order) - {""}, top


def probe(tmp_path: Path, source: str, filename: str = "_probe.py") -> Path:
    """A module with ``source``, written under ``tmp_path`` (never into the source tree)."""
    path = tmp_path / filename
    path.write_text(source)
    return path


def test_the_order_checker_catches_violations(tmp_path: Path) -> None:
    upward = "asyncgrpo.core.packing._probe_upward"
    path = probe(tmp_path, "from asyncgrpo.core.rollout.pacing import ServerLoad\n")
    assert "packing may not import rollout" in order_violations("core", path, upward)[0]
    path = probe(tmp_path, "from asyncgrpo.core.records import TrainingSample\n")
    assert order_violations("core", path, upward) == []


def test_relative_imports_count_as_what_they_name(tmp_path: Path) -> None:
    """``from ..x import y`` inside asyncgrpo.core is checked as an import of what it names."""
    pacing = "asyncgrpo.core.rollout._probe_relative"
    upward = probe(tmp_path, "from ..run.step_queue import StepQueue\n")
    assert imported_modules(upward, pacing) == ["asyncgrpo.core.run.step_queue"]
    assert "rollout may not import run" in order_violations("core", upward, pacing)[0]
    named = probe(tmp_path, "from .. import run, records\n")
    assert imported_modules(named, pacing) == ["asyncgrpo.core.run", "asyncgrpo.core.records"]
    assert "rollout may not import run" in order_violations("core", named, pacing)[0]
    outside = probe(tmp_path, "from ...shell.run import AsyncGRPOTrainer\nfrom . import cursor\n")
    found = imported_modules(outside, pacing)
    assert found == ["asyncgrpo.shell.run", "asyncgrpo.core.rollout.cursor"]
    assert [core_violation(m) for m in found] == ["imports the shell or adapters", None]
    package = probe(tmp_path, "from .pacing import ServerLoad\n", "__init__.py")
    assert imported_modules(package, "asyncgrpo.core.rollout") == ["asyncgrpo.core.rollout.pacing"]
    above = probe(tmp_path, "from .... import anything\n")
    assert [core_violation(m) for m in imported_modules(above, pacing)] == [
        "a relative import above the top-level package"
    ]


def test_module_names_follow_the_package_dir() -> None:
    assert module_name(ROOT / "core" / "records.py") == "asyncgrpo.core.records"
    assert module_name(ROOT / "core" / "rollout" / "__init__.py") == "asyncgrpo.core.rollout"
    assert module_name(ROOT / "adapters" / "vllm" / "client.py") == "asyncgrpo.adapters.vllm.client"
