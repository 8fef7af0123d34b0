"""README holds exactly two set-up commands, and CI runs the test one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_has_the_main_job_and_the_test_command() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert "install.sh" in commands[0] and "asyncgrpo" in commands[0]
    assert "install.sh" in commands[1] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci
