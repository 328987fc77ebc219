// A tiny test harness: TEST(name) registers a case, CHECK* record a failure and end the case,
// run_all_tests() runs every case and returns the process exit status for ctest.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace check {

struct Failure {
  std::string message;
};

inline std::vector<std::pair<const char*, std::function<void()>>>& registry() {
  static std::vector<std::pair<const char*, std::function<void()>>> cases;
  return cases;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { registry().emplace_back(name, fn); }
};

template <class T>
std::string show(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

template <class T>
std::string show(const std::vector<T>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << +values[i];
  out << "]";
  return out.str();
}

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  throw Failure{std::string(file) + ":" + std::to_string(line) + ": " + what};
}

inline int run_all_tests() {
  int failed = 0;
  for (auto& [name, fn] : registry()) {
    try {
      fn();
      std::printf("[ ok ] %s\n", name);
    } catch (const Failure& f) {
      ++failed;
      std::printf("[FAIL] %s\n  %s\n", name, f.message.c_str());
    } catch (const std::exception& e) {
      ++failed;
      std::printf("[FAIL] %s\n  unexpected exception: %s\n", name, e.what());
    }
  }
  std::printf("%zu cases, %d failed\n", registry().size(), failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace check

#define TEST(name)                                             \
  static void name();                                          \
  static const check::Registrar name##_registrar(#name, name); \
  static void name()

#define CHECK(cond) ((cond) ? (void)0 : check::fail(__FILE__, __LINE__, "CHECK(" #cond ") failed"))

#define CHECK_EQ(a, b)                                                                   \
  do {                                                                                   \
    const auto check_a_ = (a); /* by value: (a) may point into a temporary */            \
    const auto check_b_ = (b);                                                           \
    if (!(check_a_ == check_b_)) {                                                       \
      check::fail(__FILE__, __LINE__,                                                    \
                  "CHECK_EQ(" #a ", " #b ") failed: " + check::show(check_a_) + " vs " + \
                      check::show(check_b_));                                            \
    }                                                                                    \
  } while (0)

// Expects `expr` to throw exactly `type` (or a subclass); returns nothing.
#define CHECK_THROWS(expr, type)                                                        \
  do {                                                                                  \
    bool check_thrown_ = false;                                                         \
    try {                                                                               \
      (void)(expr);                                                                     \
    } catch (const type&) {                                                             \
      check_thrown_ = true;                                                             \
    }                                                                                   \
    if (!check_thrown_) check::fail(__FILE__, __LINE__, #expr " did not throw " #type); \
  } while (0)
