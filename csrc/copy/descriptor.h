// One strided copy: `rows` rows of `row_bytes`, row r read at src + src_offset + r * src_pitch and
// written at dst + dst_offset + r * dst_pitch. rows == 1 is a plain 1-D copy.
#pragma once

#include <cstddef>
#include <cstdint>

namespace msrl {

struct CopyDescriptor {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t rows = 1;
  uint64_t row_bytes = 0;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;

  uint64_t bytes() const { return rows * row_bytes; }
  // One past the last byte touched on each side.
  uint64_t src_end() const { return rows == 0 ? src_offset : src_offset + (rows - 1) * src_pitch + row_bytes; }
  uint64_t dst_end() const { return rows == 0 ? dst_offset : dst_offset + (rows - 1) * dst_pitch + row_bytes; }
};

// One 1-D copy between absolute addresses: the unit of a batch of unrelated buffers (say, every
// parameter of a model) submitted as one job.
struct CopyRegion {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t nbytes = 0;
};

static_assert(sizeof(CopyDescriptor) == 48, "CopyDescriptor is shared with numpy as 6 x uint64");

}  // namespace msrl
