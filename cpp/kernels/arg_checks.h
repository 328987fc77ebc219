// Helpers for the kernels' argument checks: a failed check raises std::invalid_argument (pybind11
// turns it into ValueError), and index arrays may hold int32 or int64.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace pyserve_kernels {

inline void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// The same with a message that costs something to build (numbers formatted into it): `make` runs
// only when the check fails. The checks of every block id and slot run on every call.
template <class MakeMessage, class = decltype(std::string(std::declval<MakeMessage&>()()))>
inline void check(bool ok, MakeMessage&& make) {
  if (!ok) throw std::invalid_argument(make());
}

// Element i of an int32 (bytes = 4) or int64 (bytes = 8) array: block ids, context lengths.
inline int64_t index_at(const void* base, int bytes, int64_t i) {
  return bytes == 4 ? static_cast<const int32_t*>(base)[i] : static_cast<const int64_t*>(base)[i];
}

}  // namespace pyserve_kernels
