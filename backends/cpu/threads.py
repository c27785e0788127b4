"""Applies a ThreadPlan to torch: the number of intra-op threads, and one CPU per OpenMP thread.

OpenMP keeps one worker pool per thread that starts parallel work, so the pinning happens on the
model's own worker thread before it runs anything: its OpenMP workers are the threads that appear
while a warm-up op runs, and each gets one CPU of the plan.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedllm.cpu_binding import ThreadPlan

logger = logging.getLogger("pagedllm.cpu")


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class ThreadBinder:
    def __init__(self, plan: ThreadPlan) -> None:
        self.plan = plan

    def bind_current_thread(self) -> None:
        """Pin this (fresh) thread and the OpenMP workers its first parallel op creates."""
        torch.set_num_threads(self.plan.num_threads)
        cpus = self.plan.cpus
        if cpus is None:
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
                           min(len(workers), len(cpus) - 1), len(cpus) - 1, cpus)
