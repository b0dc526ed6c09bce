#include "copy/copy_plan.h"

#include <algorithm>
#include <utility>

#include "common/error.h"

namespace msrl {

namespace {

// Collapses a 2-D descriptor whose rows are contiguous on both sides into one 1-D copy.
CopyDescriptor normalize(CopyDescriptor d) {
  if (d.rows > 1 && d.src_pitch == d.row_bytes && d.dst_pitch == d.row_bytes) {
    d.row_bytes *= d.rows;
    d.rows = 1;
  }
  if (d.rows == 1) d.src_pitch = d.dst_pitch = d.row_bytes;
  return d;
}

void check_descriptor(const CopyDescriptor& d, size_t i) {
  MSRL_CHECK(d.rows > 0, kInvalidArgument, "descriptor ", i, ": rows must be > 0, got 0");
  MSRL_CHECK(d.row_bytes > 0, kInvalidArgument, "descriptor ", i, ": row_bytes must be > 0, got 0");
  constexpr uint64_t kLimit = uint64_t{1} << 62;  // also catches negative values cast from Python
  MSRL_CHECK(d.rows < kLimit && d.row_bytes < kLimit && d.src_offset < kLimit && d.dst_offset < kLimit &&
                 d.src_pitch < kLimit && d.dst_pitch < kLimit,
             kInvalidArgument, "descriptor ", i, ": a field is negative or >= 2^62 (src_offset=", d.src_offset,
             ", dst_offset=", d.dst_offset, ", rows=", d.rows, ", row_bytes=", d.row_bytes, ")");
  if (d.rows > 1) {
    MSRL_CHECK(d.src_pitch >= d.row_bytes, kInvalidArgument, "descriptor ", i, ": src_pitch ", d.src_pitch,
               " is smaller than row_bytes ", d.row_bytes);
    MSRL_CHECK(d.dst_pitch >= d.row_bytes, kInvalidArgument, "descriptor ", i, ": dst_pitch ", d.dst_pitch,
               " is smaller than row_bytes ", d.row_bytes, " (rows would overlap)");
    MSRL_CHECK(d.rows < kLimit / std::max<uint64_t>(1, std::max(d.src_pitch, d.dst_pitch)), kInvalidArgument,
               "descriptor ", i, ": extent overflows 64 bits");
  }
}

// Exact check that no two destination rows overlap: sort every row interval by start.
void check_dst_overlap(const std::vector<CopyDescriptor>& descs) {
  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  size_t total_rows = 0;
  for (const auto& d : descs) total_rows += d.rows;
  spans.reserve(total_rows);
  for (size_t i = 0; i < descs.size(); ++i) {
    const auto& d = descs[i];
    for (uint64_t r = 0; r < d.rows; ++r) {
      uint64_t b = d.dst_offset + r * d.dst_pitch;
      spans.push_back({b, b + d.row_bytes, i});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < spans.size(); ++k) {
    MSRL_CHECK(spans[k].begin >= spans[k - 1].end, kInvalidArgument, "descriptors ", spans[k - 1].index, " and ",
               spans[k].index, " write overlapping destination bytes [", spans[k].begin, ", ",
               std::min(spans[k].end, spans[k - 1].end), ")");
  }
}

}  // namespace

std::vector<CopyDescriptor> coalesce(const std::vector<CopyDescriptor>& in) {
  std::vector<CopyDescriptor> out;
  out.reserve(in.size());
  for (const auto& raw : in) {
    CopyDescriptor d = normalize(raw);
    if (!out.empty()) {
      CopyDescriptor& l = out.back();
      // 1-D run continues on both sides: one longer copy.
      if (l.rows == 1 && d.rows == 1 && d.src_offset == l.src_offset + l.row_bytes &&
          d.dst_offset == l.dst_offset + l.row_bytes) {
        l.row_bytes += d.row_bytes;
        l.src_pitch = l.dst_pitch = l.row_bytes;
        continue;
      }
      // Another row of the same width at the same strides: one more row of a 2-D copy.
      if (d.rows == 1 && l.row_bytes == d.row_bytes && d.src_offset >= l.src_offset + l.row_bytes &&
          d.dst_offset >= l.dst_offset + l.row_bytes) {
        if (l.rows == 1) {
          l.src_pitch = d.src_offset - l.src_offset;
          l.dst_pitch = d.dst_offset - l.dst_offset;
          l.rows = 2;
          if (l.src_pitch == l.row_bytes && l.dst_pitch == l.row_bytes) l = normalize(l);
          continue;
        }
        if (d.src_offset == l.src_offset + l.rows * l.src_pitch &&
            d.dst_offset == l.dst_offset + l.rows * l.dst_pitch) {
          ++l.rows;
          continue;
        }
      }
    }
    out.push_back(d);
  }
  return out;
}

CopyPlan::CopyPlan(std::vector<CopyDescriptor> descriptors) : input_count_(descriptors.size()) {
  for (size_t i = 0; i < descriptors.size(); ++i) check_descriptor(descriptors[i], i);
  check_dst_overlap(descriptors);
  std::stable_sort(descriptors.begin(), descriptors.end(),
                   [](const CopyDescriptor& a, const CopyDescriptor& b) { return a.dst_offset < b.dst_offset; });
  descs_ = coalesce(descriptors);
  for (const auto& d : descs_) {
    bytes_ += d.bytes();
    src_extent_ = std::max(src_extent_, d.src_end());
    dst_extent_ = std::max(dst_extent_, d.dst_end());
  }
}

void CopyPlan::check_bounds(uint64_t src_bytes, uint64_t dst_bytes) const {
  MSRL_CHECK(src_extent_ <= src_bytes, kInvalidArgument, "plan reads up to byte ", src_extent_,
             " but the source has only ", src_bytes, " bytes");
  MSRL_CHECK(dst_extent_ <= dst_bytes, kInvalidArgument, "plan writes up to byte ", dst_extent_,
             " but the destination has only ", dst_bytes, " bytes");
}

}  // namespace msrl
