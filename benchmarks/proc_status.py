"""A process tree's members and their /proc status fields (resident sizes), for benchmarks that watch memory."""

from __future__ import annotations

from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def status_kib(pid: int, field: str) -> int:
    """A /proc/PID/status field in KiB (VmRSS, VmHWM, RssAnon, ...); 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
