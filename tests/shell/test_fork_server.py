"""The rollout process is forked by a fork server the trainer's Python process starts once
(``multiprocessing``'s ``forkserver``, with transformers and the rollout loop imported ahead):
a child forked after the trainer changed its environment, ``sys.path`` or working directory
sees the trainer's as they are now, not as they were when the fork server started (the
environment only because the rollout process adopts it); and the child and the fork server end
when the trainer is killed outright.

The "trainer" is a small Python process that starts the children and prints what they saw;
every wait is bounded, and what is left is killed in ``finally``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
from processes import alive_after, described, kill_all

WAIT_S = 120  # the fork server's imports on a loaded 2-core machine; the checks do not depend on it

TRAINER = """
import json, os, sys, time
from asyncgrpo.shell.rollout.child import CONTEXT
from fork_server_children import report, wait_for_the_trainer

answers = CONTEXT.Queue()

def run(target, *args):
    CONTEXT.Process(target=target, args=(answers, *args), daemon=True).start()
    return answers.get(timeout=120)

seen = {"before": run(report, None)}
os.environ["ASYNCGRPO_FORK_MARK"] = "set after the fork server started"
sys.path.append(sys.argv[1])
os.chdir(sys.argv[1])
seen["not_passed"] = run(report, None)
seen["passed"] = run(report, dict(os.environ))
seen["waiting"] = run(wait_for_the_trainer, os.getpid())
print(json.dumps(seen), flush=True)
time.sleep(600)
"""


def test_a_forked_rollout_process_sees_the_trainer_as_it_is_now_and_dies_with_it(tmp_path):
    (tmp_path / "marked_module.py").write_text("")
    support = str(Path(__file__).parents[1] / "support")
    environment = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, (support, os.environ.get("PYTHONPATH"))))
    }
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path)],
        env=environment,
        stdout=subprocess.PIPE,
        text=True,
    )
    run = [psutil.Process(trainer.pid)]
    try:
        line = trainer.stdout.readline()
        assert line, f"the trainer exited with {trainer.wait(WAIT_S)}"
        seen = json.loads(line)
        run = [run[0], *run[0].children(recursive=True)]
        fork_server = psutil.Process(seen["waiting"]["parent"])
        assert fork_server.ppid() == trainer.pid  # the children's parent: the trainer's server
        assert seen["before"]["mark"] is None and not seen["before"]["imported"]
        # on its own, a forked child has the trainer's path and directory, and the environment
        # of the fork server's start
        assert seen["not_passed"]["mark"] is None and seen["not_passed"]["imported"]
        assert seen["not_passed"]["cwd"] == str(tmp_path)
        # the rollout process adopts the trainer's environment as it is now
        assert seen["passed"] == {
            "mark": "set after the fork server started",
            "imported": True,
            "cwd": str(tmp_path),
            "parent": fork_server.pid,
        }

        trainer.kill()
        trainer.wait(WAIT_S)
        assert seen["waiting"]["pid"] in {p.pid for p in run}
        left = alive_after([p for p in run if p.pid != trainer.pid], WAIT_S)
        assert left == [], [described(p) for p in left]
    finally:
        trainer.kill()
        kill_all(run)
