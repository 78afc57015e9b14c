// fusekit::Error and the check macro used by every entry point.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fusekit {

/// The one exception type of fusekit. Every failure (bad arguments, a CUDA error, a missing
/// backend) throws it; library code never exits or aborts.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// Concatenates anything streamable into one message.
template <typename... Args>
[[nodiscard]] std::string concat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
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
