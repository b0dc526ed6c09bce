#include "runtime/dl_library.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>

#include "common/error.h"

namespace msrl {

std::vector<std::string> library_candidates(const std::string& explicit_path, const char* env_var,
                                            const std::vector<std::string>& defaults,
                                            const std::vector<std::string>& dirs) {
  if (!explicit_path.empty()) return {explicit_path};
  const char* env = std::getenv(env_var);
  if (env != nullptr && *env != '\0') return {env};
  std::vector<std::string> out = defaults;
  for (const auto& dir : dirs) {
    for (const auto& soname : defaults) {
      std::string path = dir + "/" + soname;
      if (access(path.c_str(), R_OK) == 0) out.push_back(path);
    }
  }
  return out;
}

void* open_library(const std::vector<std::string>& candidates, const std::string& hint, std::string* path) {
  std::string tried;
  for (const auto& candidate : candidates) {
    void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      *path = candidate;
      return handle;
    }
    const char* why = dlerror();  // names the file
    tried += (tried.empty() ? "" : "; ") + (why != nullptr ? std::string(why) : candidate + ": dlopen failed");
  }
  MSRL_THROW(kUnavailable, "cannot load ", hint, ": ", tried);
}

void* library_symbol(void* handle, const char* symbol, const std::string& path, const char* what, bool required) {
  void* address = dlsym(handle, symbol);
  if (address == nullptr && required) {
    dlclose(handle);
    MSRL_THROW(kUnavailable, path, " lacks the symbol ", symbol, "; it is not ", what);
  }
  return address;
}

}  // namespace msrl
