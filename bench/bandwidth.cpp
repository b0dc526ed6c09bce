// Host<->device bandwidth of the msrl_core runtime and copy engine, with same-run baselines.
//
// Every case prints one JSON line: case, backend, bytes, gbps_median, baseline (name), baseline_gbps_median,
// ratio (case / baseline), reps, statistic. The data of every case is verified after timing.
//
// Every timed call, case or baseline, ends with the copy complete: an engine case waits for its ticket, a
// runtime baseline synchronises its stream (a pinned async copy only enqueues on a GPU, so an unsynchronised
// baseline would time the enqueue). Each direction has its own baseline of the same direction and memory.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "copy/copy_engine.h"
#include "memory/pinned_pool.h"
#include "runtime/device_runtime.h"

using namespace msrl;
using Clock = std::chrono::steady_clock;

namespace {

int g_reps = 7;
std::string g_only;

double median_seconds(const std::function<void()>& fn, int reps) {
  fn();  // warm-up: first-touch page faults, lazy lane start-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void fill(void* p, size_t n, uint64_t seed) {
  auto* w = static_cast<uint64_t*>(p);
  for (size_t i = 0; i < n / 8; ++i) w[i] = seed * 0x9E3779B97F4A7C15ull + i;
  for (size_t i = n / 8 * 8; i < n; ++i) static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(i);
}

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "VERIFY FAILED: %s\n", what.c_str());
    std::exit(2);
  }
}

bool g_json = false;  // --json: one JSON object per case (as before); default: a readable table
bool g_header = false;

void report(const std::string& name, const DeviceRuntime& rt, double bytes, double secs, const std::string& base,
            double base_secs, const std::string& extra = "") {
  double g = bytes / secs / 1e9, bg = bytes / base_secs / 1e9;
  if (g_json) {
    std::printf(
        "{\"case\": \"%s\", \"backend\": \"%s\", \"bytes\": %.0f, \"gbps_median\": %.3f, \"baseline\": \"%s\", "
        "\"baseline_gbps_median\": %.3f, \"ratio\": %.3f, \"reps\": %d, \"statistic\": \"median\"%s}\n",
        name.c_str(), rt.name(), bytes, g, base.c_str(), bg, g / bg, g_reps, extra.c_str());
  } else {
    if (!g_header) {
      std::printf("%-46s %-7s %9s %8s  %-34s %9s %7s\n", "case", "backend", "MiB", "GB/s", "baseline", "base GB/s",
                  "ratio");
      g_header = true;
    }
    std::printf("%-46s %-7s %9.1f %8.2f  %-34s %9.2f %6.2fx\n", name.c_str(), rt.name(), bytes / 1048576.0, g,
                base.c_str(), bg, g / bg);
  }
  std::fflush(stdout);
}

bool wanted(const std::string& name) { return g_only.empty() || name.find(g_only) != std::string::npos; }

struct HostBuf {  // pageable host memory
  explicit HostBuf(size_t n) : p(static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))), n(n) {
    std::memset(p, 0, n);
  }
  ~HostBuf() { std::free(p); }
  char* p;
  size_t n;
};

struct DevBuf {
  DevBuf(DeviceRuntime& rt, size_t n) : rt(rt), p(static_cast<char*>(rt.device_alloc(n))), n(n) {}
  ~DevBuf() { rt.device_free(p); }
  DeviceRuntime& rt;
  char* p;
  size_t n;
};

// A runtime copy on the default stream, complete when this returns: the same-run baseline of every case.
void sync_copy(DeviceRuntime& rt, void* dst, const void* src, size_t n, CopyKind kind) {
  rt.memcpy_async(dst, src, n, kind, nullptr);
  rt.stream_synchronize(nullptr);
}

// Reads device memory back to host through a pinned block (AscendCL copies only page-locked host memory).
std::vector<char> readback(DeviceRuntime& rt, PinnedPool& pool, const char* dev, size_t n) {
  auto staging = pool.allocate(n);
  sync_copy(rt, staging->data(), dev, n, CopyKind::kDeviceToHost);
  const char* p = static_cast<const char*>(staging->data());
  return std::vector<char>(p, p + n);
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "auto";
  size_t big = size_t{1} << 30;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--device" && i + 1 < argc)
      device = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      g_reps = std::atoi(argv[++i]);
    else if (a == "--bytes" && i + 1 < argc)
      big = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--only" && i + 1 < argc)
      g_only = argv[++i];
    else if (a == "--json")
      g_json = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--device auto|host|cuda|npu] [--reps N] [--bytes N] [--only SUBSTRING] [--json]\n",
                   argv[0]);
      return 1;
    }
  }
  try {
    auto rt = get_runtime(device);
    auto pool = PinnedPool::create(rt);
    CopyEngine engine(rt);
    const double timeout = 600;

    // --- 1 GiB pageable -> pinned -> pageable round trip vs plain memcpy of the same bytes.
    if (wanted("roundtrip")) {
      HostBuf src(big), back(big);
      auto pinned = pool->allocate(big);
      fill(src.p, big, 1);
      double base = median_seconds(
          [&] {
            std::memcpy(pinned->data(), src.p, big);
            std::memcpy(back.p, pinned->data(), big);
          },
          g_reps);
      std::memset(back.p, 0, big);
      double secs = median_seconds(
          [&] {
            engine.wait(*engine.copy(pinned->data(), src.p, big, CopyKind::kHostToHost), timeout);
            engine.wait(*engine.copy(back.p, pinned->data(), big, CopyKind::kHostToHost), timeout);
          },
          g_reps);
      check(std::memcmp(src.p, back.p, big) == 0, "roundtrip data");
      report("pageable_pinned_pageable_roundtrip", *rt, 2.0 * big, secs, "memcpy", base);
    }

    // --- Host <-> device copies through the engine (on the host backend, "device" is host memory).
    size_t n = std::min(big, size_t{256} << 20);
    HostBuf pageable(n), pageable_back(n);
    fill(pageable.p, n, 2);
    auto pinned = pool->allocate(n);
    std::memcpy(pinned->data(), pageable.p, n);
    DevBuf dev(*rt, n);
    auto timed_sync_copy = [&](void* dst, const void* src, CopyKind kind) {
      return median_seconds([&] { sync_copy(*rt, dst, src, n, kind); }, g_reps);
    };
    double base_pinned_h2d = timed_sync_copy(dev.p, pinned->data(), CopyKind::kHostToDevice);
    double base_pinned_d2h = timed_sync_copy(pinned->data(), dev.p, CopyKind::kDeviceToHost);
    auto engine_case = [&](const std::string& name, void* dst, const void* src, CopyKind kind, double base,
                           const std::string& base_name) {
      if (!wanted(name)) return;
      double secs = median_seconds([&] { engine.wait(*engine.copy(dst, src, n, kind), timeout); }, g_reps);
      report(name, *rt, n, secs, base_name, base);
    };
    auto expect_device = [&](const std::string& what) {
      check(readback(*rt, *pool, dev.p, n) == std::vector<char>(pageable.p, pageable.p + n), what);
    };
    engine_case("h2d_pinned", dev.p, pinned->data(), CopyKind::kHostToDevice, base_pinned_h2d,
                "runtime_sync_copy_pinned_h2d");
    if (wanted("h2d_pinned")) expect_device("h2d_pinned data");
    engine_case("d2h_pinned", pinned->data(), dev.p, CopyKind::kDeviceToHost, base_pinned_d2h,
                "runtime_sync_copy_pinned_d2h");
    if (wanted("d2h_pinned")) check(std::memcmp(pinned->data(), pageable.p, n) == 0, "d2h_pinned data");
    // Pageable memory: the runtime's own pageable copy as the baseline, where the vendor takes one
    // (AscendCL documents no defined pageable copy, so there the pageable cases are not run).
    bool pageable_baseline = std::string(rt->name()) != "acl";
    if (pageable_baseline && (wanted("h2d_pageable") || wanted("d2h_pageable"))) {
      double base_pageable_h2d = timed_sync_copy(dev.p, pageable.p, CopyKind::kHostToDevice);
      engine_case("h2d_pageable", dev.p, pageable.p, CopyKind::kHostToDevice, base_pageable_h2d,
                  "runtime_sync_copy_pageable_h2d");
      if (wanted("h2d_pageable")) expect_device("h2d_pageable data");
      double base_pageable_d2h = timed_sync_copy(pageable_back.p, dev.p, CopyKind::kDeviceToHost);
      engine_case("d2h_pageable", pageable_back.p, dev.p, CopyKind::kDeviceToHost, base_pageable_d2h,
                  "runtime_sync_copy_pageable_d2h");
      if (wanted("d2h_pageable")) check(std::memcmp(pageable_back.p, pageable.p, n) == 0, "d2h_pageable data");
    } else if (!pageable_baseline && (wanted("h2d_pageable") || wanted("d2h_pageable"))) {
      std::printf(
          "{\"case\": \"h2d_pageable, d2h_pageable\", \"backend\": \"%s\", \"skipped\": \"no defined "
          "pageable runtime copy to compare with\"}\n",
          rt->name());
    }
    if (wanted("h2d_registered")) {
      HostBuf reg_buf(n);
      std::memcpy(reg_buf.p, pageable.p, n);
      auto reg = pool->register_buffer(reg_buf.p, n);
      engine_case("h2d_registered", dev.p, reg_buf.p, CopyKind::kHostToDevice, base_pinned_h2d,
                  "runtime_sync_copy_pinned_h2d");
      expect_device("h2d_registered data");
    }
    if (wanted("h2d_2d")) {
      // A 2-D copy of half of every 8 KiB row of pinned memory, vs a 1-D copy of the same bytes.
      size_t row = 4096, rows = n / (2 * row);
      auto plan = std::make_shared<CopyPlan>(std::vector<CopyDescriptor>{{0, 0, rows, row, 2 * row, row}});
      double base =
          median_seconds([&] { sync_copy(*rt, dev.p, pinned->data(), rows * row, CopyKind::kHostToDevice); }, g_reps);
      double secs = median_seconds(
          [&] { engine.wait(*engine.execute(plan, dev.p, n, pinned->data(), n, CopyKind::kHostToDevice), timeout); },
          g_reps);
      auto got = readback(*rt, *pool, dev.p, rows * row);
      bool ok = true;
      for (size_t r = 0; r < rows && ok; r += 97)
        ok = std::memcmp(got.data() + r * row, pageable.p + r * 2 * row, row) == 0;
      check(ok, "h2d_2d data");
      report("h2d_2d", *rt, rows * row, secs, "runtime_sync_copy_1d_same_bytes_h2d", base);
    }

    // --- Fused plans on host memory (engine on the h2h lane) vs one memcpy of the same bytes.
    auto plan_case = [&](const std::string& name, std::vector<CopyDescriptor> descs, size_t src_bytes, size_t dst_bytes,
                         const std::string& extra) {
      if (!wanted(name)) return;
      HostBuf src(src_bytes), dst(dst_bytes), flat(dst_bytes);
      fill(src.p, src_bytes, 3);
      auto plan = std::make_shared<CopyPlan>(descs);
      double base = median_seconds([&] { std::memcpy(flat.p, src.p, plan->bytes()); }, g_reps);
      double secs = median_seconds(
          [&] {
            engine.wait(*engine.execute(plan, dst.p, dst_bytes, src.p, src_bytes, CopyKind::kHostToHost), timeout);
          },
          g_reps);
      bool ok = true;
      for (const auto& d : descs)
        for (uint64_t r = 0; r < d.rows && ok; ++r)
          ok = std::memcmp(dst.p + d.dst_offset + r * d.dst_pitch, src.p + d.src_offset + r * d.src_pitch,
                           d.row_bytes) == 0;
      check(ok, name + " data");
      report(name, *rt, static_cast<double>(plan->bytes()), secs, "memcpy_same_bytes", base,
             extra + ", \"descriptors_in\": " + std::to_string(descs.size()) +
                 ", \"descriptors_coalesced\": " + std::to_string(plan->descriptors().size()));
    };
    {
      // 10,000 slices of 4 KiB taken every 8 KiB (a strided gather), and the same slices in random order.
      const size_t k = 10000, slice = 4096;
      std::vector<CopyDescriptor> strided, scattered;
      std::vector<size_t> perm(k);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), std::mt19937_64(5));
      for (size_t i = 0; i < k; ++i) {
        strided.push_back({i * 2 * slice, i * slice, 1, slice, slice, slice});
        scattered.push_back({perm[i] * 2 * slice, i * slice, 1, slice, slice, slice});
      }
      plan_case("plan_10k_strided_4KiB", strided, 2 * k * slice, k * slice, "");
      plan_case("plan_10k_scattered_4KiB", scattered, 2 * k * slice, k * slice, "");
    }
    {
      // QKV de-interleave, bf16: hidden 4096, 32 query heads, 8 KV heads, head_dim 128. Megatron holds
      // per group [q x4, k, v] rows of hidden elements; the inference side wants [Q; K; V].
      const size_t hidden = 4096, q_heads = 32, groups = 8, head_dim = 128, elt = 2;
      const size_t row = hidden * elt, q_per = q_heads / groups, group_rows = (q_per + 2) * head_dim;
      std::vector<CopyDescriptor> descs;
      size_t q_rows = q_heads * head_dim, kv_rows = groups * head_dim;
      for (size_t g = 0; g < groups; ++g) {
        size_t base = g * group_rows * row;
        size_t qb = q_per * head_dim * row, hb = head_dim * row;
        descs.push_back({base, g * qb, 1, qb, qb, qb});
        descs.push_back({base + qb, (q_rows + g * head_dim) * row, 1, hb, hb, hb});
        descs.push_back({base + qb + hb, (q_rows + kv_rows + g * head_dim) * row, 1, hb, hb, hb});
      }
      size_t total = groups * group_rows * row;
      plan_case("plan_qkv_deinterleave_h4096_q32_kv8_d128_bf16", descs, total, total, "");
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "msrl_bandwidth: %s\n", e.what());
    return 1;
  }
  return 0;
}
