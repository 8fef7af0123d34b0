"""A CPU learner's process keeps the memory a step frees (:mod:`asyncgrpo.adapters.host_memory`):
a large block freed stays resident for the next one instead of being faulted in again. Each
case runs in a fresh process, since the setting holds for the whole process."""

import os
import subprocess
import sys

import pytest

BLOCK_MIB = 96
FREE_AND_MEASURE = f"""
import ctypes, sys
from asyncgrpo.adapters.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    choice = keep_freed_memory("cpu")
    assert choice.retain, choice.reason
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = resident()
block = libc.malloc({BLOCK_MIB} << 20)
ctypes.memset(block, 1, {BLOCK_MIB} << 20)  # touch every page
libc.free(block)
print((resident() - before) / 2**20)
"""


def resident_after_free_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run([sys.executable, "-c", FREE_AND_MEASURE, mode], env=env,
                          capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return float(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_a_freed_block_stays_resident_only_when_kept() -> None:
    kept = resident_after_free_mib("keep")
    # negative control: glibc's default returns a block this large to the kernel when freed
    returned = resident_after_free_mib("default")
    assert kept >= 0.9 * BLOCK_MIB
    assert returned < 0.1 * BLOCK_MIB
