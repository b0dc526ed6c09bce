#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "common/error.h"
#include "memory/pinned_pool.h"

using namespace msrl;

TEST(PinnedPool, SizeClassesBoundWasteForLargeBlocks) {
  EXPECT_EQ(PinnedPool::size_class(1), 4096u);
  EXPECT_EQ(PinnedPool::size_class(4097), 8192u);
  EXPECT_EQ(PinnedPool::size_class(100 << 10), 128u << 10);
  EXPECT_EQ(PinnedPool::size_class((2 << 20) + 1), 4u << 20);
  // A 1 GiB + 1 byte request is not rounded to 2 GiB.
  size_t big = (size_t{1} << 30) + 1;
  EXPECT_LE(PinnedPool::size_class(big), big + big / 16);
  for (size_t n : {size_t{3} << 20, size_t{100} << 20, size_t{777777777}}) {
    size_t c = PinnedPool::size_class(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c, n + n / 8 + (2 << 20)) << n;
  }
}

TEST(PinnedPool, ReusesBlocksAndAccounts) {
  auto pool = PinnedPool::create(make_host_runtime());
  void* first;
  {
    auto b = pool->allocate(5 << 20);
    first = b->data();
    auto s = pool->stats();
    EXPECT_EQ(s.in_use, PinnedPool::size_class(5 << 20));
    EXPECT_EQ(s.requested, 5u << 20);
    EXPECT_TRUE(PinnedPool::is_pinned(b->data(), 5 << 20));
    EXPECT_TRUE(PinnedPool::is_pinned(static_cast<char*>(b->data()) + 100, 1000));
  }
  EXPECT_FALSE(PinnedPool::is_pinned(first, 1));
  auto s = pool->stats();
  EXPECT_EQ(s.in_use, 0u);
  EXPECT_EQ(s.cached, PinnedPool::size_class(5 << 20));
  auto again = pool->allocate((5 << 20) - 100);  // same class: the cached block comes back
  EXPECT_EQ(again->data(), first);
  EXPECT_EQ(pool->stats().cache_hits, 1u);
  EXPECT_EQ(pool->stats().peak_in_use, PinnedPool::size_class(5 << 20));
}

TEST(PinnedPool, CapacityIsEnforcedAfterTrimmingCache) {
  auto pool = PinnedPool::create(make_host_runtime(), 8 << 20);
  { auto a = pool->allocate(4 << 20); }  // cached now
  auto b = pool->allocate(6 << 20);      // needs the cache trimmed to fit
  EXPECT_EQ(pool->stats().cached, 0u);
  try {
    pool->allocate(4 << 20);
    FAIL() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kOutOfMemory);
    EXPECT_NE(e.message().find("capacity"), std::string::npos);
  }
  EXPECT_EQ(pool->stats().in_use, PinnedPool::size_class(6 << 20));  // the failure changed nothing
}

TEST(PinnedPool, CloseFreesCacheAndRejectsNewWorkButKeepsLiveBlocks) {
  auto pool = PinnedPool::create(make_host_runtime());
  auto live = pool->allocate(1 << 20);
  { auto cached = pool->allocate(3 << 20); }
  pool->close();
  EXPECT_TRUE(pool->closed());
  EXPECT_EQ(pool->stats().cached, 0u);
  static_cast<char*>(live->data())[0] = 42;  // still valid
  try {
    pool->allocate(10);
    FAIL() << "expected Closed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kClosed);
  }
  live.reset();
  EXPECT_EQ(pool->stats().reserved, 0u);
}

TEST(PinnedPool, RegistrationPinsInPlaceUntilDestroyed) {
  auto pool = PinnedPool::create(make_host_runtime());
  std::vector<char> buf(1 << 16);
  {
    auto reg = pool->register_buffer(buf.data(), buf.size());
    EXPECT_TRUE(PinnedPool::is_pinned(buf.data(), buf.size()));
    EXPECT_EQ(pool->stats().registered, buf.size());
    EXPECT_THROW(pool->register_buffer(buf.data(), 10), Error);  // overlaps
  }
  EXPECT_FALSE(PinnedPool::is_pinned(buf.data(), 1));
  EXPECT_EQ(pool->stats().registered, 0u);
  EXPECT_THROW(pool->register_buffer(nullptr, 10), Error);
}

TEST(PinnedPool, ConcurrentAllocateReleaseKeepsAccountsBalanced) {
  auto pool = PinnedPool::create(make_host_runtime());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto b = pool->allocate(4096 * (1 + (i + t) % 7));
        static_cast<char*>(b->data())[0] = static_cast<char>(i);
      }
    });
  }
  for (auto& th : threads) th.join();
  auto s = pool->stats();
  EXPECT_EQ(s.in_use, 0u);
  EXPECT_EQ(s.requested, 0u);
  EXPECT_EQ(s.allocations, 800u);
  EXPECT_EQ(s.reserved, s.cached);
  EXPECT_GT(s.cache_hits, 700u);
}
