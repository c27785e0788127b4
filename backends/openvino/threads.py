"""Thread settings for the CPU plugin from the binding plan the cpu backend uses (VLLM_CPU_OMP_THREADS_BIND).

OpenVINO takes a number of threads and whether to pin them; it chooses the cores itself, within the
process's CPU affinity. So of a plan it honours the thread count and pinning, not an explicit CPU list.
"""

from __future__ import annotations

import logging

from pagedllm.backends.cpu_binding import plan_threads

logger = logging.getLogger("pagedllm.openvino")


def thread_properties(spec: str, serving: bool) -> tuple[dict, str]:
    """(compile properties, what was applied) for a binding spec: auto, nobind or a CPU list.
    ``serving``: leave a core for the HTTP server, as the cpu backend does."""
    plan = plan_threads(spec, reserve_for_server=serving)
    for warning in plan.warnings:
        logger.warning("%s", warning)
    pinned = plan.cpus is not None
    properties = {"INFERENCE_NUM_THREADS": plan.num_threads, "ENABLE_CPU_PINNING": pinned}
    applied = f"{plan.num_threads} OpenVINO threads, {'pinned' if pinned else 'not pinned'}"
    if pinned and spec.strip() not in ("", "auto"):
        applied += " to cores OpenVINO picks (it takes a thread count, not a CPU list)"
    return properties, f"{applied}; plan: {plan.describe()}"
