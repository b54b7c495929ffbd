"""glibc's mmap threshold fixed for the controller (dora_megatron.controller.malloc_tuning): after a
big block is freed, a block of a few MB is still mmapped (returned to the system when freed) instead
of carved from the heap, unless the environment chose the threshold. Each case runs in a process of
its own: the setting is the process's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

ROOT = Path(__file__).resolve().parents[3]
# frees a 20 MB block (glibc's dynamic threshold rises to 20 MB), then allocates 1 MB: prints
# whether the threshold was fixed and how many bytes more glibc holds in mmapped blocks after it
PROBE = """
import ctypes, sys
from dora_megatron.controller.malloc_tuning import fix_mmap_threshold
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else None
big = bytearray(20 << 20)
del big
before = libc.mallinfo2().hblkhd
buf = bytearray(1 << 20)
print(fixed, libc.mallinfo2().hblkhd - before)
"""


def _probe(mode: str, **env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**environ, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, check=True, timeout=60).stdout.split()
    return out[0], int(out[1])


def test_a_fixed_threshold_keeps_a_few_mb_out_of_the_heap_after_a_big_block_was_freed():
    assert _probe("leave") == ("None", 0)  # glibc's dynamic threshold: the 1 MB comes from the heap
    fixed, mmapped = _probe("fix")
    assert fixed == "True" and mmapped >= 1 << 20


def test_the_environments_threshold_is_left_as_the_operator_set_it():
    fixed, mmapped = _probe("fix", MALLOC_MMAP_THRESHOLD_=str(32 << 20))
    assert fixed == "False" and mmapped == 0  # 32 MB chosen: the 1 MB stays in the heap
