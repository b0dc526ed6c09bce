// The vendor ABI conformance test. Its checks are the static_asserts of the conformance TUs, so it passes
// once it builds; running it reports what was checked, against which headers.
#include <cstdio>
#include <initializer_list>

const char* msrl_vendor_abi_cuda12(int* functions, int* constants);
const char* msrl_vendor_abi_cuda13(int* functions, int* constants);
const char* msrl_vendor_abi_acl(int* functions, int* constants);

int main() {
  for (auto* check : {msrl_vendor_abi_cuda12, msrl_vendor_abi_cuda13, msrl_vendor_abi_acl}) {
    int functions = 0, constants = 0;
    const char* against = check(&functions, &constants);
    std::printf("%d functions and %d constants match %s\n", functions, constants, against);
    if (functions == 0 || constants == 0) return 1;
  }
  return 0;
}
