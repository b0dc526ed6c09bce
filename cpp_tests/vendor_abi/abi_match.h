// Helpers for the vendor ABI conformance test: each conformance TU includes one of our ABI headers and the
// vendor's own header, and proves at compile time that every function we resolve with dlsym has exactly
// the vendor's type and every constant we use has the vendor's value. The test is the build itself.
#pragma once

#include <string_view>
#include <type_traits>

namespace abi_match {

// Ours<T> is the vendor type T with each vendor enum and handle type replaced by the one our ABI header
// declares for it. They are necessarily distinct C++ types (ours live in a namespace, the vendor's enums
// have no fixed underlying type), so each TU maps them one by one with MSRL_ABI_MAP after checking that the
// two are the same size and alignment. Every other type (int, unsigned, size_t, uint64_t, const char*, ...)
// must be identical, and so must the number and order of parameters.
template <class T>
struct Ours {
  using type = T;
};
template <class T>
using ours_t = typename Ours<T>::type;
template <class T>
struct Ours<T*> {
  using type = ours_t<T>*;
};
template <class T>
struct Ours<const T> {
  using type = const ours_t<T>;
};
template <class R, class... A>
struct Ours<R (*)(A...)> {
  using type = ours_t<R> (*)(ours_t<A>...);
};

}  // namespace abi_match

#define MSRL_ABI_STR_(x) #x
#define MSRL_ABI_STR(x) MSRL_ABI_STR_(x)  // x after macro expansion, as a string

// Maps the vendor type `vendor` to our `ours`: of one size and alignment, and both integers or enums or neither.
#define MSRL_ABI_MAP(vendor, ours)                                                                                  \
  static_assert(sizeof(vendor) == sizeof(ours) && alignof(vendor) == alignof(ours),                                 \
                #ours " does not have the size and alignment of the vendor's " #vendor);                            \
  static_assert(                                                                                                    \
      (std::is_enum_v<vendor> || std::is_integral_v<vendor>) == (std::is_enum_v<ours> || std::is_integral_v<ours>), \
      #ours " and the vendor's " #vendor " are not both integers");                                                 \
  template <>                                                                                                       \
  struct abi_match::Ours<vendor> {                                                                                  \
    using type = ours;                                                                                              \
  };

// Maps the vendor's opaque handle struct (only ever used through pointers) to ours.
#define MSRL_ABI_MAP_OPAQUE(vendor, ours)                                 \
  static_assert(std::is_class_v<vendor> && std::is_class_v<ours>, #ours); \
  template <>                                                             \
  struct abi_match::Ours<vendor> {                                        \
    using type = ours;                                                    \
  };

// Our enumerator ns::name has the value of the vendor's ::name (two different enum types).
#define MSRL_ABI_CHECK_ENUMERATOR(ns, name)                                         \
  static_assert(static_cast<long long>(ns::name) == static_cast<long long>(::name), \
                #name ": our value is not the vendor's");

// For X(name, ret, params) lists of our ABI headers, called as
//   MSRL_ABI_CHECK_FUNCTION(name, #name, our_namespace::name##_fn)
// so that `name` arrives here expanded by the vendor's macros and `spelled` as we wrote it: the vendor must
// declare the very symbol we resolve with dlsym, and its type, mapped to our types, must be ours.
#define MSRL_ABI_CHECK_FUNCTION(name, spelled, our_fn)                                                    \
  static_assert(std::string_view(#name) == spelled,                                                       \
                "the vendor header maps " spelled " to " #name ", not the symbol we resolve with dlsym"); \
  static_assert(std::is_same_v<abi_match::ours_t<decltype(&::name)>, our_fn>,                             \
                spelled ": our declaration does not match the vendor's");

// For X(type, name, value) lists: the vendor's `name` (an enumerator, a constant or a macro) equals ours.
#define MSRL_ABI_CHECK_CONSTANT(type, name, value)                                                \
  static_assert(static_cast<long long>(static_cast<type>(value)) == static_cast<long long>(name), \
                #name ": our value " #value " is not the vendor's");
