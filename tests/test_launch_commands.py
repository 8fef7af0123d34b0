"""Every launch command in the docs gives each GPU role its own devices.

The commands are read from every markdown file under ``docs/`` and ``README.md``: each line of
a shell code block (``bash``, ``sh``, ``shell``, ``console``, ``zsh``), the containers of a
``yaml`` block (Kubernetes), and, in a section that holds a GPU recipe, the inline code spans
of its prose that are commands (docs/gpu.md's "or `torchrun --nproc_per_node=N`" was one).

A **launch** is a command whose program, after ``VAR=value`` prefixes and the wrappers
``env``, ``exec``, ``nohup``, ``time``, ``flock FILE``, ``taskset [-c] CPUS``, ``numactl
--opts``, ``srun --opts`` and ``bash -c '...'``, is a server (``vllm serve``, ``python -m
vllm.entrypoints.openai.api_server``) or a trainer (``torchrun``, ``python -m
torch.distributed.run``, ``python SCRIPT.py``, ``asyncgrpo train|demo|eval|sweep``). A
command that mentions one of these but is not understood fails the test: the rule is never
skipped silently.

A **GPU recipe** is a markdown section (heading to heading) with a code-block launch that names
GPUs: ``CUDA_VISIBLE_DEVICES`` set non-empty, ``torchrun``, an ``nccl`` weight-transfer
config, or GPUs given by a scheduler (``srun``/``#SBATCH`` ``--gpus-per-node``,
``--gres=gpu:K``, ``--gpus``; a container's ``nvidia.com/gpu`` limit). In a GPU recipe:

1. every launch states its devices: ``CUDA_VISIBLE_DEVICES=<integers>`` (on the command, or
   ``export``-ed earlier in its block; empty for a launch meant for the CPU), or a
   scheduler's GPU count;
2. on one host, the servers' and the trainers' device sets are disjoint, and servers' device
   sets are disjoint from each other. Launches in a section share one host, except that a
   code block that starts with ``#!`` (a script, run wherever it is started) is a host of
   its own, and a comment ``# host: NAME`` in a block puts the commands after it on host
   NAME (blocks naming the same NAME share it); every ``srun`` step and every container is a
   host of its own (the scheduler numbers its devices);
3. ``torchrun``'s ``--nproc_per_node`` equals the devices it sees per node, or, where a
   scheduler gives a total (``--gpus``), times ``--nnodes`` equals it; a single-process
   trainer sees exactly one device (it trains on ``cuda:LOCAL_RANK``, LOCAL_RANK 0);
4. a server sees tensor x pipeline x data parallel size devices.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCKS = {"bash", "sh", "shell", "console", "zsh"}
YAML_BLOCKS = {"yaml", "yml"}
MENTIONS = re.compile(
    r"\bvllm\s+serve\b|vllm\.entrypoints|\btorchrun\b|torch\.distributed\.run|"
    r"\basyncgrpo\s+(?:train|demo|eval|sweep)\b|\bpython3?\s+\S+\.py\b"
)
CONTROL = {"&&", "||", ";", "|", "&", ";;", "(", ")", "|&"}
TRAINER_COMMANDS = {"train", "demo", "eval", "sweep"}
OTHER_COMMANDS = {"plot", "simulate", "compare", "plan"}
OTHER_PYTHON_MODULES = {"pytest", "pip", "venv"}
SRUN_VALUED_SHORT = {"-N", "-n", "-w", "-c", "-G", "-J", "-o", "-e", "-p", "-t", "-A"}


class UnrecognisedLaunch(ValueError):
    """A command mentions a server or trainer launch in a form this test does not read."""


@dataclass
class Launch:
    """One server or trainer launch and the devices it is given.

    ``devices``: the ``CUDA_VISIBLE_DEVICES`` entries (``()`` when set empty: the CPU),
    ``None`` when unset. ``per_node`` / ``total``: GPUs a scheduler gives (per node, or for
    the whole step). ``host``: the scope its device numbers live in."""

    where: str
    role: str
    argv: list[str]
    devices: tuple[str, ...] | None = None
    per_node: int | None = None
    total: int | None = None
    host: str = "local"
    inline: bool = False

    @property
    def is_torchrun(self) -> bool:
        return Path(self.argv[0]).name == "torchrun" or self.argv[1:3] == [
            "-m",
            "torch.distributed.run",
        ]

    @property
    def names_gpus(self) -> bool:
        """It says it runs on GPUs: devices given, torchrun, or an NCCL weight transfer."""
        nccl = self.role == "server" and "nccl" in option(self.argv, "--weight-transfer-config", "")
        return (
            bool(self.devices)
            or self.per_node is not None
            or self.total is not None
            or (self.is_torchrun or nccl)
        )


@dataclass
class Scheduler:
    """GPUs an ``srun`` step (or the ``#SBATCH`` header) asks for."""

    per_node: int | None = None
    total: int | None = None
    tasks_per_node: int = 1
    per_task: int | None = None
    nodes: str | None = None

    def update(self, options: dict[str, str]) -> Scheduler:
        new = Scheduler(self.per_node, self.total, self.tasks_per_node, self.per_task, self.nodes)
        for key, value in options.items():
            if key == "--gpus-per-node":
                new.per_node = count(value)
            elif key == "--gres" and value.startswith("gpu"):
                new.per_node = count(value.rsplit(":", 1)[-1]) if ":" in value else 1
            elif key in ("--gpus", "-G"):
                new.total = count(value)
            elif key == "--gpus-per-task":
                new.per_task = count(value)
            elif key == "--ntasks-per-node":
                new.tasks_per_node = count(value)
            elif key in ("-w", "--nodelist", "--relative", "-r"):
                new.nodes = value
        if new.per_task is not None:
            new.per_node = new.per_task * new.tasks_per_node
        return new


def count(value: str) -> int:
    """The number in a scheduler's GPU option (``4``, ``h100:4``)."""
    return int(value.rsplit(":", 1)[-1])


def option(argv: list[str], name: str, default: Any = None, short: str | None = None) -> Any:
    """The value of ``--name=V`` / ``--name V`` (also with ``_`` and ``-`` swapped) in argv."""
    names = {name, name.replace("_", "-"), name.replace("-", "_").replace("__", "--")}
    names |= {short} if short else set()
    for i, word in enumerate(argv):
        key, eq, value = word.partition("=")
        if key in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else default)
    return default


# --- reading the markdown ------------------------------------------------------------------


@dataclass
class Block:
    language: str
    text: str
    line: int


@dataclass
class Section:
    """A markdown section: heading to heading."""

    path: str
    line: int
    blocks: list[Block] = field(default_factory=list)
    prose: list[str] = field(default_factory=list)


def sections(text: str, path: str) -> list[Section]:
    found = [Section(path, 1)]
    fence: str | None = None
    block: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence, language, block, start = stripped[:3], stripped[3:].strip().lower(), [], number
        elif fence is not None and stripped.startswith(fence):
            found[-1].blocks.append(Block(language, "\n".join(block), start + 1))
            fence = None
        elif fence is not None:
            block.append(line)
        elif line.startswith("#"):
            found.append(Section(path, number))
        else:
            found[-1].prose.append(line)
    return found


# --- reading shell commands ----------------------------------------------------------------


def logical_lines(text: str, first_line: int) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined; a console's ``$ `` prompt dropped."""
    lines: list[tuple[int, str]] = []
    pending, start = "", first_line
    for number, line in enumerate(text.splitlines(), first_line):
        if not pending:
            start = number
            line = line[2:] if line.startswith("$ ") else line
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at ``&&``, ``;``, ``|``, ``&``)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in CONTROL:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_launches(
    text: str,
    first_line: int,
    path: str,
    env: dict[str, str] | None = None,
    host: str = "local",
    scheduler: Scheduler | None = None,
) -> list[Launch]:
    """Every launch in a shell block (see the module docstring); raises
    :class:`UnrecognisedLaunch` for a command that mentions a launch it cannot read."""
    env = dict(env or {})
    scheduler = scheduler or Scheduler()
    launches = []
    for number, line in logical_lines(text, first_line):
        where = f"{path}:{number}"
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            scheduler = scheduler.update(slurm_options(shlex.split(stripped)[1:]))
            continue
        if re.match(r"#\s*host:\s*\S", stripped):
            host = stripped.split(":", 1)[1].strip()
            continue
        try:
            commands = simple_commands(line)
        except ValueError as error:
            if MENTIONS.search(line):
                raise UnrecognisedLaunch(f"{where}: cannot split {line!r}: {error}") from error
            continue
        for argv in commands:
            if argv[0] == "export" or all(ASSIGNMENT.match(word) for word in argv):
                env.update(a.split("=", 1) for a in argv if ASSIGNMENT.match(a))
                continue
            launches += command_launches(argv, where, env, host, scheduler)
    return launches


def command_launches(
    argv: list[str], where: str, env: dict[str, str], host: str, scheduler: Scheduler
) -> list[Launch]:
    """The launch of one simple command (none, or several through ``bash -c``)."""
    env, words, i = dict(env), argv, 0
    while i < len(words):
        word, name = words[i], Path(words[i]).name
        if word.startswith("$") and word.strip("${}") in env:  # a command in a variable
            words = [*words[:i], *shlex.split(env[word.strip("${}")]), *words[i + 1 :]]
        elif ASSIGNMENT.match(word):
            key, value = word.split("=", 1)
            env[key] = value
            i += 1
        elif name in ("env", "exec", "nohup", "time"):
            i += 1
        elif name == "flock":
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1
            i += 1  # the lock file
        elif name == "taskset":
            i += 2 if i + 1 < len(words) and words[i + 1].startswith("-") else 1
            i += 1  # the CPU list or mask
        elif name == "numactl":
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1
        elif name == "srun":
            options, i = srun_options(words, i + 1)
            scheduler = scheduler.update(options)
            host = f"srun step {where} {scheduler.nodes or ''}".strip()
        elif name in ("bash", "sh") and words[i + 1 : i + 2] == ["-c"]:
            return shell_launches(
                words[i + 2],
                int(where.rsplit(":", 1)[1]),
                where.rsplit(":", 1)[0],
                env,
                host,
                scheduler,
            )
        else:
            break
    rest = words[i:]
    role = launch_role(rest, where)
    if role is None:
        if MENTIONS.search(" ".join(argv)):
            raise UnrecognisedLaunch(
                f"{where}: {shlex.join(argv)!r} mentions a server or "
                "trainer launch in a form this test does not "
                "read"
            )
        return []
    devices = env.get("CUDA_VISIBLE_DEVICES")
    launch = Launch(
        where,
        role,
        rest,
        None if devices is None else tuple(d.strip() for d in devices.split(",") if d.strip()),
        scheduler.per_node,
        scheduler.total,
        host,
    )
    return [launch]


def launch_role(argv: list[str], where: str) -> str | None:
    """``"server"``, ``"trainer"`` or None (not a launch) for a program and its arguments."""
    if not argv:
        return None
    program, rest = Path(argv[0]).name, argv[1:]
    if program == "vllm":
        if rest[:1] == ["serve"]:
            return "server"
        raise UnrecognisedLaunch(f"{where}: vllm {' '.join(rest[:1])} is not `vllm serve`")
    if program == "torchrun":
        return "trainer"
    if program in ("asyncgrpo",):
        if rest[:1] and rest[0] in TRAINER_COMMANDS:
            return "trainer"
        if rest[:1] and rest[0] in OTHER_COMMANDS:
            return None
        raise UnrecognisedLaunch(f"{where}: asyncgrpo {' '.join(rest[:1])}: not a known command")
    if re.fullmatch(r"python(3(\.\d+)?)?", program):
        if rest[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
            return "server"
        if rest[:2] == ["-m", "torch.distributed.run"]:
            return "trainer"
        if rest[:1] == ["-m"] and len(rest) > 1 and rest[1] in OTHER_PYTHON_MODULES:
            return None
        if rest[:1] == ["-c"]:
            return None
        if rest[:1] == ["-m"]:
            raise UnrecognisedLaunch(f"{where}: python -m {rest[1:2]}: not a known module")
        if rest and rest[0].endswith(".py"):
            return "trainer"
    return None


def srun_options(words: list[str], i: int) -> tuple[dict[str, str], int]:
    """srun's options from ``words[i:]`` and the index of its program."""
    options: dict[str, str] = {}
    while i < len(words) and words[i].startswith("-"):
        key, eq, value = words[i].partition("=")
        if eq:
            options[key] = value
        elif key in SRUN_VALUED_SHORT and i + 1 < len(words):
            options[key] = words[i + 1]
            i += 1
        else:
            options[key] = ""
        i += 1
    return options, i


def slurm_options(words: list[str]) -> dict[str, str]:
    return srun_options(words, 0)[0]


# --- reading Kubernetes containers ---------------------------------------------------------


def yaml_launches(text: str, first_line: int, path: str) -> list[Launch]:
    """The launches of every container in a yaml block; each container is its own host."""
    where = f"{path}:{first_line}"
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as error:
        if MENTIONS.search(text):
            raise UnrecognisedLaunch(f"{where}: yaml that does not parse: {error}") from error
        return []
    launches = []
    for container in containers(documents):
        argv = [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]
        env = {
            str(e["name"]): str(e.get("value", ""))
            for e in container.get("env") or []
            if "name" in e
        }
        limits = (container.get("resources") or {}).get("limits") or {}
        gpus = limits.get("nvidia.com/gpu")
        scheduler = Scheduler(per_node=None if gpus is None else int(gpus))
        host = f"container {container.get('name', '?')} at {where}"
        for launch in command_launches(argv, where, env, host, scheduler) if argv else []:
            launches.append(launch)
    return launches


def containers(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        own = [node] if "image" in node and ("command" in node or "args" in node) else []
        return own + [c for value in node.values() for c in containers(value)]
    if isinstance(node, list):
        return [c for value in node for c in containers(value)]
    return []


# --- the rules -----------------------------------------------------------------------------


def section_launches(section: Section) -> tuple[list[Launch], list[Launch]]:
    """(the code blocks' launches, the prose's inline command spans that are launches)."""
    blocks: list[Launch] = []
    for block in section.blocks:
        if block.language in SHELL_BLOCKS:
            script = block.text.startswith("#!")  # a script file: run where it is started
            host = f"script at {section.path}:{block.line}" if script else "local"
            blocks += shell_launches(block.text, block.line, section.path, host=host)
        elif block.language in YAML_BLOCKS:
            blocks += yaml_launches(block.text, block.line, section.path)
        elif not block.language and readable_launches(block, section.path):
            raise UnrecognisedLaunch(
                f"{section.path}:{block.line}: a launch in a code block with no language; "
                "mark it bash (or yaml)"
            )
    inline = []
    prose = " ".join(section.prose)
    for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose):
        try:
            found = [
                launch
                for argv in simple_commands(span)
                for launch in command_launches(
                    argv, f"{section.path}:{section.line}", {}, "local", Scheduler()
                )
            ]
        except (ValueError, IndexError):
            continue  # prose: a span that is not a command
        for launch in found:
            words = (
                3
                if launch.argv[:2] in (["vllm", "serve"],)
                or (Path(launch.argv[0]).name == "asyncgrpo")
                else 2
            )
            if len(launch.argv) >= words or launch.devices is not None:
                launch.inline = True
                inline.append(launch)
    return blocks, inline


def readable_launches(block: Block, path: str) -> list[Launch]:
    """The launches of an unmarked block read as shell; none where it is not shell (output,
    a diagram)."""
    try:
        return shell_launches(block.text, block.line, path)
    except ValueError:
        return []


def problems_of(section: Section) -> list[str]:
    """What breaks the rules of the module docstring in one section."""
    blocks, inline = section_launches(section)
    if not any(launch.names_gpus for launch in blocks):
        return []
    launches = blocks + inline
    problems = []
    for launch in launches:
        text = f"{launch.where}: {'inline ' if launch.inline else ''}{shlex.join(launch.argv)!r}"
        stated = (
            launch.devices is not None or launch.per_node is not None or (launch.total is not None)
        )
        if not stated:
            problems.append(
                f"{text}: a {launch.role} in a GPU recipe without "
                "CUDA_VISIBLE_DEVICES (nor a scheduler's GPU count)"
            )
            continue
        if launch.devices and not all(d.isdigit() for d in launch.devices):
            problems.append(
                f"{text}: CUDA_VISIBLE_DEVICES={','.join(launch.devices)} is not "
                "a list of device numbers"
            )
            continue
        problems += count_problems(launch, text)
    problems += overlap_problems([launch for launch in launches if launch.devices])
    return problems


def seen_devices(launch: Launch) -> int | None:
    """Devices the launch sees per node."""
    if launch.devices is not None:
        return len(launch.devices)
    return launch.per_node


def count_problems(launch: Launch, text: str) -> list[str]:
    seen = seen_devices(launch)
    if launch.devices == ():
        return []  # meant for the CPU
    if launch.devices and launch.per_node is not None:
        beyond = [d for d in launch.devices if int(d) >= launch.per_node]
        if beyond:
            return [
                f"{text}: CUDA_VISIBLE_DEVICES names device(s) {','.join(beyond)}, but the "
                f"scheduler gives {launch.per_node} GPUs (numbered from 0)"
            ]
    argv = launch.argv
    if launch.is_torchrun:
        nproc = option(argv, "--nproc_per_node")
        if nproc in ("gpu", "auto"):
            return []
        if nproc is None or not nproc.isdigit():
            return [f"{text}: torchrun needs --nproc_per_node as a number, got {nproc!r}"]
        nnodes = int(str(option(argv, "--nnodes", "1")).rsplit(":", 1)[-1])
        if seen is None and launch.total is not None:
            if int(nproc) * nnodes != launch.total:
                return [
                    f"{text}: --nproc_per_node {nproc} x --nnodes {nnodes} processes, but "
                    f"the scheduler gives {launch.total} GPUs"
                ]
            return []
        if seen is not None and int(nproc) != seen:
            return [
                f"{text}: --nproc_per_node {nproc} processes, but {seen} visible devices "
                "per node (one each: rank i trains on visible device i)"
            ]
        return []
    if launch.role == "trainer" and seen is not None and seen != 1:
        return [
            f"{text}: a single-process trainer sees {seen} devices; it trains on the first "
            "(cuda:LOCAL_RANK, LOCAL_RANK 0): give it one"
        ]
    if launch.role == "server" and seen is not None:
        kinds = (("tensor", "-tp"), ("pipeline", "-pp"), ("data", "-dp"))
        sizes = [int(option(argv, f"--{kind}-parallel-size", "1", short)) for kind, short in kinds]
        wanted = sizes[0] * sizes[1] * sizes[2]
        if wanted != seen:
            return [
                f"{text}: the server sees {seen} devices but runs tensor x pipeline x data "
                f"parallel = {wanted} workers"
            ]
    return []


def overlap_problems(launches: list[Launch]) -> list[str]:
    problems = []
    for i, first in enumerate(launches):
        for second in launches[i + 1 :]:
            if first.host != second.host or "server" not in (first.role, second.role):
                continue
            shared = set(first.devices or ()) & set(second.devices or ())
            if shared:
                problems.append(
                    f"{first.where} ({first.role}) and {second.where} ({second.role}) share "
                    f"GPU(s) {','.join(sorted(shared))} on host {first.host!r}: NCCL refuses two "
                    "ranks on one device and the server's memory is taken; give each its own"
                )
    return problems


def doc_files() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def problems_in(text: str, path: str) -> list[str]:
    return [p for section in sections(text, path) for p in problems_of(section)]


# --- the tests -----------------------------------------------------------------------------


def test_every_gpu_recipe_in_the_docs_gives_each_role_its_own_devices() -> None:
    problems = [
        p
        for path in doc_files()
        for p in problems_in(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not problems, "\n".join(problems)


def test_the_docs_hold_gpu_recipes_for_one_trainer_gpu_and_for_torchrun() -> None:
    """The rule above must have something to hold: docs/gpu.md's recipes are read."""
    gpu = ROOT / "docs" / "gpu.md"
    launches = [
        launch
        for section in sections(gpu.read_text(), "docs/gpu.md")
        for part in section_launches(section)
        for launch in part
    ]
    roles = {(launch.role, Path(launch.argv[0]).name) for launch in launches if launch.devices}
    assert ("server", "vllm") in roles
    assert ("trainer", "torchrun") in roles
    assert any(
        launch.role == "trainer"
        and launch.devices
        and len(launch.devices) == 1
        and Path(launch.argv[0]).name.startswith("python")
        for launch in launches
    )


RECIPE_OF_2026_12_04 = """# Running on GPUs

```bash
CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-0.6B --host 127.0.0.1 \\
    --weight-transfer-config '{"backend": "nccl"}' \\
    --max-model-len 4096
```

and the trainer on GPU 1, or on several GPUs with `torchrun --nproc_per_node=N`:

```bash
CUDA_VISIBLE_DEVICES=1 python train.py
```
"""


def test_the_recipe_of_2026_12_04_fails_on_its_torchrun() -> None:
    problems = problems_in(RECIPE_OF_2026_12_04, "gpu.md")
    assert len(problems) == 1 and "torchrun --nproc_per_node=N" in problems[0], problems


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ("CUDA_VISIBLE_DEVICES=0 vllm serve m\nCUDA_VISIBLE_DEVICES=1 python train.py", None),
        (
            "CUDA_VISIBLE_DEVICES=0 vllm serve m\nCUDA_VISIBLE_DEVICES=0,1 torchrun "
            "--nproc_per_node=2 train.py",
            "share GPU(s) 0",
        ),
        (
            "CUDA_VISIBLE_DEVICES=0 vllm serve m\nCUDA_VISIBLE_DEVICES=1,2,3 torchrun "
            "--nproc_per_node=4 train.py",
            "--nproc_per_node 4 processes, but 3",
        ),
        (
            "CUDA_VISIBLE_DEVICES=0 vllm serve m\ntorchrun --nproc_per_node 2 train.py",
            "without CUDA_VISIBLE_DEVICES",
        ),
        ("export CUDA_VISIBLE_DEVICES=1,2\ntorchrun \\\n  --nproc-per-node 2 train.py", None),
        (
            "CUDA_VISIBLE_DEVICES=0 vllm serve m\nCUDA_VISIBLE_DEVICES=1,2 python train.py",
            "single-process trainer sees 2",
        ),
        (
            "CUDA_VISIBLE_DEVICES=0,1 vllm serve m --tensor-parallel-size 2\n"
            "CUDA_VISIBLE_DEVICES=2 python train.py",
            None,
        ),
        ("CUDA_VISIBLE_DEVICES=0 vllm serve m -tp 2", "tensor x pipeline x data"),
        ("CUDA_VISIBLE_DEVICES=$GPU vllm serve m", "not a list of device numbers"),
        (
            "# host: server-node\nCUDA_VISIBLE_DEVICES=0 vllm serve m\n# host: trainer-node\n"
            "CUDA_VISIBLE_DEVICES=0 python train.py",
            None,
        ),
        ("CUDA_VISIBLE_DEVICES=0 vllm serve m\nCUDA_VISIBLE_DEVICES= python train.py", None),
        (
            "#!/bin/bash\nCUDA_VISIBLE_DEVICES=0 vllm serve m &\n"
            "CUDA_VISIBLE_DEVICES=0 vllm serve m",
            "share GPU(s) 0",
        ),
        (
            "#SBATCH --nodes=2\n#SBATCH --gpus-per-node=8\n"
            "srun -N 1 -w node0 bash -c 'CUDA_VISIBLE_DEVICES=0,1 vllm serve m -dp 2' &\n"
            "srun -N 1 -w node1 torchrun --nnodes=1 --nproc_per_node=8 train.py",
            None,
        ),
        (
            "srun --nodes=2 --gpus-per-node=4 torchrun --nnodes=2 --nproc_per_node=8 train.py",
            "--nproc_per_node 8 processes, but 4",
        ),
        ("srun --nodes=2 --gpus=8 torchrun --nnodes=2 --nproc_per_node=4 train.py", None),
        (
            "srun --gpus-per-node=2 bash -c 'CUDA_VISIBLE_DEVICES=1,2 torchrun --nproc_per_node=2 "
            "t.py'",
            "names device(s) 2, but the scheduler gives 2",
        ),
        ("ssh node0 'CUDA_VISIBLE_DEVICES=0 vllm serve m'", UnrecognisedLaunch),
        ("CUDA_VISIBLE_DEVICES=0 vllm bench m", UnrecognisedLaunch),
        ("CUDA_VISIBLE_DEVICES=0 python -m mypkg.serve", UnrecognisedLaunch),
    ],
)
def test_the_rules_on_small_recipes(recipe: str, expected: str | type | None) -> None:
    text = f"# recipe\n\n```bash\n{recipe}\n```\n"
    if isinstance(expected, type):
        with pytest.raises(expected):
            problems_in(text, "x.md")
        return
    problems = problems_in(text, "x.md")
    if expected is None:
        assert not problems, problems
    else:
        assert any(expected in p for p in problems), problems


KUBERNETES = """# Kubernetes

```yaml
apiVersion: v1
kind: Pod
metadata: {name: trainer}
spec:
  containers:
    - name: trainer
      image: asyncgrpo
      command: ["torchrun", "--nproc_per_node=NPROC", "train.py"]
      resources: {limits: {"nvidia.com/gpu": 4}}
---
apiVersion: v1
kind: Pod
metadata: {name: server}
spec:
  containers:
    - name: server
      image: vllm
      command: ["bash", "-c"]
      args: ["vllm serve m --weight-transfer-config '{\\"backend\\": \\"nccl\\"}'"]
      resources: {limits: {"nvidia.com/gpu": SERVER_GPUS}}
```
"""


@pytest.mark.parametrize(
    ("nproc", "server_gpus", "expected"),
    [
        (4, 1, None),
        (8, 1, "--nproc_per_node 8 processes, but 4"),
        (4, 2, "tensor x pipeline x data"),
    ],
)
def test_the_rules_on_kubernetes_containers(
    nproc: int, server_gpus: int, expected: str | None
) -> None:
    problems = problems_in(
        KUBERNETES.replace("NPROC", str(nproc)).replace("SERVER_GPUS", str(server_gpus)), "k8s.md"
    )
    if expected is None:
        assert not problems, problems
    else:
        assert any(expected in p for p in problems), problems


SCRIPTS = """# Slurm

```bash
#!/bin/bash
# serve.sh, on the server node
CUDA_VISIBLE_DEVICES=0,1 vllm serve m --tensor-parallel-size 2
```

```bash
#!/bin/bash
# train.sh, on each trainer node
CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nnodes=2 --nproc_per_node=4 train.py
```

```bash
CUDA_VISIBLE_DEVICES=0 python train.py
```
"""


def test_a_script_block_is_a_host_of_its_own_and_plain_blocks_share_one() -> None:
    assert problems_in(SCRIPTS, "x.md") == []
    plain = SCRIPTS.replace("#!/bin/bash\n# serve.sh", "# serve.sh")  # now beside the trainer
    assert any("share GPU(s) 0" in p for p in problems_in(plain, "x.md"))
