// Small helpers of every kernel file.
#pragma once

#include <cstdint>

namespace pagedllm {

// The ceiling of a / b for positive b: how many b-sized tiles hold a items.
constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace pagedllm
