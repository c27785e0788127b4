"""VLLM_CPU_OMP_THREADS_BIND parsing and the `auto` choice, against fake sysfs topologies."""

import os
import threading

import pytest

from pagedllm.backends.common.cpu_binding import (
    Topology,
    format_cpu_list,
    parse_cpu_list,
    plan_ranks,
    plan_threads,
    process_cpus,
    replica_plans,
)
from pagedllm.errors import ConfigError


def fake_sysfs(root, sockets=2, cores=4, threads=2, nodes_per_socket=1):
    """Linux-style numbering: CPU c + k * (sockets * cores) is hyperthread k of physical core c."""
    total_cores = sockets * cores
    cpu_dir = root / "cpu"
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text(f"0-{total_cores * threads - 1}\n")
    for core in range(total_cores):
        siblings = [core + k * total_cores for k in range(threads)]
        for cpu in siblings:
            topo = cpu_dir / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True)
            topo.joinpath("thread_siblings_list").write_text(",".join(map(str, siblings)) + "\n")
    per_node = cores // nodes_per_socket
    for node in range(sockets * nodes_per_socket):
        node_cores = range(node * per_node, (node + 1) * per_node)
        cpus = sorted(c + k * total_cores for c in node_cores for k in range(threads))
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(format_cpu_list(cpus) + "\n")
    return Topology.read(root)


def test_cpu_lists():
    assert parse_cpu_list("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    assert format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("3-1", "a", "", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_auto_takes_one_cpu_per_physical_core(tmp_path):
    topo = fake_sysfs(tmp_path)  # 2 sockets x 4 cores x 2 threads = CPUs 0-15
    plan = plan_threads("auto", topology=topo, allowed=set(range(16)))
    assert plan.cpus == list(range(8)) and plan.num_threads == 8
    assert plan.hyperthreads_skipped and plan.numa_nodes == [0, 1]
    assert plan.warnings and "span NUMA nodes 0,1" in plan.warnings[0]
    assert "8 threads bound to CPUs 0-7" in plan.describe() and "hyperthread siblings skipped" in plan.describe()


def test_auto_respects_the_process_affinity(tmp_path):
    topo = fake_sysfs(tmp_path)
    # A container given CPUs 2,3 and their siblings 10,11: two physical cores on node 0.
    plan = plan_threads("auto", topology=topo, allowed={2, 3, 10, 11})
    assert plan.cpus == [2, 3] and plan.numa_nodes == [0] and not plan.warnings


def test_auto_without_hyperthreads(tmp_path):
    topo = fake_sysfs(tmp_path, sockets=1, cores=4, threads=1)
    plan = plan_threads("auto", topology=topo, allowed={0, 1, 2, 3})
    assert plan.cpus == [0, 1, 2, 3] and not plan.hyperthreads_skipped


def test_serving_leaves_a_core_for_the_http_server(tmp_path):
    topo = fake_sysfs(tmp_path, sockets=1, cores=4, threads=1)
    assert plan_threads("auto", topology=topo, allowed={0, 1, 2, 3}, reserve_for_server=True).cpus == [0, 1, 2]
    topo2 = fake_sysfs(tmp_path / "two", sockets=1, cores=2, threads=1)
    assert plan_threads("auto", topology=topo2, allowed={0, 1}, reserve_for_server=True).cpus == [0, 1]


def test_explicit_lists_and_nobind(tmp_path):
    topo = fake_sysfs(tmp_path)
    plan = plan_threads("0,2,4-7", topology=topo, allowed=set(range(16)))
    assert plan.cpus == [0, 2, 4, 5, 6, 7] and plan.numa_nodes == [0, 1]
    plan = plan_threads("8-11", topology=topo, allowed=set(range(16)))  # hyperthreads, when asked, are used
    assert plan.cpus == [8, 9, 10, 11] and plan.numa_nodes == [0]
    plan = plan_threads("nobind", topology=topo, allowed=set(range(16)))
    assert plan.cpus is None and "not pinned" in plan.describe()


@pytest.mark.parametrize("spec, message", [
    ("0-31|32-63", "names 2 tensor-parallel ranks, but the tensor-parallel size is 1: pass --tensor-parallel-size 2"),
    ("0-3,x", "is not valid"),
    ("12-20", "names CPUs 16-20 that this process may not use; available: 0-15"),
])
def test_bad_specs_say_what_to_do(tmp_path, spec, message):
    topo = fake_sysfs(tmp_path)
    with pytest.raises(ConfigError, match=message):
        plan_threads(spec, topology=topo, allowed=set(range(16)))


def test_auto_splits_the_ranks_by_numa_node_then_by_core(tmp_path):
    topo = fake_sysfs(tmp_path)  # 2 sockets x 4 cores x 2 threads: node 0 has cores 0-3, node 1 cores 4-7
    two = plan_ranks("auto", 2, topology=topo, allowed=set(range(16)))
    assert [p.cpus for p in two] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.numa_nodes for p in two] == [[0], [1]] and not any(p.warnings for p in two)
    four = plan_ranks("auto", 4, topology=topo, allowed=set(range(16)))
    assert [p.cpus for p in four] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    three = plan_ranks("auto", 3, topology=topo, allowed=set(range(16)))  # not a multiple of the nodes
    assert [p.cpus for p in three] == [[0, 1, 2], [3, 4, 5], [6, 7]] and three[1].warnings


def test_data_parallel_replicas_take_their_run_of_the_sets(tmp_path):
    topo = fake_sysfs(tmp_path)  # node 0: cores 0-3, node 1: cores 4-7
    auto = [replica_plans("auto", 1, replica, 2, topology=topo, allowed=set(range(16))) for replica in range(2)]
    assert [[p.cpus for p in plans] for plans in auto] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]  # a NUMA node each
    # -dp 2 -tp 2 on four explicit sets: replica 1 runs its two ranks on the last two
    given = replica_plans("0-1|2-3|4-5|6-7", 2, 1, 2, topology=topo, allowed=set(range(16)))
    assert [p.cpus for p in given] == [[4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="names 2 CPU sets but there are 4"):
        replica_plans("0-3|4-7", 2, 0, 2, topology=topo, allowed=set(range(16)))


def test_explicit_rank_sets(tmp_path):
    topo = fake_sysfs(tmp_path)
    plans = plan_ranks("0-3|4-7", 2, topology=topo, allowed=set(range(16)))
    assert [p.cpus for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]] and [p.num_threads for p in plans] == [4, 4]


@pytest.mark.parametrize("spec, ranks, message", [
    ("0-3|4-7", 3, "names 2 CPU sets but there are 3 tensor-parallel ranks on this machine"),
    ("0-7", 2, "names 1 CPU set but there are 2 tensor-parallel ranks"),
    ("0-4|4-7", 2, "the sets of ranks 0 and 1 share CPUs 4"),
    ("auto", 9, "9 tensor-parallel ranks need a physical core each, but this machine gives this process 8"),
])
def test_rank_plans_that_cannot_work_are_refused(tmp_path, spec, ranks, message):
    topo = fake_sysfs(tmp_path)
    with pytest.raises(ConfigError, match=message):
        plan_ranks(spec, ranks, topology=topo, allowed=set(range(16)))


def test_this_machine():
    plan = plan_threads("auto")
    assert plan.cpus and set(plan.cpus) <= process_cpus()


@pytest.mark.skipif(len(process_cpus()) < 2, reason="needs two CPUs")
def test_worker_threads_are_pinned_one_to_one():
    from pagedllm.backends.cpu.runner.threads import ThreadBinder

    cpus = sorted(process_cpus())[:2]
    plan = plan_threads(format_cpu_list(cpus))
    seen = {}

    def worker():
        before = {int(t) for t in os.listdir("/proc/self/task")}
        ThreadBinder(plan).bind_current_thread()
        seen["self"] = os.sched_getaffinity(0)
        seen["workers"] = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")
                           if int(t) not in before and int(t) != threading.get_native_id()]

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["self"] == {cpus[0]}
    assert {cpus[1]} in seen["workers"]  # the OpenMP worker (torch may start other helper threads too)
