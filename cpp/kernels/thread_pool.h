// A tiny fork-join pool for the kernels: `run(task)` calls task(context, i, n) once on each of
// the pool's n threads (the caller is i = 0) and returns when all are done.
//
// Why not OpenMP: torch links its own OpenMP runtime; a second one in this module would bring a
// second set of spinning threads onto the same cores. Why spin: a decode step calls the kernel
// ~120 times with short torch work in between; a futex wake-up per call costs more than the
// kernel's own share on a small matrix. Workers therefore spin for `spin_us` after each task and
// only then sleep on a condition variable; the submitting side pays for a notify only when a
// worker is asleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pyserve_kernels {

class ThreadPool {
 public:
  using Task = void (*)(void* context, int index, int count);

  // The process's pool (rebuilt in a child after fork: a child inherits no threads).
  static ThreadPool& instance();

  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size();
  void resize(int threads);
  int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
  void set_spin_us(int us) { spin_us_.store(us, std::memory_order_relaxed); }

  // One run at a time; concurrent callers queue on a mutex.
  void run(Task task, void* context);

 private:
  void start_workers(int threads);
  void stop_workers();
  void worker_loop(int index, uint64_t seen);

  std::mutex submit_mutex_;
  std::vector<std::thread> workers_;
  int size_ = 1;
  std::atomic<int> spin_us_{200};

  // the current task, published by bumping generation_
  Task task_ = nullptr;
  void* context_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stopping_{false};

  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

}  // namespace pyserve_kernels
