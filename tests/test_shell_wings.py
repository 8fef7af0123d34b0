"""The shell's wings (ARCHITECTURE.md, "The shell's wings"): one subpackage per subsystem,
importing each other one way, through each wing's public names only; no import loops.

Every import counts, also those inside functions and under ``TYPE_CHECKING``: a loop that only
type checkers see is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL = ROOT / "shell"
WINGS = (
    "config",
    "servers",
    "learner",
    "weights",
    "rollout",
    "run",
    "harness",
    "experiments",
    "commands",
)
"""Lowest first: a wing imports only wings before it in this order."""
PUBLIC = ROOT / "asyncgrpo"
"""The public package: above every wing, and it too imports them through their front doors."""
MAX_LEVELS = 6


def module_name(path: Path) -> str:
    """The dotted name of a module of the shell or of the public package."""
    in_shell = path.is_relative_to(SHELL)
    home, package = (SHELL, "asyncgrpo.shell") if in_shell else (PUBLIC, "asyncgrpo")
    parts = path.relative_to(home).with_suffix("").parts
    return ".".join((package, *parts)).removesuffix(".__init__")


def module_path(name: str) -> Path | None:
    parts = name.split(".")[2:]
    for candidate in (
        SHELL.joinpath(*parts).with_suffix(".py"),
        SHELL.joinpath(*parts, "__init__.py"),
    ):
        if parts and candidate.exists():
            return candidate
    return None


def wing_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["asyncgrpo", "shell"] else None


def public_names(wing: str) -> set[str]:
    """The names a wing's ``__init__`` lists in ``__all__``."""
    tree = ast.parse((SHELL / wing / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def shell_imports(path: Path, module: str | None = None) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import of a shell module in the file at ``path``, the
    module named ``module`` (default: its name under ROOT); names are empty for ``import x.y``.
    A relative import counts as the module it names, and ``from asyncgrpo.shell import run``
    (or ``from .. import run`` in a wing) as an import of the wing ``run`` itself."""
    module = module or module_name(path)
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("asyncgrpo.shell")]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                source = ".".join([*package, source] if source else package)
            if source == "asyncgrpo.shell":  # names wings: each is imported whole
                found += [(f"{source}.{a.name}", []) for a in node.names]
            elif source.startswith("asyncgrpo.shell"):
                found.append((source, [a.name for a in node.names]))
    return found


def wing_violations(path: Path, module: str | None = None) -> list[str]:
    """What a module of a wing, or of the public package, imports against the rules (the file
    at ``path``, the module named ``module``; default: its name under ROOT)."""
    module = module or module_name(path)
    public = module != "asyncgrpo.shell" and not module.startswith("asyncgrpo.shell.")
    own = "the public package" if public else wing_of(module)
    bad: list[str] = []
    for imported, names in shell_imports(path, module):
        target = wing_of(imported)
        if target is None or target == own:
            continue
        if target not in WINGS or (
            not public and (own is None or WINGS.index(target) > WINGS.index(own))
        ):
            bad.append(f"{imported}: {own} may not import {target} (order {WINGS})")
        elif imported != f"asyncgrpo.shell.{target}" or not names:
            bad.append(f"{imported}: import from the wing itself, asyncgrpo.shell.{target}")
        else:
            private = sorted(set(names) - public_names(target))
            if private:
                bad.append(f"{imported}: {private} are not in asyncgrpo.shell.{target}.__all__")
    return bad


def import_graph() -> dict[str, set[str]]:
    """Shell module -> the shell modules it imports (a name that is a submodule counts as the
    submodule, not the package's ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for path in SHELL.rglob("*.py"):
        edges: set[str] = set()
        for module, names in shell_imports(path):
            submodules = [f"{module}.{n}" for n in names if module_path(f"{module}.{n}")]
            if submodules and len(submodules) == len(names):
                edges.update(submodules)
            elif module_path(module):
                edges.add(module)
        graph[module_name(path)] = edges - {module_name(path)}
    return graph


def find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (loop := visit(nxt)):
                return loop
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (loop := visit(node)):
            return loop
    return None


def levels(graph: dict[str, set[str]], wing: str) -> int:
    """The longest chain of imports between modules of one wing (a lone module is 1)."""
    inside = {m for m in graph if wing_of(m) == wing}
    depth: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in depth:
            depth[node] = 0  # a loop (its own test) must not recurse forever
            depth[node] = 1 + max((of(n) for n in graph[node] if n in inside), default=0)
        return depth[node]

    return max((of(m) for m in inside), default=0)


SHELL_FILES = sorted(SHELL.rglob("*.py")) + sorted(PUBLIC.rglob("*.py"))


def test_every_shell_module_lives_in_a_wing() -> None:
    loose = [p.name for p in SHELL.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside a wing: {loose}"
    assert {p.name for p in SHELL.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(WINGS)


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_wings_import_one_way_through_public_names(path: Path) -> None:
    assert not wing_violations(path), f"{path.relative_to(ROOT)}: {wing_violations(path)}"


def test_the_shell_has_no_import_loops() -> None:
    loop = find_loop(import_graph())
    assert loop is None, " -> ".join(loop or [])


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_is_at_most_six_import_levels_deep(wing: str) -> None:
    assert levels(import_graph(), wing) <= MAX_LEVELS


def probe(tmp_path: Path, source: str) -> Path:
    """A module with ``source``, written under ``tmp_path`` (never into the source tree)."""
    path = tmp_path / "_probe.py"
    path.write_text(source)
    return path


def test_the_wing_checker_catches_violations(tmp_path: Path) -> None:
    assert find_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_loop({"a": {"b"}, "b": set()}) is None
    upward, private, public = (
        "asyncgrpo.shell.learner._probe_upward",
        "asyncgrpo.shell.run._probe_private",
        "asyncgrpo._probe_public",
    )
    past_the_door = probe(tmp_path, "from asyncgrpo.shell.experiments.sweep import run_sweep\n")
    assert "from the wing itself" in wing_violations(past_the_door, public)[0]
    through_it = probe(tmp_path, "from asyncgrpo.shell.experiments import run_sweep\n")
    assert wing_violations(through_it, public) == []
    path = probe(tmp_path, "from asyncgrpo.shell.run import AsyncGRPOTrainer\n")
    assert "may not import" in wing_violations(path, upward)[0]
    path = probe(tmp_path, "from asyncgrpo.shell.learner.learner import _MicroBatch\n")
    assert "from the wing itself" in wing_violations(path, private)[0]
    path = probe(tmp_path, "from asyncgrpo.shell.learner import _MicroBatch\n")
    assert "__all__" in wing_violations(path, private)[0]


def test_relative_imports_and_whole_wings_are_checked(tmp_path: Path) -> None:
    upward = "asyncgrpo.shell.learner._probe_upward"
    for source in (
        "from ..run import AsyncGRPOTrainer\n",
        "from .. import run\n",
        "from asyncgrpo.shell import run\n",
    ):
        path = probe(tmp_path, source)
        assert "learner may not import run" in wing_violations(path, upward)[0], source
    path = probe(tmp_path, "from ..config.fields import AsyncGRPOConfig\n")
    assert "from the wing itself" in wing_violations(path, upward)[0]
    path = probe(tmp_path, "from .learner import Learner\nfrom ..config import AsyncGRPOConfig\n")
    assert wing_violations(path, upward) == []


def test_pyproject_lists_every_package() -> None:
    """A package missing from pyproject's list is left out of a non-editable install."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    homes = {
        "asyncgrpo": ROOT / "asyncgrpo",
        "asyncgrpo.core": ROOT / "core",
        "asyncgrpo.adapters": ROOT / "adapters",
        "asyncgrpo.shell": SHELL,
    }
    found = set()
    for name, folder in homes.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert found == listed
