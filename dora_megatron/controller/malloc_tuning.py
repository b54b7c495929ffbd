"""glibc's mmap threshold fixed for the controller's process.

WHY: a controller under routing replay decodes answers of up to ~60 MB (a 30K-token answer's routed
experts as base64) and frees them once spooled. glibc raises its mmap threshold to the size of
each mmapped block freed (up to 32 MB), so after the first such answer every later one's buffers
of a few MB are carved from the heap instead, and what is freed there is kept by the process
(between longer-lived blocks it cannot be returned). The controller's RSS then grew 2.2x the
arrays it held; with the threshold fixed at 128 KiB (glibc's own starting value), 1.06x
(``docs/results/controller_scale.md``). A fixed threshold also turns off the dynamic raise.

The setting is the process's (glibc has no call to read it back, so it cannot be restored); it
changes only where blocks above the threshold live, never what a program computes. It is not
applied when the environment sets ``MALLOC_MMAP_THRESHOLD_`` (the operator's choice) or the C
library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

#: glibc's ``M_MMAP_THRESHOLD`` parameter number (malloc.h)
M_MMAP_THRESHOLD = -3
#: blocks above this many bytes are mmapped and returned to the system when freed
MMAP_THRESHOLD_BYTES = 128 * 1024
ENV_OVERRIDE = "MALLOC_MMAP_THRESHOLD_"


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``nbytes``; True when it was set (False: not glibc, the
    environment sets it, or ``mallopt`` refused)."""
    if os.environ.get(ENV_OVERRIDE) is not None:
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)))
    except (OSError, AttributeError):
        return False
    if not ok:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) refused: glibc keeps its dynamic threshold", nbytes)
    return ok
