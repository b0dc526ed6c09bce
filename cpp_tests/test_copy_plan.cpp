#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "common/error.h"
#include "copy/copy_plan.h"
#include "runtime/device_runtime.h"
#include "test_util.h"

using namespace msrl;
using msrl::testing::code_of;

namespace {

// Applies a plan byte by byte, the slow obvious way.
std::vector<uint8_t> reference(const std::vector<CopyDescriptor>& descs, const std::vector<uint8_t>& src,
                               std::vector<uint8_t> dst) {
  for (const auto& d : descs)
    for (uint64_t r = 0; r < d.rows; ++r)
      for (uint64_t b = 0; b < d.row_bytes; ++b)
        dst[d.dst_offset + r * d.dst_pitch + b] = src[d.src_offset + r * d.src_pitch + b];
  return dst;
}
}  // namespace

TEST(CopyPlan, CoalescesContiguousRunsIntoOneCopy) {
  std::vector<CopyDescriptor> d;
  for (uint64_t i = 0; i < 100; ++i) d.push_back({i * 64, 1000 + i * 64, 1, 64, 64, 64});
  CopyPlan plan(d);
  ASSERT_EQ(plan.descriptors().size(), 1u);
  EXPECT_EQ(plan.descriptors()[0].row_bytes, 6400u);
  EXPECT_EQ(plan.bytes(), 6400u);
  EXPECT_EQ(plan.src_extent(), 6400u);
  EXPECT_EQ(plan.dst_extent(), 7400u);
}

TEST(CopyPlan, CoalescesConstantStrideSlicesInto2D) {
  std::vector<CopyDescriptor> d;
  for (uint64_t i = 0; i < 10000; ++i) d.push_back({i * 8192, i * 4096, 1, 4096, 4096, 4096});
  CopyPlan plan(d);
  // dst is contiguous but src is strided: one 2-D copy of 10,000 rows.
  ASSERT_EQ(plan.descriptors().size(), 1u);
  const auto& c = plan.descriptors()[0];
  EXPECT_EQ(c.rows, 10000u);
  EXPECT_EQ(c.src_pitch, 8192u);
  EXPECT_EQ(c.dst_pitch, 4096u);
}

TEST(CopyPlan, InterleavedDestinationsAreNotOverlaps) {
  // gate/up re-interleave: two 2-D descriptors whose destination rows alternate.
  std::vector<CopyDescriptor> d = {{0, 0, 4, 16, 16, 32}, {64, 16, 4, 16, 16, 32}};
  CopyPlan plan(d);
  EXPECT_EQ(plan.bytes(), 128u);
  EXPECT_EQ(plan.dst_extent(), 128u);
}

TEST(CopyPlan, RejectsBadDescriptorsNamingThem) {
  EXPECT_EQ(code_of([] { CopyPlan({{0, 0, 0, 8, 8, 8}}); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([] { CopyPlan({{0, 0, 1, 0, 0, 0}}); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([] { CopyPlan({{0, 0, 2, 16, 8, 16}}); }), Code::kInvalidArgument);  // src pitch < row
  try {
    CopyPlan({{0, 0, 1, 64, 64, 64}, {100, 32, 1, 64, 64, 64}});
    FAIL() << "expected overlap error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(e.message().find("descriptors 0 and 1"), std::string::npos) << e.message();
  }
  CopyPlan ok({{0, 0, 1, 64, 64, 64}});
  EXPECT_EQ(code_of([&] { ok.check_bounds(63, 64); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { ok.check_bounds(64, 10); }), Code::kInvalidArgument);
  ok.check_bounds(64, 64);
}

TEST(CopyPlan, RandomPlansMatchTheByteByByteReference) {
  std::mt19937_64 rng(7);
  auto rt = make_host_runtime();
  for (int trial = 0; trial < 50; ++trial) {
    // Random non-overlapping destination rows, random (possibly overlapping) source rows.
    std::vector<CopyDescriptor> descs;
    uint64_t dst_pos = 0;
    int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      uint64_t rows = 1 + rng() % 5, row = 1 + rng() % 40, gap = rng() % 3 == 0 ? 0 : rng() % 9;
      uint64_t dpitch = row + (rng() % 2 ? 0 : rng() % 7);
      descs.push_back({rng() % 500, dst_pos, rows, row, row + rng() % 20, dpitch});
      dst_pos += rows * dpitch + gap;
    }
    std::shuffle(descs.begin(), descs.end(), rng);
    std::vector<uint8_t> src(1000), dst(dst_pos + 8, 0xEE);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    CopyPlan plan(descs);
    EXPECT_LE(plan.descriptors().size(), descs.size());
    auto want = reference(descs, src, dst);
    rt->plan_async(plan.descriptors().data(), plan.descriptors().size(), reinterpret_cast<char*>(dst.data()),
                   reinterpret_cast<const char*>(src.data()), CopyKind::kHostToHost, nullptr);
    EXPECT_EQ(dst, want) << "trial " << trial;
  }
}

TEST(CopyPlan, LargePlansSplitAcrossThreadsStayExact) {
  auto rt = make_host_runtime();
  // 3 descriptors totalling ~48 MiB, so the host backend splits them across the pool.
  const uint64_t row = 3000, rows = 5000;
  std::vector<uint8_t> src(rows * row * 2 + 100), dst(4 * rows * row + 200, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  std::vector<CopyDescriptor> descs = {{0, 0, rows, row, 2 * row, row},
                                       {row, rows * row, rows, row, 2 * row, row},
                                       {7, 2 * rows * row + 11, 1, 20 << 20, 0, 0}};
  descs[2].row_bytes = src.size() - 7;
  descs[2].src_pitch = descs[2].dst_pitch = descs[2].row_bytes;
  CopyPlan plan(descs);
  auto want = reference(plan.descriptors(), src, dst);
  rt->plan_async(plan.descriptors().data(), plan.descriptors().size(), reinterpret_cast<char*>(dst.data()),
                 reinterpret_cast<const char*>(src.data()), CopyKind::kHostToHost, nullptr);
  EXPECT_TRUE(dst == want);
}
