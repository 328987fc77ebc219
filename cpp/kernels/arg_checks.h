// Helpers for the kernels' argument checks: a failed check raises std::invalid_argument (pybind11
// turns it into ValueError), and index arrays may hold int32 or int64.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyserve_kernels {

inline void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// Element i of an int32 (bytes = 4) or int64 (bytes = 8) array: block ids, context lengths.
inline int64_t index_at(const void* base, int bytes, int64_t i) {
  return bytes == 4 ? static_cast<const int32_t*>(base)[i] : static_cast<const int64_t*>(base)[i];
}

}  // namespace pyserve_kernels
