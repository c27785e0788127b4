// Thread placement for the backend's OpenMP team.
#include <omp.h>
#include <sched.h>

#include <cstdint>
#include <vector>

// Pin the OpenMP threads of the calling thread's team one to a CPU: thread i of every later parallel region
// started from this thread runs on cpus[i] (libgomp reuses its pool threads in order).
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  const int n = static_cast<int>(cpus.size());
  std::vector<int64_t> placed(n, -1);
  omp_set_num_threads(n);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) placed[i] = sched_getcpu();
  }
  return placed;
}
