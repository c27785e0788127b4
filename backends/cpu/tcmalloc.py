"""TCMalloc makes the many short-lived tensors of a step cheaper; say whether it is in use."""

from __future__ import annotations

import ctypes.util
import glob
import os

from pagedllm.memory import tcmalloc_loaded

_SEARCH = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def _installed() -> str | None:
    for folder in _SEARCH:
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            matches = glob.glob(os.path.join(folder, name))
            if matches:
                return matches[0]
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found if found and os.path.isabs(found) else None


def tcmalloc_status() -> str:
    if tcmalloc_loaded():
        return "TCMalloc is preloaded"
    path = _installed()
    if path:
        return f"TCMalloc is installed but not preloaded; start with LD_PRELOAD={path} for faster allocation"
    return ("TCMalloc not in use (optional: apt-get install libtcmalloc-minimal4, then "
            "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)")
