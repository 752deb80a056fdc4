// The kernels' threads: the calling thread and `threads - 1` workers share each call's
// tasks, claiming them one at a time from a counter, so a thread the OS has taken off its
// core holds up at most the one task it claimed (the others take the rest), and the
// results never depend on which thread computed what (every task writes its own outputs).
//
// The publish protocol (what makes a claim safe; docs/engine.md, "The kernels' pool"):
//
// - One 64-bit atomic word, `claim_`, holds a call's generation (40 bits), its task count
//   (12 bits) and the next unclaimed task (12 bits). The caller writes the call's
//   function (`fn_`) and resets `done_`, then stores the new word with release order:
//   the generation and the task count become visible in one step, together.
// - A thread claims task t of generation g only by a compare-exchange from (g, n, t) to
//   (g, n, t + 1) with t < n, both read from that same word. A worker that read an older
//   word fails its exchange once the word has moved on, so it can never run a task of a
//   call it did not claim, nor compare a task index with another call's count. Its
//   successful exchange acquires the caller's release store (a release sequence of
//   exchanges), so it sees that call's `fn_`.
// - Each claimed task, once run, adds 1 to `done_` with release order; the caller returns
//   when `done_` reaches n (acquire), so every task's writes happen before `run()`
//   returns, and the caller writes the next call's `fn_` and `done_` only after every
//   claimant of this one has finished with them.
// - An exchange could only succeed wrongly if the word came back to the very value a
//   worker read, which takes 2^40 calls while that worker sits between two instructions.
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
  // The word's fields: generation | tasks | next task.
  static constexpr int COUNT_BITS = 12;
  static constexpr int MAX_TASKS = (1 << COUNT_BITS) - 1;  // more run as slots of several
  static constexpr uint64_t COUNT_MASK = MAX_TASKS;
  static constexpr int GEN_SHIFT = 2 * COUNT_BITS;

  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() { resize(1, spin_us_); }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  int spin_us() const { return spin_us_; }

  // Not while a call runs (the engine thread configures, then calls).
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

  // Whether the pool may go solo under load (on by default; the stress program turns it
  // off to keep the workers in every call).
  void allow_solo(bool allow) { allow_solo_ = allow; }

  // fn(task) for task in [0, tasks), on this thread and the workers; returns when all are
  // done, with every task's writes visible to the caller. One call at a time (the engine
  // thread's); a call made while another runs runs on its own thread.
  void run(int tasks, const std::function<void(int)>& fn) {
    if (tasks <= 0) return;
    if (tasks > MAX_TASKS) {  // MAX_TASKS slots, slot s running tasks s, s + MAX_TASKS, ...
      run(MAX_TASKS, [&](int slot) {
        for (int t = slot; t < tasks; t += MAX_TASKS) fn(t);
      });
      return;
    }
    std::unique_lock<std::mutex> caller(call_mu_, std::try_to_lock);
    if (!caller.owns_lock()) {
      for (int i = 0; i < tasks; i++) fn(i);
      return;
    }
    if (workers_.empty() || tasks == 1 || solo_left_ > 0) {
      if (solo_left_ > 0) {
        solo_left_--;
        solo_calls_.fetch_add(1, std::memory_order_relaxed);
      }
      for (int i = 0; i < tasks; i++) fn(i);
      return;
    }
    const auto began = std::chrono::steady_clock::now();
    fn_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ((claim_.load(std::memory_order_relaxed) >> GEN_SHIFT) + 1) & GEN_MASK;
    // publishes the call: its generation and task count in one store (the release makes
    // fn_ and done_ visible to whoever claims a task of it)
    claim_.store(gen << GEN_SHIFT | static_cast<uint64_t>(tasks) << COUNT_BITS,
                 std::memory_order_seq_cst);
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
    if (wait_share_ > WAIT_SHARE && allow_solo_) {
      solo_left_ = SOLO_CALLS;
      wait_share_ = 0.0;
      solo_spells_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // How many times the pool went solo, and the calls it ran so (the engine's statistics).
  uint64_t solo_spells() const { return solo_spells_.load(std::memory_order_relaxed); }
  uint64_t solo_calls() const { return solo_calls_.load(std::memory_order_relaxed); }

  // Calls run on the calling thread alone once waiting for the workers took over
  // WAIT_SHARE of the recent calls' time (a moving average over about fifty calls: a worker
  // preempted now and then by the server's own event loop does not trip it; another
  // process holding a core does): about three decode steps of SmolLM2.
  static constexpr int SOLO_CALLS = 512;
  static constexpr double WAIT_SHARE = 0.35;

 private:
  static constexpr uint64_t GEN_MASK = (uint64_t{1} << (64 - GEN_SHIFT)) - 1;

  // Claim and run tasks of call `gen` until none is left (or the word has moved on).
  void work(uint64_t gen) {
    for (;;) {
      uint64_t c = claim_.load(std::memory_order_acquire);
      if ((c >> GEN_SHIFT) != gen) return;
      const uint32_t task = static_cast<uint32_t>(c & COUNT_MASK);
      if (task >= static_cast<uint32_t>((c >> COUNT_BITS) & COUNT_MASK)) return;
      // (g, n, t) -> (g, n, t + 1): t < n <= MAX_TASKS, so the count field is untouched
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      (*fn_)(static_cast<int>(task));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = claim_.load(std::memory_order_acquire) >> GEN_SHIFT;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      uint64_t gen = claim_.load(std::memory_order_acquire) >> GEN_SHIFT;
      for (uint32_t i = 0; gen == seen; i++) {
        NINFER_PAUSE();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
        gen = claim_.load(std::memory_order_acquire) >> GEN_SHIFT;
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] {
          return stop_ || (claim_.load(std::memory_order_seq_cst) >> GEN_SHIFT) != seen;
        });
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        if (stop_) return;
        gen = claim_.load(std::memory_order_acquire) >> GEN_SHIFT;
      }
      seen = gen;
      work(gen);
    }
  }

  // Each atomic on a cache line of its own: the claims' exchanges, the finished tasks'
  // count and the sleepers' count are written by different threads at different moments.
  // fn_ shares the claim word's line: written just before it, read just after it.
  alignas(64) std::atomic<uint64_t> claim_{0};  // generation | tasks | next task
  const std::function<void(int)>* fn_ = nullptr;
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<int> sleeping_{0};
  alignas(64) std::vector<std::thread> workers_;
  int spin_us_ = 100;
  bool allow_solo_ = true;
  std::mutex call_mu_;  // held by the thread whose call the workers run
  double wait_share_ = 0.0;  // recent share of a call's time spent waiting for workers
  int solo_left_ = 0;  // calls still to run alone
  std::atomic<uint64_t> solo_spells_{0};
  std::atomic<uint64_t> solo_calls_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace ninfer
