// A test's handle on a fake vendor library (fake_cudart.cpp, fake_ascendcl.cpp): the same instance the
// backend loads (dlopen of the same path), its control functions (error injection, counters, stream holds,
// device count, shutdown, copy cost) and any vendor entry point by name.
#pragma once

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <string>

namespace msrl::testing {

class FakeLibrary {
 public:
  FakeLibrary(const char* path, const char* prefix) : prefix_(prefix), lib_(dlopen(path, RTLD_NOW | RTLD_LOCAL)) {
    EXPECT_NE(lib_, nullptr) << dlerror();
    if (lib_ == nullptr) return;
    fail_next_ = control<void (*)(const char*, int)>("_fail_next");
    stat_ = control<long long (*)(const char*)>("_stat");
    hold_ = control<void (*)(void*, int)>("_hold_stream");
    set_device_count_ = control<void (*)(int)>("_set_device_count");
    shutdown_ = control<void (*)(int)>("_shutdown");
    set_copy_cost_ = control<void (*)(double)>("_set_copy_cost");
    reset_ = control<void (*)()>("_reset");
  }
  ~FakeLibrary() {
    if (lib_ != nullptr) dlclose(lib_);
  }
  FakeLibrary(const FakeLibrary&) = delete;
  FakeLibrary& operator=(const FakeLibrary&) = delete;

  bool loaded() const { return lib_ != nullptr; }
  void fail_next(const char* fn, int code) { fail_next_(fn, code); }
  long long stat(const std::string& key) { return stat_(key.c_str()); }
  // A null stream: the default stream of the calling thread's current device (a long-running kernel there).
  void hold(void* stream, bool held) { hold_(stream, held ? 1 : 0); }
  void set_device_count(int n) { set_device_count_(n); }
  void shutdown(int code) { shutdown_(code); }
  void set_copy_cost(double ns_per_byte) { set_copy_cost_(ns_per_byte); }
  void reset() { reset_(); }

  // A vendor entry point, e.g. symbol<int (*)()>("cudaPeekAtLastError").
  template <typename Fn>
  Fn symbol(const char* name) {
    auto fn = reinterpret_cast<Fn>(dlsym(lib_, name));
    EXPECT_NE(fn, nullptr) << name;
    return fn;
  }

 private:
  template <typename Fn>
  Fn control(const char* suffix) {
    return symbol<Fn>((prefix_ + suffix).c_str());
  }

  std::string prefix_;
  void* lib_;
  void (*fail_next_)(const char*, int) = nullptr;
  long long (*stat_)(const char*) = nullptr;
  void (*hold_)(void*, int) = nullptr;
  void (*set_device_count_)(int) = nullptr;
  void (*shutdown_)(int) = nullptr;
  void (*set_copy_cost_)(double) = nullptr;
  void (*reset_)() = nullptr;
};

}  // namespace msrl::testing
