// Guarded<T>: how a core object is exposed to Python.
//
// The core is single-threaded; every call takes the object's mutex, so a scheduler thread and the
// event loop can both call in. Calls that can run long release the GIL before they take the
// mutex; short ones keep it. No thread ever waits for the GIL while it holds the mutex (f never
// touches Python, and the GIL is taken back only after the mutex is unlocked), so a thread that
// waits for the mutex, with or without the GIL, cannot deadlock.
// Objects that share state share one mutex: `planner.cache` and `planner.allocator` lock the
// planner's mutex, and a RadixCache built on a BlockAllocator locks the allocator's.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <utility>

namespace pyserve_bindings {

namespace py = pybind11;

template <class T>
struct Guarded {
  std::shared_ptr<T> obj;  // may alias an owner (the planner) that it keeps alive
  std::shared_ptr<std::mutex> mutex;

  // Runs f(obj) under the mutex with the GIL released. f must not touch Python objects (nor in
  // maybe_released below, which runs f with or without the GIL).
  template <class F>
  auto released(F&& f) {
    py::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> lock(*mutex);
    return f(*obj);
  }

  // Runs f(obj) under the mutex, releasing the GIL only when the call is long (`long_call`) or
  // the mutex is taken: a release and re-acquire of the GIL costs more than a short call itself,
  // and another thread may take the GIL meanwhile and make this one wait for a switch interval.
  template <class F>
  auto maybe_released(bool long_call, F&& f) {
    if (!long_call) {
      std::unique_lock<std::mutex> lock(*mutex, std::try_to_lock);
      if (lock.owns_lock()) return f(*obj);
    }
    return released(std::forward<F>(f));
  }

  // Runs f(obj) under the mutex, keeping the GIL: for calls too short to be worth a release.
  template <class F>
  auto held(F&& f) {
    std::lock_guard<std::mutex> lock(*mutex);
    return f(*obj);
  }
};

void bind_block_allocator(py::module_& m);
void bind_radix_cache(py::module_& m);
void bind_planner(py::module_& m);
void bind_ngram(py::module_& m);

}  // namespace pyserve_bindings
