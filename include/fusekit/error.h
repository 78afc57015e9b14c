// fusekit::Error and the check macro used by every entry point.
#pragma once

#include <charconv>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace fusekit {

/// The one exception type of fusekit. Every failure (bad arguments, a CUDA error, a missing
/// backend) throws it; library code never exits or aborts.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

// Message building without iostreams: no locale facets are involved, so messages are the same
// in every process, including extension modules that carry their own copy of the C++ library.
inline void append(std::string& s, std::string_view v) { s += v; }
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T>
  requires std::is_arithmetic_v<T>
void append(std::string& s, T v) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), v);
  s.append(buffer, result.ptr);
}

/// Concatenates strings and numbers into one message.
template <typename... Args>
[[nodiscard]] std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace detail
}  // namespace fusekit

/// Throws fusekit::Error with the concatenated message when `cond` is false.
/// The message should name the operator, the argument, what was expected and what came.
#define FUSEKIT_CHECK(cond, ...)                                                \
  do {                                                                          \
    if (!(cond)) [[unlikely]] {                                                 \
      throw ::fusekit::Error(::fusekit::detail::concat(__VA_ARGS__));           \
    }                                                                           \
  } while (0)
