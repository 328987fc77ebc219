// A tiny pool for the kernels: `run(task, context, chunks)` calls task(context, i) once for every
// chunk i in [0, chunks), on whichever of the pool's threads claims it first (the caller works
// too), and returns when every chunk is done.
//
// Chunks are claimed, not assigned: on a busy machine a worker may be descheduled for a whole
// time slice, and a static split would make every call wait for it; here the other threads take
// its share, and a worker that wakes after the run has ended finds nothing left to claim.
//
// Why not OpenMP: torch links its own OpenMP runtime; a second one in this module would bring a
// second set of spinning threads onto the same cores. Why spin: a decode step calls the kernel
// ~120 times with short torch work in between, and a futex wake-up per call costs as much as the
// kernel's share of a small matrix. Idle workers spin for `spin_us`, then sleep on a condition
// variable; the submitting side pays for a notify only when one is asleep.
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
  using Task = void (*)(void* context, int chunk);

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
  void run(Task task, void* context, int chunks);

 private:
  void start_workers(int threads);
  void stop_workers();
  void worker_loop(uint32_t seen);
  // Claims and runs chunks of run `generation` until none is left.
  void work(uint32_t generation);

  std::mutex submit_mutex_;
  std::vector<std::thread> workers_;
  int size_ = 1;
  std::atomic<int> spin_us_{200};

  // The current run: ticket_ holds (generation << 32 | next unclaimed chunk), so a late worker
  // can never claim a chunk of a later run by mistake.
  Task task_ = nullptr;
  void* context_ = nullptr;
  std::atomic<int> chunks_{0};  // read by late workers before their claim fails
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stopping_{false};

  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

}  // namespace pyserve_kernels
