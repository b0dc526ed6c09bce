// Finding the vendor library where pip puts it: CUDA 13 wheels ship libcudart in nvidia/cu13/lib, which is
// not on the loader path, so a process that did not import torch first found no CUDA (issue 17, defect 3).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/error.h"
#include "fake_control.h"
#include "runtime/device_runtime.h"
#include "runtime/dl_library.h"

namespace msrl {
namespace {

namespace fs = std::filesystem;

// A folder holding `name` as a link to `target`, removed at the end of the test.
struct LibraryFolder {
  LibraryFolder(const std::string& tag, const std::string& target, const std::string& name)
      : dir(fs::temp_directory_path() / ("msrl_" + tag + "_" + std::to_string(getpid()))) {
    fs::create_directories(dir);
    fs::create_symlink(target, dir / name);
  }
  ~LibraryFolder() { fs::remove_all(dir); }
  fs::path dir;
};

// The sonames first (the loader path, or a copy torch already loaded), then each folder that holds one.
TEST(RuntimeDiscovery, CandidatesAreTheSonamesThenTheFoldersHoldingThem) {
  LibraryFolder wheel("cu13", MSRL_FAKE_CUDART, "libcudart.so.13");
  auto c = library_candidates("", "MSRL_TEST_UNSET_VARIABLE", {"libcudart.so.13", "libcudart.so.12"},
                              {"/nonexistent/nvidia/cuda_runtime/lib", wheel.dir.string()});
  std::vector<std::string> want{"libcudart.so.13", "libcudart.so.12", (wheel.dir / "libcudart.so.13").string()};
  EXPECT_EQ(c, want);
  // An explicit path never falls back.
  EXPECT_EQ(
      library_candidates("/x/libcudart.so", "MSRL_TEST_UNSET_VARIABLE", {"libcudart.so.13"}, {wheel.dir.string()}),
      std::vector<std::string>{"/x/libcudart.so"});
}

// End to end on the acl backend (this machine has no libascendcl.so on its loader path).
TEST(RuntimeDiscovery, LibraryFoldersAreSearchedAfterTheSonames) {
  msrl::testing::FakeLibrary fake(MSRL_FAKE_ASCENDCL, "fake_ascendcl");
  fake.reset();
  fake.set_device_count(1);
  LibraryFolder folder("ascend", MSRL_FAKE_ASCENDCL, "libascendcl.so");
  const char* saved = std::getenv("MSRL_ASCENDCL_PATH");
  std::string restore = saved != nullptr ? saved : "";
  unsetenv("MSRL_ASCENDCL_PATH");
  set_library_dirs("npu", {"/nonexistent/lib64", folder.dir.string()});
  EXPECT_EQ(library_dirs("acl").size(), 2u);  // the backend's other names work too
  auto rt = make_acl_runtime();
  EXPECT_STREQ(rt->name(), "acl");
  EXPECT_EQ(rt->device_count(), 1);
  set_library_dirs("acl", {});
  EXPECT_TRUE(library_dirs("acl").empty());
  try {
    set_library_dirs("host", {folder.dir.string()});
    ADD_FAILURE() << "the host backend loads no library";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
  }
  if (saved != nullptr) setenv("MSRL_ASCENDCL_PATH", restore.c_str(), 1);
}

}  // namespace
}  // namespace msrl
