"""Thread settings for the CPU plugin from the binding plan the cpu backend uses (VLLM_CPU_OMP_THREADS_BIND).

OpenVINO takes a number of threads and whether to pin them; it chooses the cores itself, within the
process's CPU affinity. So of a plan it honours the thread count and pinning, not an explicit CPU list.
"""

from __future__ import annotations

import logging
import os

from pagedllm.backends.common.cpu_binding import Topology, replica_plans
from pagedllm.errors import ConfigError

logger = logging.getLogger("pagedllm.openvino")


def thread_properties(spec: str, serving: bool, replica: int = 0, replicas: int = 1) -> tuple[dict, str]:
    """(compile properties, what was applied) for a binding spec: auto, nobind or a CPU list.
    ``serving``: leave a core for the HTTP server, as the cpu backend does. A data-parallel ``replica`` keeps this
    process to its own CPU set (OpenVINO pins within the process's affinity), so replicas do not share cores."""
    plan = replica_plans(spec, 1, replica, replicas, reserve_for_server=serving)[0]
    for warning in plan.warnings:
        logger.warning("%s", warning)
    if replicas > 1 and plan.cpus is not None:
        os.sched_setaffinity(0, plan.cpus)
    pinned = plan.cpus is not None
    properties = {"INFERENCE_NUM_THREADS": plan.num_threads, "ENABLE_CPU_PINNING": pinned}
    applied = f"{plan.num_threads} OpenVINO threads, {'pinned' if pinned else 'not pinned'}"
    if pinned and spec.strip() not in ("", "auto"):
        applied += " to cores OpenVINO picks (it takes a thread count, not a CPU list)"
    return properties, f"{applied}; plan: {plan.describe()}"


def distribution_properties(tensor_parallel_size: int, supported: list[str], topology: Topology | None = None) -> dict:
    """Compile properties for --tensor-parallel-size: the CPU plugin's TENSOR_PARALLEL model distribution, which
    splits the model over NUMA nodes (one part per socket) inside one process; ConfigError where it cannot."""
    if tensor_parallel_size == 1:
        return {}
    if "MODEL_DISTRIBUTION_POLICY" not in supported:
        raise ConfigError(f"--tensor-parallel-size {tensor_parallel_size}: this OpenVINO's CPU plugin has no model "
                          f"distribution policy (OpenVINO 2024.4 or newer has); run with --tensor-parallel-size 1 or "
                          f"the cpu backend")
    topology = topology or Topology.read()
    nodes = sorted(set(topology.node_of.values())) or [0]
    if len(nodes) != tensor_parallel_size:
        raise ConfigError(f"--tensor-parallel-size {tensor_parallel_size}: OpenVINO's CPU plugin splits a model "
                          f"across NUMA nodes, one part per node, and this machine has {len(nodes)}; pass "
                          f"--tensor-parallel-size {len(nodes)}" + (" (no split)" if len(nodes) == 1 else "")
                          + ", or use the cpu backend, whose ranks split any machine's cores")
    import openvino.properties.hint as hints

    return {"MODEL_DISTRIBUTION_POLICY": {hints.ModelDistributionPolicy.TENSOR_PARALLEL}}
