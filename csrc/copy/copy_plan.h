// A copy plan: a validated, coalesced list of strided descriptors from one source buffer to one
// destination buffer. Built once, executed many times (by CopyEngine or DeviceRuntime::plan_async).
#pragma once

#include <cstdint>
#include <vector>

#include "copy/descriptor.h"

namespace msrl {

class CopyPlan {
 public:
  // Validates and coalesces. Throws InvalidArgument (naming the descriptor index and value) when a
  // descriptor has rows or row_bytes of 0, a pitch smaller than row_bytes with rows > 1, or when two
  // descriptors write overlapping destination bytes.
  explicit CopyPlan(std::vector<CopyDescriptor> descriptors);

  const std::vector<CopyDescriptor>& descriptors() const { return descs_; }
  size_t input_count() const { return input_count_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t src_extent() const { return src_extent_; }  // bytes the source must have
  uint64_t dst_extent() const { return dst_extent_; }  // bytes the destination must have

  // Throws InvalidArgument when the buffers are smaller than the plan's extents.
  void check_bounds(uint64_t src_bytes, uint64_t dst_bytes) const;

 private:
  std::vector<CopyDescriptor> descs_;
  size_t input_count_ = 0;
  uint64_t bytes_ = 0;
  uint64_t src_extent_ = 0;
  uint64_t dst_extent_ = 0;
};

// Exposed for tests: merges descriptors that continue one another (1-D runs into one copy, equal-size
// rows at a constant stride into one 2-D copy). Input order is preserved among non-merged entries.
std::vector<CopyDescriptor> coalesce(const std::vector<CopyDescriptor>& sorted_by_dst);

}  // namespace msrl
