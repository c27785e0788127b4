"""Applies a ThreadPlan to torch: the number of intra-op threads, and one CPU per OpenMP thread.

OpenMP keeps one thread team per thread that starts parallel work, and two teams in one process slow each
other down badly. So the model runs on whichever thread calls it (the engine's), and that thread's team is pinned
the first time it runs the model: with the C++ extension's ``bind_threads`` (exact, as vLLM does), or else by
pinning the threads that appear while a warm-up op runs (only works on a thread with no team yet).
The calling thread keeps its pin between steps (unpinned, it migrates and comes back cold) until ``release``: the
in-process ``LLM`` releases the user's thread when ``generate`` returns. Figures: docs/cpu-backend-measurements.md.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from pagedllm.backends.common.cpu_binding import ThreadPlan, format_cpu_list

logger = logging.getLogger("pagedllm.cpu")


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class ThreadBinder:
    def __init__(self, plan: ThreadPlan, kernels=None) -> None:
        self.plan = plan
        self.kernels = kernels
        self._bound_to: int | None = None
        self._caller_cpus: set[int] = set()
        self._released = False

    def ensure_bound(self) -> None:
        """Pin the calling thread's OpenMP team: all of it once per calling thread, the caller again after a
        ``release``."""
        ident = threading.get_ident()
        if self._bound_to != ident:
            self._bound_to = ident
            self._caller_cpus = os.sched_getaffinity(0)
            self.bind_current_thread()
        elif self._released and self.plan.cpus is not None:
            os.sched_setaffinity(0, {self.plan.cpus[0]})  # the team's thread 0 is the caller
        self._released = False

    def release(self) -> None:
        """Give the calling thread back the CPUs it had before it first ran the model; its OpenMP workers stay
        pinned (they are idle until it runs the model again)."""
        if self._bound_to == threading.get_ident() and self.plan.cpus is not None and not self._released:
            os.sched_setaffinity(0, self._caller_cpus)
            self._released = True

    def bind_current_thread(self) -> None:
        torch.set_num_threads(self.plan.num_threads)
        cpus = self.plan.cpus
        if cpus is None:
            return
        if self.kernels is not None:
            placed = self.kernels.bind_threads(cpus)
            if list(placed) != list(cpus):
                logger.warning("pinned OpenMP threads to CPUs %s, asked for %s", placed, format_cpu_list(cpus))
            return
        os.sched_setaffinity(0, cpus)  # workers created below inherit the whole set first
        before = _tasks()
        with torch.inference_mode():
            a = torch.ones(512, 512)
            for _ in range(3):
                (a @ a).sum()
        workers = sorted(_tasks() - before)
        os.sched_setaffinity(0, {cpus[0]})
        for tid, cpu in zip(workers, cpus[1:]):
            try:
                os.sched_setaffinity(tid, {cpu})
            except OSError:  # the thread ended meanwhile
                pass
        if len(workers) != len(cpus) - 1:
            logger.warning("pinned %d of %d OpenMP worker threads one-to-one; the rest run on CPUs %s",
                           min(len(workers), len(cpus) - 1), len(cpus) - 1, format_cpu_list(cpus))
