// Loading a vendor runtime with dlopen, shared by the cuda and acl backends.
#pragma once

#include <string>
#include <vector>

namespace msrl {

// The library to load: `explicit_path` if set, else the environment variable `env_var` if set, else the
// default sonames in order (the loader path, and copies already loaded by soname), then each soname in each
// of `dirs` that holds it. An explicit path or variable never falls back to the defaults.
std::vector<std::string> library_candidates(const std::string& explicit_path, const char* env_var,
                                            const std::vector<std::string>& defaults,
                                            const std::vector<std::string>& dirs = {});

// Opens the first candidate that loads (RTLD_NOW | RTLD_LOCAL) and stores its name in `*path`. Throws
// Unavailable naming every failure and `hint` (what to set) when none loads. The handle is never closed
// by the backends: pinned buffers, streams and events may outlive any one runtime object.
void* open_library(const std::vector<std::string>& candidates, const std::string& hint, std::string* path);

// The address of `symbol`. A missing required symbol closes the handle (nothing from the library is alive
// yet) and throws Unavailable saying that `path` is not `what`; a missing optional one returns nullptr.
void* library_symbol(void* handle, const char* symbol, const std::string& path, const char* what, bool required);

}  // namespace msrl
