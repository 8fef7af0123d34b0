"""Every training script the README and docs/ print keeps the trainer under
``if __name__ == "__main__":``: the rollout process imports the main script, and a trainer
built or trained at its top level would be built again there (asyncgrpo refuses that with an
error naming the guard: tests/shell/test_unguarded_script.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def python_blocks(page: Path) -> list[str]:
    return PYTHON_BLOCK.findall(page.read_text())


def is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (
        isinstance(node.test.ops[0], ast.Eq)
        and any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides)
        and any(isinstance(side, ast.Constant) and side.value == "__main__" for side in sides)
    )


def trainer_calls(tree: ast.AST) -> list[ast.Call]:
    """``SomethingTrainer(...)`` and ``<name containing "trainer">.train(...)`` calls."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        builds = isinstance(function, ast.Name) and function.id.endswith("Trainer")
        trains = (
            isinstance(function, ast.Attribute)
            and function.attr == "train"
            and isinstance(function.value, ast.Name)
            and "trainer" in function.value.id.lower()
        )
        if builds or trains:
            found.append(node)
    return found


def unguarded_trainer_calls(source: str) -> list[str]:
    """The trainer calls of a script that run when it is imported (outside every
    ``if __name__ == "__main__":`` block, function and class), as source text."""
    tree = ast.parse(source)
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if is_main_guard(node) or isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
        ):
            guarded.update(id(call) for call in trainer_calls(node))
    return [
        ast.get_source_segment(source, call) or ast.dump(call)
        for call in trainer_calls(tree)
        if id(call) not in guarded
    ]


def training_scripts() -> list[tuple[str, str]]:
    """(page and block number, source) of every python block that trains a trainer."""
    return [
        (f"{page.relative_to(ROOT)}#{number}", block)
        for page in PAGES
        for number, block in enumerate(python_blocks(page))
        if re.search(r"trainer\w*\.train\(", block, re.I)
    ]


def test_the_pages_print_training_scripts() -> None:
    names = {name.split("#")[0] for name, _ in training_scripts()}
    assert {"README.md", "docs/evaluation.md", "docs/scaling.md"} <= names, names


@pytest.mark.parametrize(("where", "source"), training_scripts(), ids=lambda value: value)
def test_a_printed_training_script_builds_and_trains_under_the_main_guard(
    where: str, source: str
) -> None:
    try:
        unguarded = unguarded_trainer_calls(source)
    except SyntaxError as error:
        pytest.fail(f"{where}: the script does not parse ({error}); print it whole and valid")
    assert not unguarded, (
        f'{where}: {unguarded} run at the top level; put them under `if __name__ == "__main__":`'
    )


@pytest.mark.parametrize(
    ("source", "unguarded"),
    [
        ("trainer = AsyncGRPOTrainer(m)\ntrainer.train()\n", 2),
        ('if __name__ == "__main__":\n    trainer = AsyncGRPOTrainer(m)\n    trainer.train()\n', 0),
        ("def main():\n    AsyncGRPOTrainer(m).train()\nmain()\n", 0),
        ('if __name__ != "__main__":\n    trainer.train()\n', 1),  # not the guard
        (
            "trainer = HarnessAsyncGRPOTrainer(m)\nif __name__ == '__main__':\n    trainer.train()",
            1,
        ),
    ],
)
def test_the_check_finds_top_level_trainer_calls(source: str, unguarded: int) -> None:
    assert len(unguarded_trainer_calls(source)) == unguarded
