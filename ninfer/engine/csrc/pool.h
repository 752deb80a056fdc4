// The kernels' threads: the calling thread and `threads - 1` workers share each call's
// tasks, claiming them one at a time from a counter, so a thread the OS has taken off its
// core holds up at most the one task it claimed (the others take the rest), and the
// results never depend on which thread computed what (every task writes its own outputs).
//
// Between calls a worker spins for `spin_us` microseconds (a decode step's calls follow
// each other within microseconds), then sleeps until the next call: an idle server keeps
// no core busy, and a busy machine's other processes get the cores back.
//
// Where other processes take the cores, a worker is often taken off its core in the
// middle of a task, and the calling thread waits for it: the pool measures that wait, and
// when it grows past WAIT_SHARE of the calls' time it runs the next SOLO_CALLS calls on the
// calling thread alone (then tries the workers again). The numbers are the same either way.
//
// One call at a time: a second thread calling while one call runs gets its tasks run on
// its own thread (never the workers, whose call is another's).
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NINFER_PAUSE() _mm_pause()
#else
#define NINFER_PAUSE() std::this_thread::yield()
#endif

namespace ninfer {

class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() { resize(1, spin_us_); }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  int spin_us() const { return spin_us_; }

  void resize(int threads, int spin_us) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_ = false;
    spin_us_ = spin_us;
    for (int i = 1; i < threads; i++) workers_.emplace_back([this] { loop(); });
  }

  // fn(task) for task in [0, tasks), on this thread and the workers; returns when all are
  // done. Not reentrant: one call at a time (the engine thread's).
  void run(int tasks, const std::function<void(int)>& fn) {
    if (tasks <= 0) return;
    std::unique_lock<std::mutex> caller(call_mu_, std::try_to_lock);
    if (workers_.empty() || tasks == 1 || !caller.owns_lock() || solo_left_ > 0) {
      if (caller.owns_lock() && solo_left_ > 0) {
        solo_left_--;
        solo_calls_++;
      }
      for (int i = 0; i < tasks; i++) fn(i);
      return;
    }
    const auto began = std::chrono::steady_clock::now();
    fn_ = &fn;
    tasks_ = tasks;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store(gen << 32, std::memory_order_seq_cst);  // publishes the call
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    work(gen);
    const auto mine = std::chrono::steady_clock::now();
    for (uint32_t spins = 0; done_.load(std::memory_order_acquire) < tasks; spins++) {
      if (spins < 4096) {
        NINFER_PAUSE();
      } else {
        sched_yield();  // a worker holding a task was taken off its core
      }
    }
    const auto end = std::chrono::steady_clock::now();
    const double total = std::chrono::duration<double>(end - began).count();
    const double waited = std::chrono::duration<double>(end - mine).count();
    wait_share_ = 0.98 * wait_share_ + 0.02 * (total > 0 ? waited / total : 0.0);
    if (wait_share_ > WAIT_SHARE) {
      solo_left_ = SOLO_CALLS;
      wait_share_ = 0.0;
      solo_spells_++;
    }
  }

  // How many times the pool went solo, and the calls it ran so (the engine's statistics).
  uint64_t solo_spells() const { return solo_spells_; }
  uint64_t solo_calls() const { return solo_calls_; }

  // Calls run on the calling thread alone once waiting for the workers took over
  // WAIT_SHARE of the recent calls' time (a moving average over about fifty calls: a worker
  // preempted now and then by the server's own event loop does not trip it; another
  // process holding a core does): about three decode steps of SmolLM2.
  static constexpr int SOLO_CALLS = 512;
  static constexpr double WAIT_SHARE = 0.35;

 private:
  // Claim and run tasks of call `gen` until none is left.
  void work(uint64_t gen) {
    for (;;) {
      uint64_t c = claim_.load(std::memory_order_acquire);
      if ((c >> 32) != gen) return;
      const uint32_t task = static_cast<uint32_t>(c);
      if (task >= static_cast<uint32_t>(tasks_)) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      (*fn_)(static_cast<int>(task));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = claim_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      uint64_t gen = claim_.load(std::memory_order_acquire) >> 32;
      for (uint32_t i = 0; gen == seen; i++) {
        NINFER_PAUSE();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
        gen = claim_.load(std::memory_order_acquire) >> 32;
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] {
          return stop_ || (claim_.load(std::memory_order_seq_cst) >> 32) != seen;
        });
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        if (stop_) return;
        gen = claim_.load(std::memory_order_acquire) >> 32;
      }
      seen = gen;
      work(gen);
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> claim_{0};  // call generation << 32 | next task
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
  int spin_us_ = 100;
  std::mutex call_mu_;  // held by the thread whose call the workers run
  double wait_share_ = 0.0;  // recent share of a call's time spent waiting for workers
  int solo_left_ = 0;  // calls still to run alone
  uint64_t solo_spells_ = 0;
  uint64_t solo_calls_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace ninfer
