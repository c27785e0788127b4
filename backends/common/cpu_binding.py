"""Which CPUs the inference threads run on: ``VLLM_CPU_OMP_THREADS_BIND`` parsed and planned.

``auto`` takes one CPU per physical core (hyperthread siblings skipped) among the CPUs this process
may use (its affinity mask, e.g. a container's cpuset), read from the kernel's sysfs topology. An
explicit list (``0-29``, ``0,2,4-7``) is used as given; ``nobind`` pins nothing. ``a-b|c-d`` names one
CPU set per tensor-parallel rank (``plan_ranks``). Backends apply the plan (torch threads, OpenVINO properties).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from pagedllm.config import Setting
from pagedllm.errors import ConfigError

THREADS_BIND = Setting("cpu_omp_threads_bind", str, "auto",
                       "CPUs of the inference threads: auto (one per physical core), nobind, 0-29, 0,2,4-7; "
                       "sets split by a vertical bar give each tensor-parallel rank its own",
                       env_aliases=("VLLM_CPU_OMP_THREADS_BIND",))
TENSOR_PARALLEL_SIZE = Setting("tensor_parallel_size", int, 1,
                               "tensor-parallel ranks: the model's heads, MLP and vocabulary split over this many "
                               "worker processes, one CPU set each", short_flag="-tp")
SYSFS = Path("/sys/devices/system")
# The CPUs this process may use, read before anything pins a thread (binding pins the calling thread to one
# CPU, so a later engine in the same process would otherwise see only that one).
_PROCESS_CPUS = frozenset(os.sched_getaffinity(0))


def process_cpus() -> frozenset[int]:
    return _PROCESS_CPUS


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11] (sorted, no duplicates)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        start, end = int(first), int(last) if last else int(first)
        if end < start or start < 0:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(start, end + 1))
    if not cpus:
        raise ValueError("empty CPU list")
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and int(ranges[-1].rsplit("-", 1)[-1]) == cpu - 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


@dataclasses.dataclass(frozen=True)
class Topology:
    siblings: dict[int, tuple[int, ...]]  # cpu -> the CPUs sharing its physical core (itself included)
    node_of: dict[int, int]  # cpu -> NUMA node

    @classmethod
    def read(cls, root: Path = SYSFS) -> "Topology":
        siblings: dict[int, tuple[int, ...]] = {}
        online = _read(root / "cpu" / "online")
        cpus = parse_cpu_list(online) if online else sorted(_PROCESS_CPUS)
        for cpu in cpus:
            text = _read(root / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list")
            siblings[cpu] = tuple(parse_cpu_list(text)) if text else (cpu,)
        node_of: dict[int, int] = {}
        for node_dir in sorted((root / "node").glob("node[0-9]*")):
            text = _read(node_dir / "cpulist")
            if text:
                for cpu in parse_cpu_list(text):
                    node_of[cpu] = int(node_dir.name[4:])
        return cls(siblings, node_of)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    cpus: list[int] | None  # CPUs to pin the inference threads to, one each; None: no pinning
    num_threads: int
    numa_nodes: list[int]
    hyperthreads_skipped: bool
    spec: str
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        where = "not pinned (nobind)" if self.cpus is None else f"bound to CPUs {format_cpu_list(self.cpus)}"
        nodes = ",".join(map(str, self.numa_nodes)) or "?"
        ht = "; hyperthread siblings skipped" if self.hyperthreads_skipped else ""
        return f"{self.num_threads} threads {where} (NUMA node {nodes}{ht}; {self.spec!r})"


def plan_threads(spec: str, *, reserve_for_server: bool = False, topology: Topology | None = None,
                 allowed: set[int] | None = None) -> ThreadPlan:
    """Turn a ``VLLM_CPU_OMP_THREADS_BIND`` value into the CPUs to use.

    ``reserve_for_server`` keeps one core free for the HTTP server when ``auto`` has more than two.
    """
    spec = (spec or "auto").strip()
    topology = topology or Topology.read()
    allowed = set(_PROCESS_CPUS if allowed is None else allowed)
    allowed &= set(topology.siblings) or allowed

    if "|" in spec:
        ranks = spec.split("|")
        raise ConfigError(
            f"CPU binding {spec!r} names {len(ranks)} tensor-parallel ranks, but the tensor-parallel size is 1: "
            f"pass --tensor-parallel-size {len(ranks)} (-tp), or give one CPU list such as {ranks[0].strip()!r}")
    if spec == "nobind":
        return ThreadPlan(None, len(allowed), _nodes(topology, allowed), False, spec)
    if spec == "auto":
        cpus, skipped = _one_per_core(topology, allowed)
        if reserve_for_server and len(cpus) > 2:
            cpus = cpus[:-1]
        plan_cpus = cpus
    else:
        try:
            plan_cpus = parse_cpu_list(spec)
        except ValueError as exc:
            raise ConfigError(f"CPU binding {spec!r} is not valid ({exc}): use 'auto', 'nobind', a range such as "
                              f"'0-29' or a list such as '0,2,4-7'") from None
        outside = [c for c in plan_cpus if c not in allowed]
        if outside:
            raise ConfigError(f"CPU binding {spec!r} names CPUs {format_cpu_list(outside)} that this process may "
                              f"not use; available: {format_cpu_list(sorted(allowed))}")
        skipped = False
    nodes = _nodes(topology, plan_cpus)
    warnings = ()
    if len(nodes) > 1:
        warnings = (f"the bound CPUs span NUMA nodes {','.join(map(str, nodes))}: memory traffic crosses nodes; "
                    f"bind to the CPUs of one node for speed",)
    return ThreadPlan(plan_cpus, len(plan_cpus), nodes, skipped, spec, warnings)


def plan_ranks(spec: str, num_ranks: int, *, reserve_for_server: bool = False, topology: Topology | None = None,
               allowed: set[int] | None = None) -> list[ThreadPlan]:
    """One plan per tensor-parallel rank on this machine: the ``|``-separated sets as given, or with ``auto`` the
    cores split by NUMA node, then into contiguous runs of physical cores."""
    spec = (spec or "auto").strip()
    if num_ranks == 1 and "|" not in spec:
        return [plan_threads(spec, reserve_for_server=reserve_for_server, topology=topology, allowed=allowed)]
    topology = topology or Topology.read()
    sets = spec.split("|")
    if len(sets) > 1 or spec not in ("auto", "nobind"):
        if len(sets) != num_ranks:
            raise ConfigError(
                f"CPU binding {spec!r} names {len(sets)} CPU set{'s' if len(sets) > 1 else ''} but there are "
                f"{num_ranks} tensor-parallel ranks on this machine: give one set per rank separated by '|', "
                f"e.g. '0-31|32-63', or 'auto'")
        plans = [plan_threads(s, topology=topology, allowed=allowed) for s in sets]
        for i, a in enumerate(plans):
            for j, b in enumerate(plans[:i]):
                shared = sorted(set(a.cpus or ()) & set(b.cpus or ()))
                if shared:
                    raise ConfigError(f"CPU binding {spec!r}: the sets of ranks {j} and {i} share CPUs "
                                      f"{format_cpu_list(shared)}; each rank needs CPUs of its own")
        return plans
    usable = set(_PROCESS_CPUS if allowed is None else allowed) & (set(topology.siblings) or set(_PROCESS_CPUS))
    if spec == "nobind":
        each = max(1, len(usable) // num_ranks)
        return [ThreadPlan(None, each, _nodes(topology, usable), False, spec) for _ in range(num_ranks)]
    cores, skipped = _one_per_core(topology, usable)
    if reserve_for_server and len(cores) > num_ranks + 1:
        cores = cores[:-1]
    if len(cores) < num_ranks:
        raise ConfigError(
            f"{num_ranks} tensor-parallel ranks need a physical core each, but this machine gives this process "
            f"{len(cores)} ({format_cpu_list(cores)}): lower --tensor-parallel-size to {len(cores)} or less")
    by_node: dict[int, list[int]] = {}
    for cpu in cores:
        by_node.setdefault(topology.node_of.get(cpu, 0), []).append(cpu)
    groups = list(by_node.values())
    if num_ranks % len(groups) == 0 and all(len(g) >= num_ranks // len(groups) for g in groups):
        chunks = [c for g in groups for c in _split(g, num_ranks // len(groups))]
    else:  # ranks do not map onto whole nodes: contiguous runs in node order (the plan warns where one spans two)
        chunks = _split([c for g in groups for c in g], num_ranks)
    plans = []
    for chunk in chunks:
        nodes = _nodes(topology, chunk)
        warnings = (f"a rank's CPUs {format_cpu_list(chunk)} span NUMA nodes {','.join(map(str, nodes))}",) \
            if len(nodes) > 1 else ()
        plans.append(ThreadPlan(chunk, len(chunk), nodes, skipped, spec, warnings))
    return plans


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``parts`` contiguous runs whose lengths differ by at most one."""
    size, extra = divmod(len(items), parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        runs.append(items[start:end])
        start = end
    return runs


def _one_per_core(topology: Topology, allowed: set[int]) -> tuple[list[int], bool]:
    chosen: list[int] = []
    seen_cores: set[tuple[int, ...]] = set()
    skipped = False
    for cpu in sorted(allowed):
        core = topology.siblings.get(cpu, (cpu,))
        if core in seen_cores:
            skipped = True
            continue
        seen_cores.add(core)
        chosen.append(cpu)
    return chosen, skipped


def _nodes(topology: Topology, cpus) -> list[int]:
    return sorted({topology.node_of[c] for c in cpus if c in topology.node_of})


def replica_plans(spec: str, num_ranks: int, replica: int, replicas: int, *, reserve_for_server: bool = False,
                  topology: Topology | None = None, allowed: set[int] | None = None) -> list[ThreadPlan]:
    """The plans of one data-parallel replica's ``num_ranks`` ranks: the binding is planned for every rank of every
    replica (``'|'``-separated sets in replica order, or ``auto`` split), and this replica takes its run of them."""
    if replicas == 1:
        return plan_ranks(spec, num_ranks, reserve_for_server=reserve_for_server, topology=topology,
                          allowed=allowed)
    plans = plan_ranks(spec, num_ranks * replicas, reserve_for_server=reserve_for_server, topology=topology,
                       allowed=allowed)
    return plans[replica * num_ranks:(replica + 1) * num_ranks]

