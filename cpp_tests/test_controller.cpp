#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "common/error.h"
#include "dock/controller.h"
#include "dock/dock.h"

using namespace msrl;
using namespace msrl::dock;

namespace {

Code code_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no msrl::Error thrown";
  return Code::kUnavailable;
}

// The code of the msrl::Error fn throws, or Code{0} when it returns.
Code code_of_or_ok(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return Code{0};
}

void mark(Controller& c, int col, std::vector<int64_t> rows) { c.mark_ready(col, rows.data(), rows.size()); }

}  // namespace

TEST(Controller, GroupIsClaimableOnlyWhenAllRowsHaveAllInputs) {
  Controller c("ref", 8, 4, {0, 2});
  mark(c, 0, {0, 1, 2, 3});
  EXPECT_TRUE(c.claim(8, 0, 0).empty());
  mark(c, 2, {0, 1, 2});
  mark(c, 1, {3});  // a column this stage does not read
  EXPECT_TRUE(c.claim(8, 0, 0).empty());
  mark(c, 2, {3});
  EXPECT_EQ(c.claim(8, 0, 0), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_TRUE(c.claim(8, 0, 0).empty());  // exactly once
  EXPECT_EQ(c.progress().consumed_rows, 4);
}

TEST(Controller, FifoByReadinessAndMaxRowsInWholeGroups) {
  Controller c("s", 12, 2, {0});
  mark(c, 0, {4, 5});
  mark(c, 0, {0, 1});
  mark(c, 0, {10, 11});
  EXPECT_EQ(c.claim(5, 0, 0), (std::vector<int64_t>{4, 5, 0, 1}));  // 5 rows -> 2 groups
  EXPECT_EQ(c.claim(2, 0, 0), (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(code_of([&] { c.claim(1, 0, 0); }), Code::kInvalidArgument);  // less than a group
  EXPECT_EQ(code_of([&] { c.claim(4, 6, 0); }), Code::kInvalidArgument);  // min > max
  EXPECT_EQ(code_of([&] { c.claim(4, 2, -1); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { mark(c, 0, {12}); }), Code::kInvalidArgument);
}

TEST(Controller, LengthBalancedClaimsStopAtTheItemBudget) {
  Controller c("s", 8, 2, {0}, /*length_column=*/1);  // balance by column 1, which it does not read
  std::vector<int64_t> rows = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int64_t> lens = {100, 100, 10, 10, 10, 10, 300, 300};
  c.mark_ready(1, rows.data(), rows.size(), lens.data());
  c.mark_ready(0, rows.data(), rows.size());
  EXPECT_EQ(c.claim(8, 0, 0, nullptr, 230), (std::vector<int64_t>{0, 1, 2, 3}));  // 200 + 20 fits, +20 not
  EXPECT_EQ(c.claim(8, 0, 0, nullptr, 30), (std::vector<int64_t>{4, 5}));         // 20 fits
  EXPECT_EQ(c.claim(8, 0, 0, nullptr, 30), (std::vector<int64_t>{6, 7}));         // always one group
  EXPECT_TRUE(c.claim(8, 0, 0, nullptr, 30).empty());
}

TEST(Controller, MarkReadyIsIdempotent) {
  Controller c("s", 4, 2, {0});
  mark(c, 0, {0, 1});
  mark(c, 0, {0, 1});
  EXPECT_EQ(c.claim(4, 0, 0).size(), 2u);
  EXPECT_TRUE(c.claim(4, 0, 0).empty());
}

TEST(Controller, NonBlockingClaimWithMinRowsTimesOutAndClaimsNothing) {
  Controller c("s", 8, 2, {0});
  mark(c, 0, {0, 1});
  EXPECT_EQ(code_of([&] { c.claim(8, 4, 0); }), Code::kTimeout);
  EXPECT_EQ(c.progress().ready_rows, 2);
  EXPECT_EQ(c.claim(8, 2, 0).size(), 2u);
}

TEST(Controller, BlockingClaimWakesOnMarkReady) {
  Controller c("s", 8, 2, {0});
  std::vector<int64_t> got;
  std::chrono::steady_clock::time_point woke;
  std::thread waiter([&] {
    got = c.claim(4, 4, 10.0);
    woke = std::chrono::steady_clock::now();
  });
  while (c.progress().waiting_claims == 0) std::this_thread::yield();
  mark(c, 0, {2, 3});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(got.empty());  // min_rows = 4 not reached yet
  auto put_time = std::chrono::steady_clock::now();
  mark(c, 0, {6, 7});
  waiter.join();
  EXPECT_EQ(got, (std::vector<int64_t>{2, 3, 6, 7}));
  EXPECT_GE(woke, put_time);
}

TEST(Controller, BlockingClaimTimesOut) {
  Controller c("s", 4, 2, {0});
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(code_of([&] { c.claim(2, 2, 0.05); }), Code::kTimeout);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(50));
  EXPECT_EQ(c.progress().waiting_claims, 0);
}

TEST(Controller, MinRowsZeroWaitsThenReturnsEmpty) {
  Controller c("s", 4, 2, {0});
  EXPECT_TRUE(c.claim(2, 0, 0.01).empty());
}

TEST(Controller, ResetKeepsWaitersForTheNextIterationAndCloseWakesThem) {
  Controller c("s", 4, 2, {0});
  std::vector<int64_t> got;
  uint64_t epoch = 99;
  std::thread waiter([&] { got = c.claim(2, 2, 30.0, &epoch); });
  while (c.progress().waiting_claims == 0) std::this_thread::yield();
  c.reset();  // the waiter keeps waiting
  EXPECT_EQ(c.epoch(), 1u);
  mark(c, 0, {2, 3});
  waiter.join();
  EXPECT_EQ(got, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(epoch, 1u);

  Code waiter_code = Code::kUnavailable;
  std::thread w2([&] { waiter_code = code_of([&] { c.claim(2, 2, 30.0); }); });
  while (c.progress().waiting_claims == 0) std::this_thread::yield();
  c.close();
  w2.join();
  EXPECT_EQ(waiter_code, Code::kClosed);
  EXPECT_EQ(code_of([&] { c.claim(2, 0, 0); }), Code::kClosed);
}

TEST(Controller, ReleaseMakesGroupsClaimableAgain) {
  Controller c("s", 8, 2, {0});
  mark(c, 0, {0, 1, 2, 3});
  auto rows = c.claim(4, 0, 0);
  ASSERT_EQ(rows.size(), 4u);
  std::vector<int64_t> bad = {1, 2};
  EXPECT_EQ(code_of([&] { c.release(bad.data(), 2); }), Code::kInvalidArgument);
  std::vector<int64_t> g1 = {2, 3};
  c.release(g1.data(), 2);
  EXPECT_EQ(c.claim(8, 0, 0), g1);
  std::vector<int64_t> not_claimed = {4, 5};
  EXPECT_EQ(code_of([&] { c.release(not_claimed.data(), 2); }), Code::kInvalidArgument);
}

TEST(Controller, ResetClearsEverything) {
  Controller c("s", 4, 2, {0});
  mark(c, 0, {0, 1});
  c.claim(2, 0, 0);
  c.reset();
  EXPECT_EQ(c.progress().consumed_rows, 0);
  EXPECT_FALSE(c.consumed(0));
  EXPECT_TRUE(c.claim(2, 0, 0).empty());
  mark(c, 0, {0, 1});
  EXPECT_EQ(c.claim(2, 0, 0).size(), 2u);
}

// Exactly once under concurrency: producers mark random groups ready in random order while
// consumers claim with random sizes; every row is claimed by exactly one consumer.
TEST(Controller, ConcurrentClaimsNeverOverlapOrLoseRows) {
  const int64_t G = 4, capacity = 4096;
  Controller c("s", capacity, G, {0, 1});
  std::vector<int64_t> order(capacity);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  std::vector<std::atomic<int>> seen(capacity);
  std::atomic<int64_t> claimed{0};
  std::vector<std::thread> ts;
  for (int p = 0; p < 2; ++p) {
    ts.emplace_back([&, p] {
      for (int64_t i = p; i < capacity; i += 2) {
        for (int col = 0; col < 2; ++col) c.mark_ready(col, &order[i], 1);
      }
    });
  }
  for (int k = 0; k < 4; ++k) {
    ts.emplace_back([&, k] {
      std::mt19937 rng(k);
      while (claimed.load() < capacity) {
        int64_t max_rows = G * (1 + rng() % 16);
        std::vector<int64_t> rows;
        try {
          rows = c.claim(max_rows, G, 0.05);
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), Code::kTimeout);
          continue;
        }
        ASSERT_EQ(rows.size() % G, 0u);
        for (int64_t r : rows) seen[r].fetch_add(1);
        claimed.fetch_add(static_cast<int64_t>(rows.size()));
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int64_t r = 0; r < capacity; ++r) ASSERT_EQ(seen[r].load(), 1) << "row " << r;
  EXPECT_EQ(c.progress().consumed_rows, capacity);
}

// ---- DockCore: warehouses + controllers + allocator ----

namespace {
DockConfig small_config(int warehouses = 2) {
  DockConfig cfg;
  cfg.columns = {ColumnSpec{"prompt", DType::kInt64, true, {}, 1 << 16, "", false, true},
                 ColumnSpec{"response", DType::kInt64, true, {}, 1 << 16, "", false, true},
                 ColumnSpec{"reward", DType::kFloat32, false, {}, 0, "", false, true}};
  cfg.stages = {StageSpec{"rollout", {"prompt"}, ""}, StageSpec{"reward", {"prompt", "response"}, "response"},
                StageSpec{"update", {"prompt", "response", "reward"}, ""}};
  cfg.capacity = 16;
  cfg.group_size = 2;
  cfg.warehouses = warehouses;
  return cfg;
}
}  // namespace

TEST(Controller, PartialResetKeepsCompletedClaimsAndReturnsOpenOnes) {
  Controller c("s", 8, 2, {0});
  mark(c, 0, {0, 1, 2, 3, 4, 5});
  auto a = c.claim(2, 2, 0);  // group 0
  auto b = c.claim(2, 2, 0);  // group 1
  c.complete(a.data(), a.size());
  EXPECT_TRUE(c.group_consumed(0));
  EXPECT_FALSE(c.group_consumed(2));
  // Keep groups 0, 1 and 2; drop 3. Group 0's claim was completed, group 1's was not.
  c.reset(std::vector<uint8_t>{1, 1, 1, 0});
  EXPECT_EQ(c.epoch(), 1u);
  EXPECT_TRUE(c.consumed(0));
  EXPECT_FALSE(c.consumed(2));
  EXPECT_EQ(c.progress().consumed_rows, 2);
  EXPECT_EQ(c.progress().ready_rows, 4);
  // The returned group comes first, then the group that was still queued; nothing else is ready.
  EXPECT_EQ(c.claim(8, 0, 0), (std::vector<int64_t>{2, 3, 4, 5}));
  mark(c, 0, {6});  // dropped group 3 starts from scratch: needs both rows again
  EXPECT_TRUE(c.claim(8, 0, 0).empty());
  mark(c, 0, {7});
  EXPECT_EQ(c.claim(8, 0, 0), (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(code_of([&] { c.reset(std::vector<uint8_t>{1}); }), Code::kInvalidArgument);
}

TEST(Controller, PartialResetNeedsEveryRowOfAGroupCompleted) {
  Controller c("s", 4, 2, {0});
  mark(c, 0, {0, 1});
  auto a = c.claim(2, 2, 0);
  std::vector<int64_t> half = {1};
  c.complete(half.data(), 1);
  c.reset(std::vector<uint8_t>{1, 1});
  EXPECT_FALSE(c.consumed(0));
  EXPECT_EQ(c.claim(2, 2, 0), a);
}

TEST(DockCore, StreamsRowsThroughStages) {
  DockCore d(small_config());
  std::vector<int64_t> plens = {2, 2, 3, 3};
  std::vector<int64_t> prompts = {1, 1, 2, 2, 3, 3, 3, 4, 4, 4};
  auto rows = d.put_new({ColumnInput{0, prompts.data(), prompts.size() * 8, plens.data()}}, 4);
  ASSERT_EQ(rows.size(), 4u);
  // Interleaved allocation: the two groups land in different warehouses.
  EXPECT_NE(d.warehouse_of(rows[0]), d.warehouse_of(rows[2]));

  auto got = d.claim(0, 4, 4, 0);
  EXPECT_EQ(got, rows);
  std::vector<int64_t> rlens = {1, 1, 1, 1};
  std::vector<int64_t> resp = {10, 11, 12, 13};
  EXPECT_TRUE(d.claim(1, 4, 0, 0).empty());
  d.put({ColumnInput{1, resp.data(), 32, rlens.data()}}, got.data(), got.size());
  auto r2 = d.claim(1, 4, 4, 0);
  ASSERT_EQ(r2.size(), 4u);
  std::vector<int64_t> lens(4);
  d.lengths(0, r2.data(), 4, lens.data());
  EXPECT_EQ(lens, plens);
  std::vector<int64_t> packed(10);
  d.gather(0, r2.data(), 4, packed.data(), 80);
  EXPECT_EQ(packed, prompts);
  std::vector<int64_t> padded(4 * 3);
  d.gather_padded(0, r2.data(), 4, 3, padded.data());
  EXPECT_EQ(padded, (std::vector<int64_t>{1, 1, 0, 2, 2, 0, 3, 3, 3, 4, 4, 4}));
  EXPECT_EQ(d.claim_stats.count.load(), 3);
  EXPECT_EQ(d.put_stats.rows.load(), 8);
}

TEST(DockCore, PutsRecordLengthsForBalancedStages) {
  DockCore d(small_config());
  std::vector<int64_t> plens = {1, 1, 1, 1};
  std::vector<int64_t> p = {1, 2, 3, 4};
  auto rows = d.put_new({ColumnInput{0, p.data(), 32, plens.data()}}, 4);
  std::vector<int64_t> rlens = {5, 5, 1, 1};
  std::vector<int64_t> resp(12, 7);
  d.put({ColumnInput{1, resp.data(), 96, rlens.data()}}, rows.data(), 4);
  auto first = d.claim(1, 4, 0, 0, nullptr, /*max_items=*/10);  // "reward" balances by "response"
  EXPECT_EQ(first, (std::vector<int64_t>{rows[0], rows[1]}));
  EXPECT_EQ(d.claim(1, 4, 0, 0, nullptr, 10).size(), 2u);
}

TEST(DockCore, FailedMultiColumnPutChangesNothing) {
  DockCore d(small_config());
  std::vector<int64_t> plens = {1, 1};
  std::vector<int64_t> p = {1, 2};
  std::vector<float> rw = {0.5f};  // one reward for two rows: wrong size
  EXPECT_EQ(code_of([&] {
              d.put_new({ColumnInput{0, p.data(), 16, plens.data()}, ColumnInput{2, rw.data(), 4, nullptr}}, 2);
            }),
            Code::kInvalidArgument);
  EXPECT_EQ(d.allocated_rows(), 0);
  // Second column overflows its warehouse arena after the first reserved: both are undone.
  DockConfig cfg = small_config(1);
  cfg.columns[1].arena_bytes = 8;
  DockCore d2(cfg);
  std::vector<int64_t> big = {1, 2, 3, 4};
  std::vector<int64_t> rl = {1, 1};
  std::vector<int64_t> bl = {2, 2};
  EXPECT_EQ(code_of([&] {
              d2.put_new({ColumnInput{0, p.data(), 16, rl.data()}, ColumnInput{1, big.data(), 32, bl.data()}}, 2);
            }),
            Code::kOutOfMemory);
  EXPECT_EQ(d2.allocated_rows(), 0);
  EXPECT_EQ(d2.warehouse(0).bytes_held(), 0);
  EXPECT_TRUE(d2.claim(0, 2, 0, 0).empty());
  auto rows = d2.put_new({ColumnInput{0, p.data(), 16, rl.data()}}, 2);
  EXPECT_EQ(rows.size(), 2u);
}

TEST(DockCore, RejectsUnallocatedRowsOverflowAndUnknownNames) {
  DockCore d(small_config());
  std::vector<float> rw = {1.f, 2.f};
  std::vector<int64_t> rows = {0, 1};
  EXPECT_EQ(code_of([&] { d.put({ColumnInput{2, rw.data(), 8, nullptr}}, rows.data(), 2); }), Code::kInvalidArgument);
  std::vector<int64_t> out_of_range = {16, 17};
  EXPECT_EQ(code_of([&] {
              d.put({ColumnInput{2, rw.data(), 8, nullptr}}, out_of_range.data(), 2);
            }),
            Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { (void)d.column_index("x"); }), Code::kNotFound);
  EXPECT_EQ(code_of([&] { (void)d.stage_index("x"); }), Code::kNotFound);
  std::vector<int64_t> l(18, 0);
  EXPECT_EQ(code_of([&] { d.put_new({ColumnInput{0, nullptr, 0, l.data()}}, 18); }), Code::kOutOfMemory);
  EXPECT_EQ(code_of([&] { d.put_new({ColumnInput{0, nullptr, 0, l.data()}}, 3); }), Code::kInvalidArgument);
  EXPECT_EQ(d.put_new({ColumnInput{0, nullptr, 0, l.data()}}, 16).size(), 16u);
  EXPECT_EQ(code_of([&] { d.put_new({ColumnInput{0, nullptr, 0, l.data()}}, 2); }), Code::kOutOfMemory);
}

TEST(DockCore, StaleClaimsAreRejectedAfterReset) {
  DockCore d(small_config());
  std::vector<int64_t> l = {1, 1};
  std::vector<int64_t> p = {5, 6};
  d.put_new({ColumnInput{0, p.data(), 16, l.data()}}, 2);
  uint64_t epoch = 7;
  auto rows = d.claim(0, 2, 2, 0, &epoch);
  EXPECT_EQ(epoch, 0u);
  std::vector<int64_t> r = {1, 1};
  d.put({ColumnInput{1, p.data(), 16, r.data()}}, rows.data(), 2, static_cast<int64_t>(epoch));  // current: ok
  d.reset();
  EXPECT_EQ(d.epoch(), 1u);
  auto again = d.put_new({ColumnInput{0, p.data(), 16, l.data()}}, 2);  // the same rows, next iteration
  EXPECT_EQ(again, rows);
  std::vector<int64_t> out(2);
  EXPECT_EQ(code_of([&] { d.gather(0, rows.data(), 2, out.data(), 16, static_cast<int64_t>(epoch)); }),
            Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              d.put({ColumnInput{1, p.data(), 16, r.data()}}, rows.data(), 2, 0);
            }),
            Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { d.release(0, rows.data(), 2, 0); }), Code::kInvalidArgument);
  EXPECT_FALSE(d.warehouse(d.warehouse_of(rows[0])).ready(1, rows.data(), 2));  // nothing landed
  d.gather(0, rows.data(), 2, out.data(), 16, 1);
  EXPECT_EQ(out, p);
}

TEST(DockCore, BlockedClaimSurvivesResetAndCloseWakesIt) {
  DockCore d(small_config());
  std::vector<int64_t> got;
  uint64_t epoch = 0;
  std::thread t([&] { got = d.claim(0, 2, 2, 30.0, &epoch); });
  while (d.controller(0).progress().waiting_claims == 0) std::this_thread::yield();
  d.reset();
  std::vector<int64_t> l = {1, 1};
  std::vector<int64_t> p = {5, 6};
  auto rows = d.put_new({ColumnInput{0, p.data(), 16, l.data()}}, 2);
  t.join();
  EXPECT_EQ(got, rows);
  EXPECT_EQ(epoch, 1u);
  Code waiter = Code::kUnavailable;
  std::thread t2([&] { waiter = code_of([&] { d.claim(0, 2, 2, 30.0); }); });
  while (d.controller(0).progress().waiting_claims == 0) std::this_thread::yield();
  d.close();
  t2.join();
  EXPECT_EQ(waiter, Code::kClosed);
}

TEST(DockCore, PartialResetKeepsUnfinishedGroupsAndReusesFreedRows) {
  DockCore d(small_config());  // 8 groups of 2 rows, 2 warehouses
  // Three groups of prompts with distinct lengths.
  std::vector<int64_t> pl = {1, 1, 2, 2, 3, 3};
  std::vector<int64_t> p = {1, 2, 3, 3, 4, 4, 5, 5, 5, 6, 6, 6};
  auto rows = d.put_new({ColumnInput{0, p.data(), p.size() * 8, pl.data()}}, 6);
  ASSERT_EQ(rows.size(), 6u);
  std::vector<int64_t> g0(rows.begin(), rows.begin() + 2), g1(rows.begin() + 2, rows.begin() + 4),
      g2(rows.begin() + 4, rows.end());
  // Rollout claims all three groups; completes g0 and g1 (puts responses), g2 is still generating.
  auto c0 = d.claim(0, 6, 6, 0);
  ASSERT_EQ(c0, rows);
  std::vector<int64_t> rl = {1, 1};
  std::vector<int64_t> r0 = {10, 11}, r1 = {12, 13};
  d.put({ColumnInput{1, r0.data(), 16, rl.data()}}, g0.data(), 2, 0, /*stage=*/0);
  d.put({ColumnInput{1, r1.data(), 16, rl.data()}}, g1.data(), 2, 0, /*stage=*/0);
  // Reward takes both, writes g0's rewards only; update consumes g0: g0 is finished.
  auto c1 = d.claim(1, 4, 4, 0);
  std::vector<float> rw = {0.25f, 0.75f};
  d.put({ColumnInput{2, rw.data(), 8, nullptr}}, g0.data(), 2, 0, 1);
  EXPECT_EQ(d.claim(2, 4, 0, 0), g0);
  d.complete(2, g0.data(), 2);  // update writes nothing: it completes its claim

  auto kept = d.reset(true);
  EXPECT_EQ(kept, (std::vector<int64_t>{std::min(g1[0], g2[0]), std::min(g1[0], g2[0]) + 1, std::max(g1[0], g2[0]),
                                        std::max(g1[0], g2[0]) + 1}));
  EXPECT_EQ(d.epoch(), 1u);
  EXPECT_EQ(d.allocated_rows(), 4);
  EXPECT_FALSE(d.allocated(g0[0]));
  // Rollout: its completed claim on g1 survives; g2 (claimed, never completed) is claimable again.
  EXPECT_EQ(d.claim(0, 16, 0, 0), g2);
  // Reward claimed g1 without completing it: g1 comes back to reward, with its data intact.
  EXPECT_EQ(d.claim(1, 16, 0, 0), g1);
  std::vector<int64_t> out(2);
  d.gather(1, g1.data(), 2, out.data(), 16);
  EXPECT_EQ(out, r1);
  std::vector<int64_t> pout(4);
  d.gather(0, g1.data(), 2, pout.data(), 32);
  EXPECT_EQ(pout, (std::vector<int64_t>{3, 3, 4, 4}));
  std::vector<int64_t> p2(6);
  d.gather(0, g2.data(), 2, p2.data(), 48);
  EXPECT_EQ(p2, (std::vector<int64_t>{5, 5, 5, 6, 6, 6}));
  // g0's rows are free: new puts fill every free group (6 groups) and skip the kept ones.
  std::vector<int64_t> nl(12, 1);
  std::vector<int64_t> nv(12, 9);
  auto fresh = d.put_new({ColumnInput{0, nv.data(), 96, nl.data()}}, 12);
  std::vector<int64_t> all = kept;
  all.insert(all.end(), fresh.begin(), fresh.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expect(16);
  std::iota(expect.begin(), expect.end(), 0);
  EXPECT_EQ(all, expect);
  EXPECT_EQ(code_of([&] { d.put_new({ColumnInput{0, nv.data(), 16, nl.data()}}, 2); }), Code::kOutOfMemory);
  // A stale put with the old claim is refused.
  EXPECT_EQ(code_of([&] {
              d.put({ColumnInput{1, r1.data(), 16, rl.data()}}, g2.data(), 2, 0, 0);
            }),
            Code::kInvalidArgument);
  // A plain reset clears everything, kept groups included.
  EXPECT_TRUE(d.reset(false).empty());
  EXPECT_EQ(d.allocated_rows(), 0);
}

TEST(DockCore, PartialResetWithEverythingFinishedFreesAll) {
  DockCore d(small_config(1));
  std::vector<int64_t> l = {1, 1};
  std::vector<int64_t> p = {5, 6};
  auto rows = d.put_new({ColumnInput{0, p.data(), 16, l.data()}}, 2);
  std::vector<float> rw = {1.f, 2.f};
  d.put({ColumnInput{1, p.data(), 16, l.data()}, ColumnInput{2, rw.data(), 8, nullptr}}, rows.data(), 2);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(d.claim(s, 2, 2, 0), rows);
    d.complete(s, rows.data(), 2);
  }
  EXPECT_TRUE(d.reset(true).empty());
  EXPECT_EQ(d.allocated_rows(), 0);
  EXPECT_EQ(d.warehouse(0).bytes_held(), 0);
  EXPECT_EQ(code_of([&] { d.complete(5, rows.data(), 2); }), Code::kNotFound);
}

TEST(DockCore, ViewsAreZeroCopyAndPinTheIteration) {
  DockCore d(small_config());
  std::vector<int64_t> plens = {2, 2, 3, 3};
  std::vector<int64_t> prompts = {1, 1, 2, 2, 3, 3, 3, 4, 4, 4};
  auto rows = d.put_new({ColumnInput{0, prompts.data(), prompts.size() * 8, plens.data()}}, 4);
  ASSERT_NE(d.warehouse_of(rows[0]), d.warehouse_of(rows[2]));
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  std::vector<int64_t> lens(4);
  // One group: its rows are back to back in one arena.
  ASSERT_TRUE(d.view(0, rows.data(), 2, &data, &nbytes, lens.data()));
  EXPECT_EQ(nbytes, 32u);
  EXPECT_EQ(std::memcmp(data, prompts.data(), 32), 0);
  const uint8_t* again = nullptr;
  ASSERT_TRUE(d.view(0, rows.data(), 2, &again, &nbytes, lens.data()));
  EXPECT_EQ(again, data);  // the arena itself, not a copy
  EXPECT_EQ(d.live_views(), 2);
  // Two warehouses: no view, nothing pinned; lengths are still reported.
  EXPECT_FALSE(d.view(0, rows.data(), 4, &data, &nbytes, lens.data()));
  EXPECT_EQ(lens, plens);
  EXPECT_EQ(d.live_views(), 2);
  EXPECT_EQ(code_of([&] { d.reset(); }), Code::kInvalidArgument);
  EXPECT_EQ(d.epoch(), 0u);  // nothing reset
  d.unpin();
  EXPECT_EQ(code_of([&] { d.reset(); }), Code::kInvalidArgument);
  d.unpin();
  EXPECT_EQ(code_of([&] { d.unpin(); }), Code::kInvalidArgument);
  EXPECT_EQ(d.live_views(), 0);
  // A column not written and a stale epoch are errors that pin nothing.
  EXPECT_EQ(code_of([&] { d.view(1, rows.data(), 2, &data, &nbytes, lens.data()); }), Code::kInvalidArgument);
  d.reset();
  EXPECT_EQ(code_of([&] { d.view(0, rows.data(), 2, &data, &nbytes, lens.data(), 0); }), Code::kInvalidArgument);
  EXPECT_EQ(d.live_views(), 0);
}

TEST(Controller, ClaimIdentityIsCheckedByReleaseAndComplete) {
  Controller c("s", 4, 2, {0});
  mark(c, 0, {0, 1});
  uint64_t a = 0, b = 0;
  auto rows = c.claim(2, 0, 0, nullptr, 0, &a);
  ASSERT_EQ(rows, (std::vector<int64_t>{0, 1}));
  EXPECT_NE(a, 0u);
  c.release(rows.data(), 2, a);
  EXPECT_EQ(c.claim(2, 0, 0, nullptr, 0, &b), rows);  // another worker holds the rows now
  EXPECT_NE(a, b);
  EXPECT_EQ(code_of([&] { c.release(rows.data(), 2, a); }), Code::kInvalidArgument);  // stale: refused
  EXPECT_EQ(code_of([&] { c.complete(rows.data(), 2, a); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { c.check_held(rows.data(), 2, a); }), Code::kInvalidArgument);
  c.check_held(rows.data(), 2, b);
  EXPECT_EQ(c.progress().consumed_rows, 2);
  EXPECT_TRUE(c.claim(2, 0, 0).empty());  // not re-delivered
  c.complete(rows.data(), 2, b);
  EXPECT_TRUE(c.group_completed(0));
  EXPECT_EQ(code_of([&] { c.release(rows.data(), 2, b); }), Code::kInvalidArgument);  // completed
  EXPECT_EQ(code_of([&] { c.release(rows.data(), 2); }), Code::kInvalidArgument);
  EXPECT_TRUE(c.claim(2, 0, 0).empty());
}

TEST(Controller, HugeTimeoutsAreClampedNotOverflowed) {
  Controller c("s", 4, 2, {0});
  std::vector<int64_t> got;
  std::thread t([&] { got = c.claim(2, 2, 1e10); });  // would overflow a nanosecond deadline
  while (c.progress().waiting_claims == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  mark(c, 0, {2, 3});
  t.join();
  EXPECT_EQ(got, (std::vector<int64_t>{2, 3}));
}

TEST(Controller, PlainPutCompletesTheClaimsOfStagesThatWroteTheColumns) {
  Controller c("gen", 4, 2, {0});
  mark(c, 0, {0, 1, 2, 3});
  auto rows = c.claim(2, 0, 0);
  std::vector<int64_t> other = {2, 3};
  EXPECT_FALSE(c.complete_by_put({0}, rows.data(), 2));   // the stage reads column 0: not its output
  EXPECT_FALSE(c.complete_by_put({1}, other.data(), 2));  // not claimed by this stage
  EXPECT_FALSE(c.group_completed(0));
  EXPECT_TRUE(c.complete_by_put({1}, rows.data(), 2));
  EXPECT_TRUE(c.group_completed(0));
  EXPECT_FALSE(c.group_completed(1));
}

TEST(DockCore, FinishedMeansCompletedByEveryStage) {
  DockCore d(small_config(1));  // stages: 0 reads col 0; 1 reads cols 0, 1; 2 reads cols 0, 1, 2
  std::vector<int64_t> l = {1, 1, 1, 1};
  std::vector<int64_t> p = {5, 6, 7, 8};
  auto rows = d.put_new({ColumnInput{0, p.data(), 32, l.data()}}, 4);
  uint64_t epoch = 0, id = 0;
  auto gen = d.claim(0, 4, 4, 0, &epoch, 0, &id);
  d.put({ColumnInput{1, p.data(), 32, l.data()}}, gen.data(), 4);  // plain ids: completes stage 0's claim
  std::vector<float> rw = {1.f, 2.f, 3.f, 4.f};
  d.put({ColumnInput{2, rw.data(), 16, nullptr}}, rows.data(), 4);
  auto s1 = d.claim(1, 4, 4, 0, &epoch, 0, &id);
  d.complete(1, s1.data(), 4, 0, id);
  auto s2 = d.claim(2, 4, 4, 0, &epoch, 0, &id);
  d.complete(2, s2.data(), 2, 0, id);  // the last stage completes only its first group
  auto kept = d.reset(true);
  EXPECT_EQ(kept, std::vector<int64_t>(s2.begin() + 2, s2.end()));
  EXPECT_TRUE(d.claim(0, 4, 0, 0).empty());  // stage 0 completed the kept group by the plain put
  EXPECT_TRUE(d.claim(1, 4, 0, 0).empty());
  EXPECT_EQ(d.claim(2, 4, 0, 0), kept);  // the last stage's open claim went back to it
}

// ---- One control plane: a metadata-only DockCore (the Ray controller's) runs the put protocol and
// reset in steps; the bytes live in warehouses elsewhere ----

namespace {
DockConfig metadata_config(int warehouses = 2) {
  DockConfig cfg = small_config(warehouses);
  cfg.store_bytes = false;
  return cfg;
}

// A Ray-like backend in one process: a metadata-only DockCore and standalone warehouses over the rows
// it assigns them, driven the way the Ray client drives its actors (begin -> store -> publish).
struct SplitDock {
  DockCore ctl{metadata_config()};
  std::vector<std::unique_ptr<Warehouse>> whs;
  SplitDock() {
    for (int w = 0; w < ctl.num_warehouses(); ++w) {
      auto [first, rows] = ctl.warehouse_rows(w);
      whs.push_back(std::make_unique<Warehouse>(w, first, rows, ctl.config().columns));
    }
  }
  // Steps 2 and 3 of a put begun as `id`: store the bytes in the warehouses, then publish (or abort).
  void store_and_publish(uint64_t id, const std::vector<ColumnInput>& in, const std::vector<int64_t>& rows,
                         int stage = -1, uint64_t claim_id = 0) {
    std::vector<Warehouse*> ptrs;
    for (auto& w : whs) ptrs.push_back(w.get());
    try {
      store_columns(
          ptrs, [this](int64_t r) { return ctl.warehouse_of(r); }, in, rows.data(), rows.size());
    } catch (...) {
      ctl.abort_put(id);
      throw;
    }
    std::vector<ColumnMark> marks;
    for (const auto& c : in) marks.push_back({c.column, c.lengths});
    ctl.publish(id, marks, rows.data(), rows.size(), stage, claim_id);
  }
  std::vector<int64_t> put_new(const std::vector<ColumnInput>& in, int64_t n) {
    std::vector<int64_t> rows;
    store_and_publish(ctl.begin_put_new(n, &rows), in, rows);
    return rows;
  }
  void put(const std::vector<ColumnInput>& in, const std::vector<int64_t>& rows, int64_t epoch, int stage,
           uint64_t claim_id) {
    store_and_publish(ctl.begin_put(rows.data(), rows.size(), epoch, stage, claim_id), in, rows, stage, claim_id);
  }
  std::vector<int64_t> reset(bool keep) {
    ctl.begin_reset();
    std::vector<int64_t> kept = ctl.reset_metadata(keep);
    std::vector<std::vector<int64_t>> per(whs.size());
    for (int64_t r : kept) per[ctl.warehouse_of(r)].push_back(r);
    for (size_t w = 0; w < whs.size(); ++w) whs[w]->reset(per[w]);
    ctl.end_reset();
    return kept;
  }
};
}  // namespace

TEST(DockCore, MetadataOnlyDockHoldsNoBytesAndSaysSo) {
  DockCore d(metadata_config());
  EXPECT_FALSE(d.stores_bytes());
  EXPECT_EQ(d.num_warehouses(), 2);
  EXPECT_EQ(d.warehouse_rows(0), (std::pair<int64_t, int64_t>{0, 8}));
  EXPECT_EQ(d.warehouse_rows(1), (std::pair<int64_t, int64_t>{8, 8}));
  EXPECT_EQ(code_of([&] { d.warehouse_rows(2); }), Code::kInvalidArgument);
  std::vector<int64_t> v = {1, 2}, lens = {1, 1};
  EXPECT_EQ(code_of([&] { d.put_new({ColumnInput{0, v.data(), 16, lens.data()}}, 2); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { d.reset(); }), Code::kInvalidArgument);
  EXPECT_EQ(d.allocated_rows(), 0);
  EXPECT_EQ(d.puts_in_flight(), 0);
}

TEST(DockCore, MetadataOnlyDockMakesTheLocalDocksDecisions) {
  // The same random workload on the local DockCore and on a metadata-only DockCore + separate
  // warehouses: the same rows allocated, claimed, kept and the same bytes read back.
  DockCore local(small_config());
  SplitDock split;
  std::mt19937 rng(7);
  std::vector<int64_t> one = {1, 1, 1, 1};
  int64_t claimed = 0, kept = 0, refused = 0;
  for (int step = 0; step < 600; ++step) {
    const int op = static_cast<int>(rng() % 5);
    if (op == 0) {  // new prompts, two groups
      std::vector<int64_t> vals = {step, step, step, step};
      const ColumnInput in{0, vals.data(), 32, one.data()};
      std::vector<int64_t> a, b;
      const Code ca = code_of_or_ok([&] { a = local.put_new({in}, 4); });
      const Code cb = code_of_or_ok([&] { b = split.put_new({in}, 4); });
      ASSERT_EQ(ca, cb) << "step " << step;
      ASSERT_EQ(a, b) << "step " << step;
      refused += ca != Code{0};
    } else if (op <= 2) {  // a stage claims, and puts its output with the claim (or releases)
      const int stage = static_cast<int>(rng() % 2);
      uint64_t ea = 0, eb = 0, ia = 0, ib = 0;
      auto a = local.claim(stage, 2, 0, 0, &ea, 0, &ia);
      auto b = split.ctl.claim(stage, 2, 0, 0, &eb, 0, &ib);
      ASSERT_EQ(a, b) << "step " << step;
      ASSERT_EQ(ea, eb);
      claimed += static_cast<int64_t>(a.size());
      if (a.empty()) continue;
      if (rng() % 4 == 0) {
        local.release(stage, a.data(), a.size(), static_cast<int64_t>(ea), ia);
        split.ctl.release(stage, b.data(), b.size(), static_cast<int64_t>(eb), ib);
        continue;
      }
      std::vector<int64_t> vals(a.size(), step);
      const int col = stage == 0 ? 1 : 2;  // rollout writes responses, reward writes rewards
      const ColumnInput in{col, vals.data(), a.size() * (col == 1 ? 8 : 4), col == 1 ? one.data() : nullptr};
      std::vector<float> fvals(a.size(), static_cast<float>(step));
      const ColumnInput fin{col, fvals.data(), a.size() * 4, nullptr};
      local.put({col == 1 ? in : fin}, a.data(), a.size(), static_cast<int64_t>(ea), stage, ia);
      split.put({col == 1 ? in : fin}, b, static_cast<int64_t>(eb), stage, ib);
    } else if (op == 3) {  // update reads everything
      auto a = local.claim(2, 4, 0, 0);
      auto b = split.ctl.claim(2, 4, 0, 0);
      ASSERT_EQ(a, b) << "step " << step;
      for (size_t i = 0; i < a.size(); ++i) {
        int64_t x = -1, y = -1;
        local.gather(1, &a[i], 1, &x, 8);
        split.whs[split.ctl.warehouse_of(b[i])]->gather(1, &b[i], 1, &y, 8);
        ASSERT_EQ(x, y) << "row " << a[i];
      }
      if (!a.empty()) {
        local.complete(2, a.data(), a.size());
        split.ctl.complete(2, b.data(), b.size());
      }
    } else {  // (partial) reset
      const bool keep = rng() % 2 == 0;
      const auto k = local.reset(keep);
      ASSERT_EQ(k, split.reset(keep)) << "step " << step;
      kept += static_cast<int64_t>(k.size());
      ASSERT_EQ(local.epoch(), split.ctl.epoch());
    }
    ASSERT_EQ(local.allocated_rows(), split.ctl.allocated_rows()) << "step " << step;
    for (int s = 0; s < 3; ++s) {
      ASSERT_EQ(local.controller(s).progress().ready_rows, split.ctl.controller(s).progress().ready_rows);
    }
  }
  EXPECT_GT(claimed, 150);  // the workload exercised claims, partial resets and a full dock
  EXPECT_GT(kept, 0);
  EXPECT_GT(refused, 0);
  EXPECT_EQ(local.puts_in_flight(), 0);
  EXPECT_EQ(split.ctl.puts_in_flight(), 0);
  EXPECT_EQ(split.ctl.put_stats.rows.load(), local.put_stats.rows.load());
}

TEST(DockCore, ResetRefusesWhileAPutIsInFlightAndForceAbandonsIt) {
  DockCore d(metadata_config());
  std::vector<int64_t> rows;
  const uint64_t put = d.begin_put_new(4, &rows);
  EXPECT_EQ(d.puts_in_flight(), 1);
  EXPECT_EQ(code_of([&] { d.begin_reset(); }), Code::kInvalidArgument);  // nothing changed
  EXPECT_EQ(d.allocated_rows(), 4);
  EXPECT_EQ(d.epoch(), 0u);
  d.begin_reset(/*force=*/true);
  EXPECT_EQ(code_of([&] { d.begin_reset(true); }), Code::kInvalidArgument);  // one reset at a time
  EXPECT_TRUE(d.reset_metadata(false).empty());
  d.end_reset();
  EXPECT_EQ(d.epoch(), 1u);
  EXPECT_EQ(d.allocated_rows(), 0);
  // The abandoned put publishes nothing, and its abort frees nothing (the rows may be someone else's).
  EXPECT_EQ(code_of([&] { d.publish(put, {{0, nullptr}}, rows.data(), rows.size()); }), Code::kInvalidArgument);
  EXPECT_EQ(d.controller(0).progress().ready_rows, 0);
  std::vector<int64_t> again;
  const uint64_t p2 = d.begin_put_new(4, &again);
  EXPECT_EQ(again, rows);  // the freed rows, handed out again
  d.abort_put(put);
  EXPECT_EQ(d.allocated_rows(), 4);
  d.publish(p2, {{0, nullptr}}, again.data(), again.size());
  EXPECT_EQ(d.controller(0).progress().ready_rows, 4);
  EXPECT_EQ(d.puts_in_flight(), 0);
  EXPECT_EQ(code_of([&] { d.reset_metadata(false); }), Code::kInvalidArgument);  // outside begin/end
}

TEST(DockCore, AbortedPutsGiveTheirRowsBackAndFailedChecksRegisterNothing) {
  DockCore d(metadata_config());
  std::vector<int64_t> rows;
  const uint64_t put = d.begin_put_new(4, &rows);
  std::vector<int64_t> other;
  const uint64_t other_put = d.begin_put_new(2, &other);
  d.abort_put(put);  // gives back its own rows only
  EXPECT_EQ(d.allocated_rows(), 2);
  d.abort_put(put);  // an ended put: ignored
  d.abort_put(12345);
  EXPECT_EQ(d.allocated_rows(), 2);
  d.abort_put(other_put);
  EXPECT_EQ(d.allocated_rows(), 0);
  EXPECT_EQ(d.puts_in_flight(), 0);
  EXPECT_EQ(code_of([&] { d.publish(put, {{0, nullptr}}, rows.data(), rows.size()); }), Code::kInvalidArgument);
  std::vector<int64_t> none;
  EXPECT_EQ(code_of([&] { d.begin_put_new(3, &none); }), Code::kInvalidArgument);  // not whole groups
  EXPECT_EQ(code_of([&] { d.begin_put_new(18, &none); }), Code::kOutOfMemory);
  EXPECT_EQ(code_of([&] { d.begin_put(rows.data(), rows.size()); }), Code::kInvalidArgument);  // not allocated
  const uint64_t p = d.begin_put_new(4, &rows);
  d.publish(p, {{0, nullptr}}, rows.data(), rows.size());
  EXPECT_EQ(code_of([&] { d.begin_put(rows.data(), rows.size(), /*epoch=*/3); }), Code::kInvalidArgument);  // stale
  uint64_t claim_id = 0;
  auto got = d.claim(0, 2, 2, 0, nullptr, 0, &claim_id);
  EXPECT_EQ(code_of([&] { d.begin_put(got.data(), got.size(), 0, 0, claim_id + 1); }), Code::kInvalidArgument);
  const uint64_t into = d.begin_put(got.data(), got.size(), 0, 0, claim_id);
  d.abort_put(into);  // a put into existing rows frees nothing
  EXPECT_EQ(d.allocated_rows(), 4);
  EXPECT_EQ(d.puts_in_flight(), 0);
  EXPECT_EQ(d.allocated_rows(), 4);
}

TEST(DockCore, PutsBegunDuringAResetWaitForItsEnd) {
  DockCore d(metadata_config());
  d.begin_reset();
  std::atomic<bool> begun{false};
  std::vector<int64_t> rows;
  uint64_t put_epoch = 99;
  std::thread t([&] {
    const uint64_t put = d.begin_put_new(2, &rows, &put_epoch);
    begun = true;
    d.publish(put, {{0, nullptr}}, rows.data(), rows.size());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(begun.load());  // held back: a row is wholly before or after the reset
  (void)d.reset_metadata(false);
  d.end_reset();
  t.join();
  EXPECT_TRUE(begun.load());
  EXPECT_EQ(d.epoch(), 1u);
  EXPECT_EQ(put_epoch, 1u);                             // the put belongs to the iteration after the reset
  EXPECT_EQ(d.controller(0).progress().ready_rows, 2);  // in the new iteration
}

TEST(DockCore, LocalResetRefusesWhileALocalPutIsRegistered) {
  // The local backend's puts go through the same ledger: a put begun by another thread blocks reset.
  DockCore d(small_config());
  std::vector<int64_t> rows;
  const uint64_t put = d.begin_put_new(2, &rows);
  EXPECT_EQ(code_of([&] { d.reset(); }), Code::kInvalidArgument);
  d.abort_put(put);
  d.reset();
  EXPECT_EQ(d.epoch(), 1u);
}

TEST(DockCore, ConcurrentPutsAndResetsKeepRowsWhollyBeforeOrAfter) {
  // Puts race resets: each reset either refuses (a put in flight) or runs with puts held back, so the
  // allocator and the controllers always agree: every allocated row is ready, none ready is free.
  // Deterministic under load: the putters pause a little after each put (a window with no put in
  // flight), and the resetter keeps trying until 20 resets and 20 puts happened (deadline 60 s), so a
  // loaded machine slows the test instead of failing it.
  DockCore d(small_config());
  std::atomic<bool> stop{false};
  std::atomic<int64_t> puts{0}, resets{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 3; ++t) {
    ts.emplace_back([&] {
      std::vector<int64_t> vals = {1, 2}, lens = {1, 1};
      while (!stop.load()) {
        try {
          d.put_new({ColumnInput{0, vals.data(), 16, lens.data()}}, 2);
          ++puts;
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), Code::kOutOfMemory);  // a full dock; a reset frees it
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int i = 0; (i < 2000 || resets.load() < 20 || puts.load() < 20) && std::chrono::steady_clock::now() < deadline;
       ++i) {
    try {
      d.reset();
      ++resets;
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), Code::kInvalidArgument);  // a put in flight: nothing reset
    }
  }
  stop = true;
  for (auto& t : ts) t.join();
  EXPECT_GE(puts.load(), 20);
  EXPECT_GE(resets.load(), 20);
  EXPECT_EQ(d.puts_in_flight(), 0);
  EXPECT_EQ(d.allocated_rows(), d.controller(0).progress().ready_rows);
  EXPECT_EQ(static_cast<uint64_t>(resets.load()), d.epoch());
}

TEST(DockCore, ForcedResetsRacingPutsNeverLeaveRowsAllocatedAndUnready) {
  // A forced reset may abandon a put at any step (even between its registration and its allocation):
  // when both stop, every allocated row is ready — none is lost to an abandoned put. Trials end at a
  // random point of the race (a stress test; the narrowest window is hit only now and then).
  int64_t published = 0, abandoned = 0;
  // At least 25 trials, and more (up to a deadline) until a put was published: on a loaded machine the
  // spinning resetter may abandon every put of a trial.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int trial = 0; trial < 25 || (published == 0 && std::chrono::steady_clock::now() < deadline); ++trial) {
    DockConfig cfg = metadata_config();
    cfg.capacity = 1 << 12;
    DockCore d(cfg);
    std::atomic<bool> stop{false};
    std::atomic<int64_t> ok{0}, lost{0};
    std::thread putter([&] {
      std::vector<int64_t> rows;
      while (!stop.load()) {
        uint64_t put = 0;
        try {
          put = d.begin_put_new(2, &rows);
        } catch (const Error& e) {  // abandoned as it began, or the dock is full
          ASSERT_TRUE(e.code() == Code::kInvalidArgument || e.code() == Code::kOutOfMemory) << e.what();
          continue;
        }
        try {
          d.publish(put, {{0, nullptr}}, rows.data(), rows.size());
          ++ok;
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), Code::kInvalidArgument);  // abandoned: publishes nothing
          d.abort_put(put);
          ++lost;
        }
      }
    });
    std::thread resetter([&] {
      while (!stop.load()) {
        d.begin_reset(/*force=*/true);
        (void)d.reset_metadata(false);
        d.end_reset();
      }
    });
    const auto trial_end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    while (ok.load() + lost.load() < 20 && std::chrono::steady_clock::now() < trial_end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    stop = true;
    putter.join();
    resetter.join();
    EXPECT_EQ(d.puts_in_flight(), 0);
    EXPECT_EQ(d.allocated_rows(), d.controller(0).progress().ready_rows) << "trial " << trial;
    published += ok.load();
    abandoned += lost.load();
  }
  EXPECT_GT(published, 0);
}

TEST(DockCore, PublishRefusesRowsThePutDidNotBeginWith) {
  DockCore d(metadata_config());
  std::vector<int64_t> rows;
  const uint64_t put = d.begin_put_new(4, &rows);  // groups 0 and 4 (interleaved): rows 0, 1, 8, 9
  ASSERT_EQ(rows, (std::vector<int64_t>{0, 1, 8, 9}));
  std::vector<int64_t> other = {2, 3};
  EXPECT_EQ(code_of([&] { d.publish(put, {{0, nullptr}}, other.data(), other.size()); }), Code::kInvalidArgument);
  EXPECT_EQ(d.controller(0).progress().ready_rows, 0);  // nothing published
  EXPECT_EQ(d.puts_in_flight(), 1);                     // still the caller's to publish or abort
  d.publish(put, {{0, nullptr}}, rows.data(), rows.size());
  EXPECT_EQ(d.controller(0).progress().ready_rows, 4);
}

TEST(DockCore, AbortSaysWhetherThePutWasInFlightAndCanKeepItsRows) {
  DockCore d(metadata_config());
  std::vector<int64_t> rows;
  const uint64_t put = d.begin_put_new(4, &rows);
  EXPECT_TRUE(d.abort_put(put, /*give_rows_back=*/false));  // its bytes may be stored: rows kept
  EXPECT_EQ(d.allocated_rows(), 4);
  EXPECT_FALSE(d.abort_put(put));  // ended
  std::vector<int64_t> next;
  const uint64_t next_put = d.begin_put_new(2, &next);
  d.publish(next_put, {{0, nullptr}}, next.data(), next.size());
  EXPECT_EQ(std::find(rows.begin(), rows.end(), next[0]), rows.end());  // the kept rows are not reused
  d.begin_reset();
  (void)d.reset_metadata(false);
  d.end_reset();
  EXPECT_EQ(d.allocated_rows(), 0);  // the next iteration frees them
  DockCore local(small_config());    // holds its warehouses: its reset is reset(), not the steps
  EXPECT_EQ(code_of([&] { local.reset_metadata(false); }), Code::kInvalidArgument);
}

TEST(DockCore, HugeLengthsAreRefusedBeforeTheyWrapTheByteCount) {
  // 2^61 items of 8 bytes wrap to 0 bytes in 64 bits: a put of 0 bytes must not store such a row.
  DockCore d(small_config());
  std::vector<int64_t> lens = {int64_t{1} << 61, 0};
  EXPECT_EQ(code_of([&] { d.put_new({ColumnInput{0, nullptr, 0, lens.data()}}, 2); }), Code::kOutOfMemory);
  EXPECT_EQ(d.allocated_rows(), 0);
  Warehouse w(0, 0, 4, small_config().columns);
  std::vector<int64_t> rows = {0, 1};
  EXPECT_EQ(code_of([&] { w.reserve(0, rows.data(), 2, lens.data()); }), Code::kOutOfMemory);
  EXPECT_EQ(w.bytes_held(), 0);
}
