// A stress program for the kernels' thread pool (ninfer/engine/csrc/pool.h, included as
// it is): millions of short calls whose task count alternates (2, then 3 to 31 at random),
// each task stamping its slot with the call's number and counting its runs, and the
// caller checking every slot as soon as `run()` returns. Optionally beside busy processes
// (each spinning on a core), with more pool threads than cores, so that threads are taken
// off their cores at every point of the publish protocol.
//
// It counts, over all calls:
//   early     a call that returned before one of its tasks had finished (the slot was
//             begun by this call but not ended), or whose task was never run;
//   double    a task run twice (or run by a later call's claim);
//   foreign   a slot past the call's task count stamped by the call;
// Then KERNEL_CALLS calls of a real kernel as the server makes them (the plain build's packed
// matrix product, linear_into's split of panels among tasks, with the task count and the
// row count changing every call), each output compared bit for bit with the same product
// on one thread:
//   wrong     an output that differs;
// and exits 1 if any count is non-zero. Built twice by the tests and `./dev.sh
// pool-stress`, optimized and with -fsanitize=thread (ThreadSanitizer then reports any
// access to a task's writes, or to the pool's own fields, that the protocol leaves
// unordered), each with the plain kernels (isa_default.cpp) linked in.
//
// usage: pool_stress CALLS KERNEL_CALLS THREADS BUSY [SPIN_US [SEED]]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "api.h"
#include "pack.h"
#include "pool.h"

namespace {

constexpr int SLOTS = 32;

struct Slot {  // one task's marks, on its own cache line; plain fields on purpose:
  alignas(64) uint64_t begun = 0;  // ThreadSanitizer flags any access the pool leaves
  uint64_t ended = 0;              // unordered
  uint64_t runs = 0;
  uint64_t result = 0;  // the task's work, kept so that it is done
};

Slot slots[SLOTS];

// A task's work: a few hundred nanoseconds of arithmetic, more for some tasks, so that
// tasks overlap and finish out of order.
uint64_t busy_work(uint64_t seed, int rounds) {
  uint64_t x = seed | 1;
  for (int i = 0; i < rounds; i++) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
  return x;
}

// A packed matrix of N outputs by K inputs in U4H (Q4_1's format): random codes, scales
// and offsets that are exact halves.
constexpr int N = 512, K = 64, MAX_ROWS = 7;  // 4-7: the GEMM path, groups of 4 and the rest

std::vector<uint8_t> random_matrix(std::mt19937& rng) {
  std::vector<uint8_t> packed(ninfer::packed_bytes(ninfer::FMT_U4H, N, K));
  ninfer::Row row;
  row.codes.resize(K);
  row.scale.resize(K / 16);
  row.offset.resize(K / 16);
  for (int n = 0; n < N; n++) {
    for (int i = 0; i < K; i++) row.codes[i] = static_cast<int8_t>(rng() % 16);
    for (int g = 0; g < K / 16; g += 2) {  // one scale and offset a 32-input block
      row.scale[g] = row.scale[g + 1] = static_cast<float>(1 + rng() % 64) / 1024.0f;
      row.offset[g] = row.offset[g + 1] = -static_cast<float>(rng() % 64) / 128.0f;
    }
    ninfer::pack_row(row, ninfer::FMT_U4H, n, K, packed.data());
  }
  return packed;
}

// y = x W^T on the pool, `tasks` tasks sharing the panels, and first, on the GEMM
// path, sharing x's row groups to pack (ops.cpp's linear_into).
void linear(ninfer::Pool& pool, const ninfer::Kernels* kr, const float* x, int m,
            const ninfer::Matrix& w, int tasks, float* y) {
  const int panels = (w.n + 15) / 16, qb = ninfer::format_block(w.format);
  std::vector<float> sums(static_cast<size_t>(m) * (w.k / qb));
  kr->sums(x, m, w.k, w.k, qb, sums.data());
  std::vector<float> packed;
  if (m > kr->gemv_max) {
    packed.resize(static_cast<size_t>(m) * w.k);
    const int groups = (m + kr->gemm_mr - 1) / kr->gemm_mr;
    pool.run(tasks, [&](int t) {
      const int r0 = groups * t / tasks * kr->gemm_mr;
      const int r1 = std::min(m, groups * (t + 1) / tasks * kr->gemm_mr);
      kr->pack(x, m, w.k, w.k, r0, r1, packed.data());
    });
  }
  const float* xp = packed.empty() ? nullptr : packed.data();
  pool.run(tasks, [&](int t) {
    const int p0 = panels * t / tasks, p1 = panels * (t + 1) / tasks;
    kr->linear(x, m, w.k, sums.data(), w, p0, p1, y, w.n, xp);
  });
}

// The kernel phase: the number of outputs that differed from one thread's.
uint64_t kernel_calls(ninfer::Pool& pool, uint64_t calls, std::mt19937& rng) {
  const ninfer::Kernels* kr = ninfer_kernels_default();
  const std::vector<uint8_t> packed = random_matrix(rng);
  const ninfer::Matrix w{packed.data(), ninfer::FMT_U4H, N, K};
  std::vector<float> x(static_cast<size_t>(MAX_ROWS) * K);
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 512.0f;
  std::vector<float> want(static_cast<size_t>(MAX_ROWS) * N), got(want.size());
  std::vector<std::vector<float>> alone(MAX_ROWS + 1);
  for (int m = 1; m <= MAX_ROWS; m++) {  // each row count on one thread, one task
    alone[m].resize(static_cast<size_t>(m) * N);
    const int panels = N / 16;
    std::vector<float> sums(static_cast<size_t>(m) * (K / 32));
    kr->sums(x.data(), m, K, K, 32, sums.data());
    std::vector<float> packed(static_cast<size_t>(m) * K);
    kr->pack(x.data(), m, K, K, 0, m, packed.data());
    kr->linear(x.data(), m, K, sums.data(), w, 0, panels, alone[m].data(), N, packed.data());
  }
  uint64_t wrong = 0;
  for (uint64_t call = 1; call <= calls; call++) {
    const int m = 1 + static_cast<int>(rng() % MAX_ROWS);
    const int tasks = call % 2 ? 2 : 3 + static_cast<int>(rng() % 29);
    std::fill(got.begin(), got.end(), std::nanf(""));
    linear(pool, kr, x.data(), m, w, tasks, got.data());
    for (size_t i = 0; i < static_cast<size_t>(m) * N; i++)
      if (std::memcmp(&got[i], &alone[m][i], sizeof(float)) != 0) wrong++;
  }
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s CALLS KERNEL_CALLS THREADS BUSY [SPIN_US [SEED]]\n", argv[0]);
    return 2;
  }
  const uint64_t calls = std::strtoull(argv[1], nullptr, 10);
  const uint64_t linear_calls = std::strtoull(argv[2], nullptr, 10);
  const int threads = std::atoi(argv[3]);
  const int busy = std::atoi(argv[4]);
  const int spin_us = argc > 5 ? std::atoi(argv[5]) : 100;
  const unsigned seed = argc > 6 ? static_cast<unsigned>(std::atoi(argv[6])) : 1;

  std::vector<pid_t> hogs;
  for (int i = 0; i < busy; i++) {
    const pid_t pid = fork();
    if (pid == 0) {
#if defined(__linux__)
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a busy process never outlives the program
      if (getppid() == 1) _exit(0);      // (the program already gone)
#endif
      volatile uint64_t sink = 0;
      for (uint64_t x = static_cast<uint64_t>(i);; x++) sink = busy_work(x, 1 << 20);
    }
    if (pid > 0) hogs.push_back(pid);
  }

  ninfer::Pool pool;
  pool.resize(threads, spin_us);
  pool.allow_solo(false);  // keep the workers in every call
  std::mt19937 rng(seed);
  uint64_t early = 0, twice = 0, foreign = 0;
  const auto began = std::chrono::steady_clock::now();
  for (uint64_t call = 1; call <= calls; call++) {
    const int tasks = call % 2 ? 2 : 3 + static_cast<int>(rng() % 29);
    const int heavy = static_cast<int>(rng() % SLOTS);
    // a new function object each call, holding the call's number by value: a task run
    // through a previous call's function stamps the wrong number
    pool.run(tasks, [call, heavy](int t) {
      Slot& s = slots[t];
      s.begun = call;
      s.result = busy_work(call + static_cast<uint64_t>(t), t == heavy ? 400 : 40);
      s.runs += 1;
      s.ended = call;
    });
    for (int t = 0; t < SLOTS; t++) {
      Slot& s = slots[t];
      if (t < tasks) {
        if (s.ended != call) early++;
        if (s.runs > 1) twice++;
        s.runs = 0;
      } else if (s.begun == call || s.ended == call) {
        foreign++;
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  const auto kernel_began = std::chrono::steady_clock::now();
  const uint64_t wrong = kernel_calls(pool, linear_calls, rng);
  const double kernel_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - kernel_began).count();
  for (pid_t pid : hogs) kill(pid, SIGKILL);
  for (pid_t pid : hogs) waitpid(pid, nullptr, 0);
  std::printf(
      "calls %llu threads %d busy %d: early %llu double %llu foreign %llu (%.1f s, %.2f us a "
      "call); kernel calls %llu: wrong %llu (%.1f s)\n",
      static_cast<unsigned long long>(calls), threads, busy,
      static_cast<unsigned long long>(early), static_cast<unsigned long long>(twice),
      static_cast<unsigned long long>(foreign), seconds, seconds / calls * 1e6,
      static_cast<unsigned long long>(linear_calls), static_cast<unsigned long long>(wrong),
      kernel_seconds);
  return early || twice || foreign || wrong ? 1 : 0;
}
