"""A CPU learner's process keeps the memory a step frees (:mod:`asyncgrpo.adapters.host_memory`):
a large block freed stays resident for the next one instead of being faulted in again, until
the learner gives it back. Each case runs in a fresh process, since the setting holds for the
whole process."""

import os
import subprocess
import sys

import pytest

from asyncgrpo.adapters.vllm.server import ServerSpec
from asyncgrpo.core.packing.host_memory import MALLOC_ENVIRONMENT

BLOCK_MIB = 96
MEASURING = """
import ctypes, sys
from asyncgrpo.adapters.host_memory import give_back_freed_memory, keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
"""
FREE_AND_MEASURE = (
    MEASURING
    + f"""
if sys.argv[1] in ("keep", "give back"):
    choice = keep_freed_memory("cpu")
    assert choice.retain, choice.reason
before = resident()
block = libc.malloc({BLOCK_MIB} << 20)
ctypes.memset(block, 1, {BLOCK_MIB} << 20)  # touch every page
libc.free(block)
if sys.argv[1] == "give back":
    give_back_freed_memory()
print((resident() - before) / 2**20)
"""
)
FRAGMENT_AND_MEASURE = (
    MEASURING
    + f"""
before = resident()
blocks = [libc.malloc(64 << 10) for _ in range({BLOCK_MIB} * 16)]  # below the mmap threshold
for block in blocks:
    ctypes.memset(block, 1, 64 << 10)
for block in blocks[:-1]:  # the last one pins the heap's top: glibc cannot trim it itself
    libc.free(block)
if sys.argv[1] == "give back":
    give_back_freed_memory()
print((resident() - before) / 2**20)
"""
)


def resident_after_free_mib(mode: str, script: str = FREE_AND_MEASURE) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run(
        [sys.executable, "-c", script, mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return float(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_a_freed_block_stays_resident_only_when_kept() -> None:
    kept = resident_after_free_mib("keep")
    # negative control: glibc's default returns a block this large to the kernel when freed
    returned = resident_after_free_mib("default")
    assert kept >= 0.9 * BLOCK_MIB
    assert returned < 0.1 * BLOCK_MIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_kept_memory_is_returned_when_given_back() -> None:
    assert resident_after_free_mib("give back") < 0.1 * BLOCK_MIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_a_heap_left_as_glibc_sets_it_gives_back_its_free_middle_when_asked() -> None:
    """The rollout process keeps glibc's defaults, which trim only the heap's top: blocks freed
    below one still in use stay resident (the negative control) until
    :func:`give_back_freed_memory`, which the rollout loop calls every minute."""
    assert resident_after_free_mib("default", FRAGMENT_AND_MEASURE) >= 0.9 * BLOCK_MIB
    assert resident_after_free_mib("give back", FRAGMENT_AND_MEASURE) < 0.1 * BLOCK_MIB


# A block freed below one still in use stays resident when it came from the heap; what glibc
# serves by mmap goes back. glibc's threshold for mmap rises to the size of the last mmap block
# freed (here 4 MiB), so 1 MiB blocks come from the heap afterwards unless it is fixed.
FREED_UNDER_A_LIVE_BLOCK = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block
libc.free(touched(4 << 20))
before = resident()
blocks = [touched(1 << 20) for _ in range(16)]
pinned = touched(256 << 10)  # from the heap's top, above the freed blocks
for block in blocks:
    libc.free(block)
print((resident() - before) / 2**20)
"""


def resident_after_freeing_under_a_live_block_mib(env: dict[str, str]) -> float:
    done = subprocess.run(
        [sys.executable, "-c", FREED_UNDER_A_LIVE_BLOCK],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return float(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_a_server_fixes_the_mmap_threshold_unless_the_allocator_is_chosen(monkeypatch) -> None:
    """Every process of a server asyncgrpo starts gets a fixed mmap threshold, so the blocks
    its generation frees go back to the kernel instead of piling up in the heap."""
    for name in (*MALLOC_ENVIRONMENT, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    env = ServerSpec(model="m").environment()
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(64 * 1024)
    assert resident_after_freeing_under_a_live_block_mib(env) < 2
    # negative control: glibc's rising threshold keeps the 16 MiB freed in the heap
    del env["MALLOC_MMAP_THRESHOLD_"]
    assert resident_after_freeing_under_a_live_block_mib(env) > 14
    assert (
        "MALLOC_MMAP_THRESHOLD_"
        not in ServerSpec(model="m", mmap_threshold_bytes=None).environment()
    )
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # not one of glibc's settings we defer to
    assert "MALLOC_MMAP_THRESHOLD_" in ServerSpec(model="m").environment()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")  # the user's choice
    assert "MALLOC_MMAP_THRESHOLD_" not in ServerSpec(model="m").environment()
