// Typed errors of the scheduling core. The bindings map each to one Python exception, so the
// core never aborts the process: every bad argument or broken protocol surfaces as an exception
// with a message that names the offending value.
#pragma once

#include <stdexcept>
#include <string>

namespace pyserve {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad value: a size, a token id, a block id, a duplicate request id. -> ValueError
class ValueError : public Error {
 public:
  using Error::Error;
};

// An unknown request id. -> KeyError
class KeyError : public Error {
 public:
  using Error::Error;
};

// The caller broke the protocol (a report for a step never planned, out of order) or asked for
// more than exists (allocating from an exhausted pool). -> RuntimeError
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// check_invariants() found the state inconsistent: a bug in the core. -> RuntimeError
class InvariantError : public Error {
 public:
  using Error::Error;
};

}  // namespace pyserve
