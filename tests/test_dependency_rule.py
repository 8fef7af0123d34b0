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


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append("." * node.level + (node.module or ""))
    return names


def core_violation(module: str) -> str | None:
    top = module.split(".")[0]
    if module.startswith("."):
        return None
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
