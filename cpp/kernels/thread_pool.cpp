#include "thread_pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PYSERVE_PAUSE() _mm_pause()
#else
#define PYSERVE_PAUSE() std::this_thread::yield()
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define PYSERVE_HAS_ATFORK 1
#endif

namespace pyserve_kernels {
namespace {

std::atomic<ThreadPool*> the_pool{nullptr};
std::mutex the_pool_mutex;

#ifdef PYSERVE_HAS_ATFORK
// The child has none of the parent's worker threads, and the pool's mutexes may be held by a
// parent thread that does not exist there: leak the old pool, build a new one on first use.
void forget_pool_in_child() { the_pool.store(nullptr); }
#endif

int default_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

uint32_t generation_of(uint64_t ticket) { return static_cast<uint32_t>(ticket >> 32); }

// The chunk field of a run that is over: no chunk count reaches it.
constexpr uint64_t kClosed = 0xffffffffu;

}  // namespace

ThreadPool& ThreadPool::instance() {
  ThreadPool* pool = the_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  std::lock_guard<std::mutex> lock(the_pool_mutex);
  pool = the_pool.load();
  if (pool == nullptr) {
#ifdef PYSERVE_HAS_ATFORK
    static const int registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child);
    (void)registered;
#endif
    // never deleted: worker threads may still spin while the interpreter exits
    pool = new ThreadPool(default_threads());
    the_pool.store(pool, std::memory_order_release);
  }
  return *pool;
}

ThreadPool::ThreadPool(int threads) { start_workers(threads); }

ThreadPool::~ThreadPool() { stop_workers(); }

int ThreadPool::size() {
  std::lock_guard<std::mutex> lock(submit_mutex_);
  return size_;
}

void ThreadPool::resize(int threads) {
  std::lock_guard<std::mutex> lock(submit_mutex_);
  if (threads < 1) threads = 1;
  if (threads == size_) return;
  stop_workers();
  start_workers(threads);
}

void ThreadPool::start_workers(int threads) {
  size_ = threads < 1 ? 1 : threads;
  stopping_.store(false);
  // a worker starts from the generation of now, so a run right after this cannot be missed
  const uint32_t seen = generation_of(ticket_.load());
  for (int i = 1; i < size_; ++i) workers_.emplace_back([this, seen] { worker_loop(seen); });
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    stopping_.store(true);
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
  workers_.clear();
  size_ = 1;
}

void ThreadPool::run(Task task, void* context, int chunks) {
  if (chunks <= 0) return;
  std::lock_guard<std::mutex> lock(submit_mutex_);
  if (size_ == 1 || chunks == 1) {
    for (int i = 0; i < chunks; ++i) task(context, i);
    return;
  }
  // Close the previous run first: a worker still inside work() for it may hold a stale ticket
  // (its generation, the next chunk). Were chunks_ raised before the ticket changed, that worker
  // could claim a "chunk" of the old run against the new count and run the new task with it,
  // adding an extra done_ and leaving the wait below spinning forever (seen under load). With
  // the old generation's ticket set to kClosed its CAS fails, and kClosed is past any count.
  const uint32_t previous = generation_of(ticket_.load());
  ticket_.store(static_cast<uint64_t>(previous) << 32 | kClosed);
  task_ = task;
  context_ = context;
  chunks_.store(chunks, std::memory_order_release);  // after kClosed: see work()
  done_.store(0);
  const uint32_t generation = previous + 1;
  ticket_.store(static_cast<uint64_t>(generation) << 32);  // publishes the run (seq_cst)
  if (sleepers_.load() > 0) {
    {
      std::lock_guard<std::mutex> sleep_lock(sleep_mutex_);
    }
    wake_.notify_all();
  }
  work(generation);
  while (done_.load(std::memory_order_acquire) < chunks) PYSERVE_PAUSE();
}

void ThreadPool::work(uint32_t generation) {
  uint64_t ticket = ticket_.load();
  for (;;) {
    if (generation_of(ticket) != generation) return;
    const auto chunk = static_cast<uint32_t>(ticket & 0xffffffffu);
    // acquire: a count of the next run is only seen after its kClosed, so the CAS below fails
    if (chunk >= static_cast<uint32_t>(chunks_.load(std::memory_order_acquire))) return;
    // chunks_, task_ and context_ belong to this run for as long as a chunk of it is unfinished
    if (!ticket_.compare_exchange_weak(ticket, ticket + 1)) continue;
    task_(context_, static_cast<int>(chunk));
    done_.fetch_add(1, std::memory_order_release);
    ticket = ticket_.load();
  }
}

void ThreadPool::worker_loop(uint32_t seen) {
  using Clock = std::chrono::steady_clock;
  const auto current = [this] { return generation_of(ticket_.load(std::memory_order_acquire)); };
  for (;;) {
    // spin for a while: the next run usually comes within microseconds
    const auto spin_until = Clock::now() + std::chrono::microseconds(spin_us());
    unsigned spins = 0;
    while (current() == seen && !stopping_.load(std::memory_order_relaxed)) {
      std::this_thread::yield();
      if ((++spins & 63u) == 0 && Clock::now() > spin_until) break;
    }
    if (current() == seen && !stopping_.load()) {
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1);
      wake_.wait(lock, [&] { return current() != seen || stopping_.load(); });
      sleepers_.fetch_sub(1);
    }
    if (stopping_.load()) return;
    seen = current();
    work(seen);
  }
}

}  // namespace pyserve_kernels
