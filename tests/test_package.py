"""The package as users install it: every package it imports declared in pyproject.toml, the
lockfile scripts/install.sh installs holding a version of each that fits, its version and
public names visible, its inline types marked (``py.typed``)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import asyncgrpo

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCK = ROOT / "scripts" / "requirements.lock"
SOURCE_FOLDERS = ("core", "adapters", "shell", "asyncgrpo")


def declared() -> dict[str, list[Requirement]]:
    """pyproject's requirements by extra (``""``: the dependencies every install gets)."""
    groups = {"": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}
    return {extra: [Requirement(r) for r in reqs] for extra, reqs in groups.items()}


def imported_top_level_modules() -> dict[str, str]:
    """Each third-party module the package's source imports, with one file that imports it."""
    modules: dict[str, str] = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top != "asyncgrpo":
                        modules.setdefault(top, str(path.relative_to(ROOT)))
    return modules


def test_every_imported_package_is_declared() -> None:
    names = {canonicalize_name(r.name) for reqs in declared().values() for r in reqs}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {
        module: importer
        for module, importer in imported_top_level_modules().items()
        # a module of an extra that is not installed (kernels) is its own distribution's name
        if not names & {canonicalize_name(d) for d in distributions.get(module, [module])}
        and canonicalize_name(module) not in names
    }
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"


def test_every_requirement_has_a_lower_bound() -> None:
    unbounded = [
        str(r)
        for reqs in declared().values()
        for r in reqs
        if not any(s.operator in (">=", "==", "~=", ">") for s in r.specifier)
    ]
    assert not unbounded, f"give these a lower bound in pyproject.toml: {unbounded}"


def locked_versions() -> dict[str, Version]:
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", LOCK.read_text(), re.M)
    return {canonicalize_name(name): Version(version) for name, version in pins}


def test_the_lock_holds_a_fitting_version_of_every_requirement_install_sh_installs() -> None:
    """A dependency added to pyproject.toml without `bash scripts/lock.sh` fails here."""
    lock_script = (ROOT / "scripts" / "lock.sh").read_text()
    extras = re.search(r"^EXTRAS=\(([^)]*)\)", lock_script, re.M)
    assert extras is not None, "scripts/lock.sh names its extras in EXTRAS=(...)"
    locked = locked_versions()
    requirements = declared()
    misfits = [
        f"{r} (lock: {locked.get(canonicalize_name(r.name), 'none')})"
        for extra in ["", *extras.group(1).split()]
        for r in requirements[extra]
        if canonicalize_name(r.name) not in locked
        or not r.specifier.contains(locked[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not misfits, f"scripts/requirements.lock is stale, run `bash scripts/lock.sh`: {misfits}"


def test_the_lock_pins_what_the_install_asks_pip_for() -> None:
    """install.sh installs the lock's torch by pip first (the CPU build) and the rest by uv."""
    assert locked_versions()["torch"] == Version(importlib.metadata.version("torch"))
    assert "grep '^torch==' \"$LOCK\"" in (ROOT / "scripts" / "install.sh").read_text()


def test_the_version_is_the_distributions() -> None:
    assert asyncgrpo.__version__ == PROJECT["version"] == importlib.metadata.version("asyncgrpo")


def test_dir_lists_the_public_names_before_their_first_use() -> None:
    """In a fresh interpreter: the names are imported on first use, so only ``__dir__`` knows
    them before."""
    listed = subprocess.run(
        [sys.executable, "-c", "import asyncgrpo; print(' '.join(dir(asyncgrpo)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert set(asyncgrpo.__all__) | {"__version__"} <= set(listed)


def test_the_package_is_marked_as_typed() -> None:
    """PEP 561: type checkers read asyncgrpo's annotations only where ``py.typed`` is shipped."""
    assert (importlib.resources.files("asyncgrpo") / "py.typed").is_file()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["asyncgrpo"]
    assert "Typing :: Typed" in PROJECT["classifiers"]


def test_the_package_says_it_runs_on_linux() -> None:
    assert "Operating System :: POSIX :: Linux" in PROJECT["classifiers"]
    assert "runs on Linux only" in (ROOT / "README.md").read_text()
