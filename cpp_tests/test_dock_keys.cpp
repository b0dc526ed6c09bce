// The keyed store of DockCore: partitions, keys, field updates, overwrite, erase and reuse, run-time
// columns, growth, staleness and DP claims (python_tests/test_dock_keyed.py covers the Python API).
#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <thread>
#include <vector>

#include "common/error.h"
#include "dock/dock.h"
#include "test_util.h"

using namespace msrl;
using msrl::testing::code_of;
using namespace msrl::dock;

namespace {

ColumnSpec ragged(const std::string& name, int64_t arena_bytes, bool growable = true) {
  ColumnSpec c{name, DType::kInt64, true, {}, arena_bytes, "", false, true};
  c.growable = growable;
  return c;
}

ColumnSpec scalar(const std::string& name) { return ColumnSpec{name, DType::kFloat32, false, {}, 0, "", false, true}; }

DockConfig config(int64_t capacity = 8, int64_t group = 1) {
  DockConfig cfg;
  cfg.columns = {ragged("tokens", 64), scalar("reward")};
  cfg.stages = {StageSpec{"update", {"tokens", "reward"}, "tokens"}};
  cfg.capacity = capacity;
  cfg.group_size = group;
  cfg.warehouses = 2;
  return cfg;
}

// One ragged column input of rows with `len` items each (values = row index).
struct Tokens {
  std::vector<int64_t> values, lengths;
  Tokens(size_t n, int64_t len) {
    for (size_t i = 0; i < n; ++i) {
      lengths.push_back(len);
      for (int64_t j = 0; j < len; ++j) values.push_back(static_cast<int64_t>(i) * 1000 + j);
    }
  }
  ColumnInput input(int column) const {
    return ColumnInput{column, values.data(), values.size() * sizeof(int64_t), lengths.data()};
  }
};

std::vector<int64_t> gather_tokens(DockCore& d, const std::vector<int64_t>& rows) {
  std::vector<int64_t> lens(rows.size());
  d.lengths(0, rows.data(), rows.size(), lens.data());
  std::vector<int64_t> out(static_cast<size_t>(std::accumulate(lens.begin(), lens.end(), int64_t{0})));
  d.gather(0, rows.data(), rows.size(), out.data(), out.size() * sizeof(int64_t));
  return out;
}

}  // namespace

TEST(DockKeys, KeysArePerPartitionAndFieldsAreAddedLater) {
  DockCore d(config());
  const int a = d.partition("a", true), b = d.partition("b", true);
  Tokens t(2, 3);
  auto ra = d.put_keys(a, {"sx", "i1"}, {t.input(0)}, false, {}, {});
  auto rb = d.put_keys(b, {"sx"}, {Tokens(1, 2).input(0)}, false, {}, {});
  EXPECT_NE(ra[0], rb[0]);
  EXPECT_EQ(d.rows_of(a, {"i1", "sx"}), (std::vector<int64_t>{ra[1], ra[0]}));
  EXPECT_EQ(d.keys_of(a, ra.data(), 2), (std::vector<std::string>{"sx", "i1"}));
  EXPECT_EQ(code_of([&] { d.rows_of(b, {"i1"}); }), Code::kNotFound);
  EXPECT_EQ(d.controller(0, a).progress().ready_rows, 0);
  float r = 1;
  d.put_keys(a, {"i1"}, {ColumnInput{1, &r, sizeof r, nullptr}}, false, {}, {});
  EXPECT_EQ(d.controller(0, a).progress().ready_rows, 1);
  EXPECT_EQ(d.controller(0, b).progress().ready_rows, 0);
  uint64_t epoch = 0, id = 0;
  auto got = d.claim_in(a, 0, 8, 0, 0.0, &epoch, 0, &id, Controller::kAnyVersion);
  EXPECT_EQ(got, (std::vector<int64_t>{ra[1]}));
  EXPECT_EQ(code_of([&] { d.partition("nope", false); }), Code::kNotFound);
}

TEST(DockKeys, RewriteNeedsOverwriteAndNothingChangesOnError) {
  DockCore d(config());
  const int p = d.partition("p", true);
  Tokens t(1, 3);
  auto rows = d.put_keys(p, {"sk"}, {t.input(0)}, false, {}, {});
  EXPECT_EQ(code_of([&] { d.put_keys(p, {"sk"}, {Tokens(1, 5).input(0)}, false, {}, {}); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              d.put_keys(p, {"sn", "sn"}, {Tokens(2, 1).input(0)}, false, {}, {});
            }),
            Code::kInvalidArgument);
  EXPECT_EQ(gather_tokens(d, rows), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(d.list_keys(p).keys.size(), 1u);
  EXPECT_EQ(d.allocated_rows(), 1);
  Tokens t2(1, 5);
  d.put_keys(p, {"sk"}, {t2.input(0)}, true, {}, {});
  EXPECT_EQ(gather_tokens(d, rows), (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(DockKeys, EraseReusesRowsAndGrownChunksGoBack) {
  DockCore d(config(4));
  const int p = d.partition("p", true);
  const int64_t base = d.warehouse(0).column_stats(0).arena_bytes + d.warehouse(1).column_stats(0).arena_bytes;
  Tokens big(4, 40);  // 4 x 320 bytes into 64-byte arenas: they grow
  auto rows = d.put_keys(p, {"i0", "i1", "i2", "i3"}, {big.input(0)}, false, {}, {});
  EXPECT_EQ(gather_tokens(d, rows), big.values);
  EXPECT_EQ(code_of([&] { d.put_keys(p, {"i9"}, {Tokens(1, 1).input(0)}, false, {}, {}); }), Code::kOutOfMemory);
  d.erase_keys(p, {"i0", "i1", "i2", "i3"});
  EXPECT_EQ(d.allocated_rows(), 0);
  EXPECT_EQ(d.warehouse(0).column_stats(0).arena_bytes + d.warehouse(1).column_stats(0).arena_bytes, base);
  auto again = d.put_keys(p, {"sa", "sb", "sc", "sd"}, {Tokens(4, 2).input(0)}, false, {}, {});
  std::sort(again.begin(), again.end());
  EXPECT_EQ(again, (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(DockKeys, AStatedBoundDoesNotGrow) {
  DockConfig cfg = config();
  cfg.columns[0] = ragged("tokens", 64, false);
  DockCore d(std::move(cfg));
  const int p = d.partition("p", true);
  EXPECT_EQ(code_of([&] { d.put_keys(p, {"i0"}, {Tokens(1, 9).input(0)}, false, {}, {}); }), Code::kOutOfMemory);
  EXPECT_EQ(d.list_keys(p).keys.size(), 0u);
  EXPECT_EQ(d.allocated_rows(), 0);
}

TEST(DockKeys, RunTimeColumnsAgreeUnderConcurrentFirstPuts) {
  DockConfig cfg = config(64);
  cfg.stages = {StageSpec{"s", {"later"}, ""}};  // a stage reading a column declared later
  DockCore d(std::move(cfg));
  std::atomic<int> ok{0}, refused{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      ColumnSpec c{"later", i % 2 ? DType::kFloat32 : DType::kInt32, false, {}, 0, "", false, true};
      try {
        d.declare_column(c);
        ++ok;
      } catch (const Error&) {
        ++refused;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4);
  EXPECT_EQ(refused.load(), 4);
  const int c = d.column_index("later");
  const int p = d.partition("p", true);
  const int32_t v = 7;
  const float f = 7;
  const void* src = d.column(c).dtype == DType::kInt32 ? static_cast<const void*>(&v) : static_cast<const void*>(&f);
  d.put_keys(p, {"i0"}, {ColumnInput{c, src, 4, nullptr}}, false, {}, {});
  EXPECT_EQ(d.controller(0, p).progress().ready_rows, 1);  // the stage counts the column declared later
}

TEST(DockKeys, StalenessSkipsOldGroupsAndDpSharesAreBalanced) {
  DockCore d(config(8, 2));
  const int p = d.partition("p", true);
  std::vector<float> r(8, 1.0f);
  Tokens t(8, 1);
  t.lengths = {9, 9, 1, 1, 4, 4, 2, 2};
  t.values.assign(32, 0);
  d.put_keys(p, {"i0", "i1", "i2", "i3", "i4", "i5", "i6", "i7"},
             {t.input(0), ColumnInput{1, r.data(), r.size() * sizeof(float), nullptr}}, false, {},
             {1, 1, 5, 5, 5, 5, 5, 5});
  uint64_t e = 0, id = 0;
  auto fresh = d.claim_in(p, 0, 2, 0, 0.0, &e, 0, &id, 4);
  EXPECT_EQ(d.keys_of(p, fresh.data(), fresh.size()), (std::vector<std::string>{"i2", "i3"}));
  std::vector<std::vector<int64_t>> shares;
  for (int rank = 0; rank < 2; ++rank)
    for (int tp = 0; tp < 2; ++tp) shares.push_back(d.claim_dp(p, 0, "b0", rank, 2, 2, 4, 0, 0.0, &e, &id, 0));
  EXPECT_EQ(shares[0], shares[1]);
  EXPECT_EQ(shares[2], shares[3]);
  std::vector<int64_t> all = shares[0];
  all.insert(all.end(), shares[2].begin(), shares[2].end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all.size(), 6u);  // the three groups left, none twice
  EXPECT_TRUE(std::adjacent_find(all.begin(), all.end()) == all.end());
}

TEST(DockKeys, EraseRacingFetchesNeverFreesBytesBeingCopied) {
  DockCore d(config(64));
  const int p = d.partition("p", true);
  std::atomic<bool> stop{false};
  std::atomic<int> copies{0};
  std::vector<std::string> keys;
  for (int i = 0; i < 32; ++i) keys.push_back("i" + std::to_string(i));
  Tokens t(32, 16);
  auto rows = d.put_keys(p, keys, {t.input(0)}, false, {}, {});
  const std::vector<int64_t> first = rows;
  std::thread reader([&] {
    std::vector<int64_t> out(16);
    while (!stop.load()) {
      for (int64_t r : first) {
        try {
          d.gather(0, &r, 1, out.data(), out.size() * sizeof(int64_t));
          ++copies;
        } catch (const Error&) {  // erased meanwhile, or refilled with other lengths
        }
      }
    }
  });
  for (int round = 0; round < 20; ++round) {
    d.erase_keys(p, keys);
    rows = d.put_keys(p, keys, {Tokens(32, 16).input(0)}, false, {}, {});
  }
  stop.store(true);
  reader.join();
  EXPECT_EQ(d.list_keys(p).keys.size(), 32u);
}

TEST(DockKeys, IdsOfADroppedPartitionAreRefusedAfterItsSlotIsReused) {
  DockCore d(config());
  const int a = d.partition("a", true);
  d.put_keys(a, {"i0"}, {Tokens(1, 1).input(0)}, false, {}, {});
  d.drop_partition(a);
  EXPECT_EQ(code_of([&] { d.rows_of(a, {"i0"}); }), Code::kNotFound);
  const int b = d.partition("b", true);  // the same slot, another generation
  EXPECT_NE(a, b);
  EXPECT_EQ(code_of([&] { d.put_keys(a, {"i1"}, {Tokens(1, 1).input(0)}, false, {}, {}); }), Code::kNotFound);
  d.put_keys(b, {"i1"}, {Tokens(1, 1).input(0)}, false, {}, {});
  EXPECT_EQ(d.partition("b", false), b);
  EXPECT_EQ(d.allocated_rows(), 1);
}

TEST(DockKeys, DpSharesHoldWholeGroupsWhenMaxRowsIsNotAMultipleOfTheGroup) {
  DockCore d(config(8, 2));
  const int p = d.partition("p", true);
  std::vector<float> r(8, 1.0f);
  Tokens t(8, 1);
  d.put_keys(p, {"i0", "i1", "i2", "i3", "i4", "i5", "i6", "i7"},
             {t.input(0), ColumnInput{1, r.data(), r.size() * sizeof(float), nullptr}}, false, {}, {});
  uint64_t e = 0, id = 0;
  auto s0 = d.claim_dp(p, 0, "b", 0, 2, 1, 3, 0, 0.0, &e, &id, Controller::kAnyVersion);  // 3 rows: one group each
  auto s1 = d.claim_dp(p, 0, "b", 1, 2, 1, 3, 0, 0.0, &e, &id, Controller::kAnyVersion);
  EXPECT_EQ(s0.size(), 2u);
  EXPECT_EQ(s1.size(), 2u);
  EXPECT_EQ(d.controller(0, p).progress().ready_rows, 4);  // the rest stays for the next round
}
