#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "common/error.h"
#include "dock/warehouse.h"

using namespace msrl;
using namespace msrl::dock;

namespace {

std::vector<ColumnSpec> two_columns(int64_t arena_bytes = 1 << 16) {
  ColumnSpec tokens{"tokens", DType::kInt64, true, {}, arena_bytes, "", false, true};
  ColumnSpec reward{"reward", DType::kFloat32, false, {}, 0, "", false, true};
  return {tokens, reward};
}

Code code_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no msrl::Error thrown";
  return Code::kUnavailable;
}

}  // namespace

TEST(Warehouse, OneDtypeTableNamesSizesAndParses) {
  ASSERT_EQ(dtype_table().size(), 7u);
  for (const auto& t : dtype_table()) {
    EXPECT_EQ(parse_dtype(t.name), t.code);
    EXPECT_STREQ(dtype_name(t.code), t.name);
    EXPECT_EQ(dtype_size(t.code), t.size);
  }
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(code_of([] { parse_dtype("float64"); }), Code::kInvalidArgument);
}

TEST(Warehouse, RaggedPutGatherRoundTrip) {
  Warehouse w(0, 100, 8, two_columns());
  std::vector<int64_t> rows = {103, 100, 101};
  std::vector<int64_t> lens = {3, 0, 2};
  std::vector<int64_t> vals = {1, 2, 3, 4, 5};
  w.put(0, rows.data(), rows.size(), vals.data(), lens.data());

  std::vector<int64_t> got_lens(3);
  std::vector<int64_t> order = {100, 101, 103};
  w.lengths(0, order.data(), 3, got_lens.data());
  EXPECT_EQ(got_lens, (std::vector<int64_t>{0, 2, 3}));
  std::vector<int64_t> out(5);
  w.gather(0, order.data(), 3, out.data(), out.size() * 8);
  EXPECT_EQ(out, (std::vector<int64_t>{4, 5, 1, 2, 3}));
  EXPECT_EQ(w.column_stats(0).rows_written, 3);
  EXPECT_EQ(w.bytes_held(), 40);
}

TEST(Warehouse, FixedShapeColumnAndPadded) {
  ColumnSpec emb{"emb", DType::kFloat32, false, {2, 3}, 0, "", false, true};
  Warehouse w(1, 0, 4, {emb});
  std::vector<float> src(2 * 6);
  std::iota(src.begin(), src.end(), 0.f);
  std::vector<int64_t> rows = {2, 0};
  w.put(0, rows.data(), 2, src.data(), nullptr);
  std::vector<float> out(12);
  std::vector<int64_t> order = {0, 2};
  w.gather(0, order.data(), 2, out.data(), out.size() * 4);
  EXPECT_EQ(out[0], 6.f);
  EXPECT_EQ(out[6], 0.f);
  EXPECT_EQ(out[11], 5.f);
}

TEST(Warehouse, GatherPaddedZeroFillsTails) {
  Warehouse w(0, 0, 4, two_columns());
  std::vector<int64_t> rows = {0, 1};
  std::vector<int64_t> lens = {1, 3};
  std::vector<int64_t> vals = {7, 8, 9, 10};
  w.put(0, rows.data(), 2, vals.data(), lens.data());
  std::vector<int64_t> out(2 * 4, -1);
  w.gather_padded(0, rows.data(), 2, 4, out.data());
  EXPECT_EQ(out, (std::vector<int64_t>{7, 0, 0, 0, 8, 9, 10, 0}));
  EXPECT_EQ(code_of([&] { w.gather_padded(0, rows.data(), 2, 2, out.data()); }), Code::kInvalidArgument);
}

TEST(Warehouse, OverflowFailsWithOutOfMemoryAndKeepsRows) {
  Warehouse w(0, 0, 8, two_columns(/*arena_bytes=*/64));  // 8 int64 items
  std::vector<int64_t> rows = {0};
  std::vector<int64_t> lens = {6};
  std::vector<int64_t> vals = {1, 2, 3, 4, 5, 6};
  w.put(0, rows.data(), 1, vals.data(), lens.data());
  std::vector<int64_t> rows2 = {1, 2};
  std::vector<int64_t> lens2 = {1, 2};
  try {
    std::vector<int64_t> v(3, 9);
    w.put(0, rows2.data(), 2, v.data(), lens2.data());
    FAIL() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kOutOfMemory);
    EXPECT_NE(e.message().find("tokens"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("24 bytes"), std::string::npos) << e.message();
  }
  // Row 0 intact, rows 1 and 2 still writable.
  std::vector<int64_t> out(6);
  w.gather(0, rows.data(), 1, out.data(), 48);
  EXPECT_EQ(out, vals);
  EXPECT_FALSE(w.ready(0, rows2.data(), 2));
  std::vector<int64_t> lens3 = {1, 1};
  std::vector<int64_t> v3 = {11, 12};
  w.put(0, rows2.data(), 2, v3.data(), lens3.data());
  EXPECT_TRUE(w.ready(0, rows2.data(), 2));
}

TEST(Warehouse, BadRowsAreRejectedWithoutChanges) {
  Warehouse w(0, 10, 4, two_columns());
  std::vector<float> r = {1.f, 2.f};
  std::vector<int64_t> out_of_range = {10, 14};
  EXPECT_EQ(code_of([&] { w.put(1, out_of_range.data(), 2, r.data(), nullptr); }), Code::kInvalidArgument);
  std::vector<int64_t> dup = {11, 11};
  EXPECT_EQ(code_of([&] { w.put(1, dup.data(), 2, r.data(), nullptr); }), Code::kInvalidArgument);
  std::vector<int64_t> ok = {10, 11};
  EXPECT_FALSE(w.ready(1, ok.data(), 2));
  w.put(1, ok.data(), 2, r.data(), nullptr);
  // Written once per iteration.
  EXPECT_EQ(code_of([&] { w.put(1, ok.data(), 2, r.data(), nullptr); }), Code::kInvalidArgument);
  std::vector<int64_t> not_written = {12};
  float f;
  EXPECT_EQ(code_of([&] { w.gather(1, not_written.data(), 1, &f, 4); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { (void)w.column_index("nope"); }), Code::kNotFound);
  std::vector<int64_t> neg = {-1};
  std::vector<int64_t> v = {1};
  EXPECT_EQ(code_of([&] { w.put(0, ok.data(), 1, v.data(), neg.data()); }), Code::kInvalidArgument);
}

TEST(Warehouse, AbortReturnsRowsAndTailSpace) {
  Warehouse w(0, 0, 4, two_columns(64));
  std::vector<int64_t> rows = {0, 1};
  std::vector<int64_t> lens = {4, 4};
  Reservation r = w.reserve(0, rows.data(), 2, lens.data());
  EXPECT_EQ(w.column_stats(0).bytes_used, 64);
  w.abort(r);
  EXPECT_EQ(w.column_stats(0).bytes_used, 0);
  std::vector<int64_t> v(8, 3);
  w.put(0, rows.data(), 2, v.data(), lens.data());  // the space came back
  EXPECT_TRUE(w.ready(0, rows.data(), 2));
}

TEST(Warehouse, ResetClearsAndReusesArena) {
  Warehouse w(0, 0, 2, two_columns(32));
  std::vector<int64_t> rows = {0};
  std::vector<int64_t> lens = {4};
  std::vector<int64_t> v = {1, 2, 3, 4};
  w.put(0, rows.data(), 1, v.data(), lens.data());
  w.reset();
  EXPECT_FALSE(w.ready(0, rows.data(), 1));
  EXPECT_EQ(w.bytes_held(), 0);
  std::vector<int64_t> v2 = {5, 6, 7, 8};
  w.put(0, rows.data(), 1, v2.data(), lens.data());
  std::vector<int64_t> out(4);
  w.gather(0, rows.data(), 1, out.data(), 32);
  EXPECT_EQ(out, v2);
}

TEST(Warehouse, EraseForgetsWrittenRows) {
  Warehouse w(0, 0, 4, two_columns());
  std::vector<int64_t> rows = {0, 1};
  std::vector<float> v = {1.f, 2.f};
  w.put(1, rows.data(), 2, v.data(), nullptr);
  std::vector<int64_t> first = {0, 3};  // row 3 was never written: ignored
  w.erase(1, first.data(), 2);
  EXPECT_FALSE(w.ready(1, rows.data(), 1));
  EXPECT_TRUE(w.ready(1, rows.data() + 1, 1));
  EXPECT_EQ(w.column_stats(1).rows_written, 1);
  w.put(1, rows.data(), 1, v.data(), nullptr);  // writable again
  std::vector<int64_t> outside = {9};
  EXPECT_EQ(code_of([&] { w.erase(1, outside.data(), 1); }), Code::kInvalidArgument);
}

TEST(Warehouse, ExternalArenaIsUsedAndLocateGivesOffsets) {
  ColumnSpec tok{"tok", DType::kInt32, true, {}, 64, "", false, true};
  ColumnSpec r{"r", DType::kFloat32, false, {}, 0, "", false, true};
  std::vector<uint8_t> mem_tok(64), mem_r(4 * 4);
  Warehouse w(0, 0, 4, {tok, r}, {mem_tok.data(), mem_r.data()});
  EXPECT_EQ(w.arena_capacity(0), 64);
  EXPECT_EQ(w.arena_capacity(1), 16);
  std::vector<int64_t> rows = {2, 0};
  std::vector<int64_t> lens = {2, 3};
  std::vector<int32_t> v = {1, 2, 3, 4, 5};
  w.put(0, rows.data(), 2, v.data(), lens.data());
  float f = 2.5f;
  int64_t row3 = 3;
  w.put(1, &row3, 1, &f, nullptr);
  std::vector<int64_t> offs(2), got_lens(2);
  w.locate(0, rows.data(), 2, offs.data(), got_lens.data());
  EXPECT_EQ(offs, (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(got_lens, lens);
  int32_t first;
  std::memcpy(&first, mem_tok.data() + offs[1], 4);
  EXPECT_EQ(first, 3);  // the bytes live in the caller's memory
  float got;
  std::memcpy(&got, mem_r.data() + 12, 4);
  EXPECT_EQ(got, 2.5f);
  int64_t row1 = 1;
  EXPECT_EQ(code_of([&] { w.locate(0, &row1, 1, offs.data(), got_lens.data()); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { Warehouse bad(0, 0, 4, {tok, r}, {mem_tok.data()}); }), Code::kInvalidArgument);
}

TEST(Warehouse, ExternalArenaResizedKeepsItsBytesAndRefusesBelowTheBytesInUse) {
  ColumnSpec tok{"tok", DType::kInt32, true, {}, 16, "", true, true};
  ColumnSpec r{"r", DType::kFloat32, false, {}, 0, "", false, true};
  std::vector<uint8_t> small(16), r_mem(4 * 4);
  Warehouse w(0, 0, 4, {tok, r}, {small.data(), r_mem.data()});
  std::vector<int64_t> rows = {0, 1};
  std::vector<int64_t> lens = {1, 2};
  std::vector<int32_t> v = {7, 8, 9};
  w.put(0, rows.data(), 2, v.data(), lens.data());
  int64_t row2 = 2, four = 4;
  std::vector<int32_t> big_row = {1, 2, 3, 4};
  EXPECT_EQ(code_of([&] { w.put(0, &row2, 1, big_row.data(), &four); }), Code::kOutOfMemory);
  std::vector<uint8_t> big(64);
  std::memcpy(big.data(), small.data(), small.size());  // the caller's grown memory: same bytes, same offsets
  EXPECT_EQ(code_of([&] { w.resize_external(0, big.data(), 8); }), Code::kInvalidArgument);     // 12 in use
  EXPECT_EQ(code_of([&] { w.resize_external(1, r_mem.data(), 32); }), Code::kInvalidArgument);  // fixed column
  EXPECT_EQ(w.arena_capacity(0), 16);
  w.resize_external(0, big.data(), 64);
  EXPECT_EQ(w.arena_capacity(0), 64);
  w.put(0, &row2, 1, big_row.data(), &four);
  std::vector<int32_t> out(7);
  std::vector<int64_t> all = {0, 1, 2};
  w.gather(0, all.data(), 3, out.data(), out.size() * 4);
  EXPECT_EQ(out, (std::vector<int32_t>{7, 8, 9, 1, 2, 3, 4}));
  w.reset();
  w.resize_external(0, small.data(), 16);  // empty again: back to the configured arena
  EXPECT_EQ(w.arena_capacity(0), 16);
}

TEST(Warehouse, ResetRefusedWhileAPutIsInFlight) {
  Warehouse w(0, 0, 2, two_columns());
  std::vector<int64_t> rows = {0};
  std::vector<int64_t> lens = {1};
  Reservation r = w.reserve(0, rows.data(), 1, lens.data());
  EXPECT_EQ(code_of([&] { w.reset(); }), Code::kInvalidArgument);
  w.abort(r);
  w.reset();
}

TEST(Warehouse, LargePutUsesPoolAndIsExact) {
  const int64_t n = 64, len = 16384;  // 8 MiB of int64
  Warehouse w(0, 0, n, two_columns(n * len * 8));
  std::vector<int64_t> rows(n), lens(n, len);
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<int64_t> vals(n * len);
  std::iota(vals.begin(), vals.end(), 0);
  w.put(0, rows.data(), n, vals.data(), lens.data());
  std::vector<int64_t> rev(rows.rbegin(), rows.rend());
  std::vector<int64_t> out(n * len);
  w.gather(0, rev.data(), n, out.data(), out.size() * 8);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i * len], (n - 1 - i) * len);
    ASSERT_EQ(out[i * len + len - 1], (n - 1 - i) * len + len - 1);
  }
}

TEST(Warehouse, ConcurrentPutsToDistinctRows) {
  const int threads = 4, per = 64;
  Warehouse w(0, 0, threads * per, two_columns(threads * per * 8 * 8));
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < per; ++i) {
        int64_t row = t * per + i;
        int64_t len = 1 + row % 8;
        std::vector<int64_t> v(len, row);
        w.put(0, &row, 1, v.data(), &len);
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int64_t row = 0; row < threads * per; ++row) {
    int64_t len;
    w.lengths(0, &row, 1, &len);
    ASSERT_EQ(len, 1 + row % 8);
    std::vector<int64_t> out(len);
    w.gather(0, &row, 1, out.data(), len * 8);
    for (int64_t x : out) ASSERT_EQ(x, row);
  }
}

TEST(Warehouse, PartialResetCompactsKeptRaggedRowsAndFreesTheRest) {
  Warehouse w(0, 10, 6, two_columns(/*arena_bytes=*/8 * 10));
  // Rows 10..15 written in that order: lengths 2,1,3,0,2,1 (9 items, 72 bytes of 80).
  std::vector<int64_t> rows = {10, 11, 12, 13, 14, 15};
  std::vector<int64_t> lens = {2, 1, 3, 0, 2, 1};
  std::vector<int64_t> vals = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  w.put(0, rows.data(), rows.size(), vals.data(), lens.data());
  std::vector<float> rw = {0.5f, 1.5f};
  std::vector<int64_t> rrows = {12, 14};
  w.put(1, rrows.data(), 2, rw.data(), nullptr);

  w.reset(std::vector<int64_t>{14, 12, 13});  // keep rows 12 (3 items), 13 (empty) and 14 (2 items)
  EXPECT_EQ(w.column_stats(0).rows_written, 3);
  EXPECT_EQ(w.column_stats(0).bytes_used, 5 * 8);
  EXPECT_EQ(w.column_stats(1).rows_written, 2);
  std::vector<int64_t> kept = {12, 13, 14};
  std::vector<int64_t> offs(3), got_lens(3);
  w.locate(0, kept.data(), 3, offs.data(), got_lens.data());
  EXPECT_EQ(offs, (std::vector<int64_t>{0, 24, 24}));  // moved to the front, offset order kept
  EXPECT_EQ(got_lens, (std::vector<int64_t>{3, 0, 2}));
  std::vector<int64_t> out(5);
  w.gather(0, kept.data(), 3, out.data(), 40);
  EXPECT_EQ(out, (std::vector<int64_t>{4, 5, 6, 7, 8}));
  std::vector<float> rout(2);
  w.gather(1, rrows.data(), 2, rout.data(), 8);
  EXPECT_EQ(rout, rw);
  // Dropped rows are writable again and the freed arena bytes are usable: 5 items free of 10.
  EXPECT_FALSE(w.ready(0, rows.data(), 1));
  std::vector<int64_t> fresh = {10, 11};
  std::vector<int64_t> flens = {4, 1};
  std::vector<int64_t> fvals = {20, 21, 22, 23, 24};
  w.put(0, fresh.data(), 2, fvals.data(), flens.data());
  std::vector<int64_t> all = {10, 11, 12, 14};
  std::vector<int64_t> out2(10);
  w.gather(0, all.data(), 4, out2.data(), 80);
  EXPECT_EQ(out2, (std::vector<int64_t>{20, 21, 22, 23, 24, 4, 5, 6, 7, 8}));
  // A kept row stays written: writing it again is refused.
  std::vector<int64_t> one = {12};
  std::vector<int64_t> l0 = {0};
  EXPECT_EQ(code_of([&] { w.put(0, one.data(), 1, nullptr, l0.data()); }), Code::kInvalidArgument);
}

TEST(Warehouse, PartialResetRejectsForeignRowsAndWritesInFlightChangingNothing) {
  Warehouse w(0, 0, 4, two_columns());
  std::vector<int64_t> rows = {0, 1};
  std::vector<int64_t> lens = {1, 1};
  std::vector<int64_t> vals = {7, 8};
  w.put(0, rows.data(), 2, vals.data(), lens.data());
  EXPECT_EQ(code_of([&] { w.reset(std::vector<int64_t>{1, 9}); }), Code::kInvalidArgument);
  std::vector<int64_t> two = {2};
  Reservation r = w.reserve(0, two.data(), 1, lens.data());
  EXPECT_EQ(code_of([&] { w.reset(std::vector<int64_t>{1}); }), Code::kInvalidArgument);
  w.abort(r);
  std::vector<int64_t> out(2);
  w.gather(0, rows.data(), 2, out.data(), 16);  // both rows still there
  EXPECT_EQ(out, vals);
}
