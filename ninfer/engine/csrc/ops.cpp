// ninfer's native kernels as torch operators (namespace `ninfer`), and the model's layers as
// one native call a forward pass (the class `ninfer.Layers`). Loaded by
// ninfer/engine/_kernels.py, which builds this library from these sources.
//
// Which build of the kernels runs (default, avx2, avx512) is chosen once by `configure`:
// the engine asks for the instruction set torch itself dispatches to (so
// ATEN_CPU_CAPABILITY=avx2 makes both torch and these kernels compute as an AVX2 CPU
// would), never one the CPU lacks. Every build gives the same numbers (api.h).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "pack.h"
#include "pool.h"

namespace ninfer {
namespace {

const Kernels* g_kernels = nullptr;
Pool g_pool;

bool cpu_has(const std::string& isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  return isa == "default";
}

const Kernels* kernels() {
  TORCH_CHECK(g_kernels != nullptr, "ninfer kernels: configure() first");
  return g_kernels;
}

// The instruction set in use, after asking for `isa` (default, avx2 or avx512), with
// `threads` threads that spin `spin_us` between calls.
std::string configure(std::string isa, int64_t threads, int64_t spin_us) {
  TORCH_CHECK(isa == "default" || isa == "avx2" || isa == "avx512", "unknown isa ", isa);
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run the ", isa, " kernels");
  TORCH_CHECK(threads >= 1 && threads <= 1024, "threads must be 1..1024");
#if defined(__x86_64__)
  g_kernels = isa == "avx512" ? ninfer_kernels_avx512()
              : isa == "avx2" ? ninfer_kernels_avx2()
                              : ninfer_kernels_default();
#else
  g_kernels = ninfer_kernels_default();
#endif
  if (g_pool.threads() != threads || g_pool.spin_us() != spin_us)
    g_pool.resize(static_cast<int>(threads), static_cast<int>(spin_us));
  return g_kernels->name;
}

bool supports(std::string isa) { return cpu_has(isa); }

// The pool: its threads, how many times other processes' load sent it solo, and the calls
// it ran alone because of that.
std::vector<int64_t> pool_stats() {
  return {g_pool.threads(), static_cast<int64_t>(g_pool.solo_spells()),
          static_cast<int64_t>(g_pool.solo_calls())};
}

// Tasks for `units` units of work: a few per thread, so a thread that is late costs little.
int tasks_for(int units, int min_units) {
  const int by_size = std::max(1, units / std::max(1, min_units));
  return std::max(1, std::min({units, by_size, g_pool.threads() * 4}));
}

// Task t of `tasks`'s share of `items` items dealt out whole `unit`s at a time: [first, last).
std::pair<int, int> share(int items, int unit, int t, int tasks) {
  const int64_t units = (items + unit - 1) / unit;
  return {static_cast<int>(std::min<int64_t>(items, units * t / tasks * unit)),
          static_cast<int>(std::min<int64_t>(items, units * (t + 1) / tasks * unit))};
}

// ---- packing ---------------------------------------------------------------------------

int64_t pack_format(std::vector<std::string> types) { return stack_format(types); }

int64_t packed_size(int64_t format, int64_t n, int64_t k) {
  return static_cast<int64_t>(packed_bytes(static_cast<int>(layout_of(static_cast<int>(format)).format),
                                           static_cast<int>(n), static_cast<int>(k)));
}

// The tensors (each (rows, bytes a row) uint8, as the file stores them) stacked along
// their outputs, packed in `format` (pack_format of their types) into `out` (a contiguous
// uint8 CPU tensor of packed_size bytes, 64-byte aligned, not yet written: the engine
// packs a model into parts of large buffers that ask for huge pages, _native.PackArena).
void pack_into(std::vector<at::Tensor> raws, std::vector<std::string> types, int64_t k,
               int64_t format, at::Tensor out) {
  TORCH_CHECK(raws.size() == types.size() && !raws.empty(), "one type a tensor");
  TORCH_CHECK(k % 32 == 0, "inputs must be a whole number of 32-input blocks");
  int64_t n = 0;
  for (size_t i = 0; i < raws.size(); i++) {
    TORCH_CHECK(raws[i].dtype() == at::kByte && raws[i].dim() == 2 && raws[i].is_contiguous(),
                "raw rows: contiguous (rows, bytes) uint8");
    const int block = type_block(types[i]);
    TORCH_CHECK(k % block == 0, types[i], " rows of ", k, " inputs");
    TORCH_CHECK(raws[i].size(1) == k / block * type_bytes(types[i]), "bytes a row of ", types[i]);
    n += raws[i].size(0);
  }
  // Not zeroed whole (1 GB of a 1.7B model's stores before packing wrote every byte
  // again): only the panels that rows of no tensor fill whole, which are written a row at
  // a time and leave the lanes of rows they do not hold as they found them (a panel two
  // tensors of a stack share, or the last one, part empty). Each task then first touches
  // the pages of the panels it packs.
  const int fmt = static_cast<int>(format);
  const size_t panel_bytes = packed_bytes(fmt, 16, static_cast<int>(k));
  TORCH_CHECK(out.dtype() == at::kByte && out.is_contiguous() && out.device().is_cpu() &&
                  static_cast<size_t>(out.numel()) == packed_bytes(fmt, static_cast<int>(n), static_cast<int>(k)),
              "pack_into: a contiguous uint8 CPU tensor of the packed size");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0, "pack_into: 64-byte aligned");
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0, at_row = 0; i <= static_cast<int64_t>(raws.size()); i++) {
    // the panel a later tensor's first row falls in past its start, and the last, part
    // empty
    const int64_t p = at_row / 16;
    if (at_row % 16 != 0 && p < (n + 15) / 16) std::memset(dst + p * panel_bytes, 0, panel_bytes);
    if (i < static_cast<int64_t>(raws.size())) at_row += raws[i].size(0);
  }
  int64_t base = 0;
  for (size_t i = 0; i < raws.size(); i++) {
    const uint8_t* src = raws[i].data_ptr<uint8_t>();
    const int64_t rows = raws[i].size(0), stride = raws[i].size(1);
    const std::string t = types[i];
    // Each task packs whole panels (rows n and n + 8 of a panel share the bytes of 4-bit
    // codes): the panels this tensor's rows [base, base + rows) fall in, split.
    const int64_t first_panel = base / 16, end_panel = (base + rows + 15) / 16;
    const int64_t panels = end_panel - first_panel;
    const int tasks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(panels, g_pool.threads() * 4)));
    std::vector<std::string> errors(tasks);
    const bool dense = format_dense(static_cast<int>(format));
    // Q4_K into U4K (its own format) straight from the file's blocks
    const bool direct = t == "Q4_K" && fmt == FMT_U4K;
    g_pool.run(tasks, [&](int task) {
      Row panel[16];
      const int64_t p0 = first_panel + panels * task / tasks, p1 = first_panel + panels * (task + 1) / tasks;
      try {
        for (int64_t p = p0; p < p1; p++) {
          // a panel of this tensor's rows alone, in a quantized format: written whole;
          // else (a dense format, or a panel shared with the stack's previous or next
          // tensor, or the last one, part empty) a row at a time
          const int64_t r0 = std::max<int64_t>(p * 16, base) - base;
          const int64_t r1 = std::min<int64_t>((p + 1) * 16, base + rows) - base;
          const bool whole = !dense && r1 - r0 == 16;
          if (whole && direct) {
            const uint8_t* lanes[16];
            for (int l = 0; l < 16; l++) lanes[l] = src + (r0 + l) * stride;
            pack_panel_q4k(lanes, static_cast<int>(k), dst + static_cast<size_t>(p) * panel_bytes);
            continue;
          }
          for (int64_t r = r0; r < r1; r++) {
            Row& row = panel[whole ? r - r0 : 0];
            unpack_row(t, src + r * stride, static_cast<int>(k), &row);
            if (!whole)
              pack_row(row, static_cast<int>(format), static_cast<int>(base + r), static_cast<int>(k), dst);
          }
          if (whole) pack_panel(panel, static_cast<int>(format), static_cast<int>(p), static_cast<int>(k), dst);
        }
      } catch (const std::exception& e) {
        errors[task] = e.what();
      }
    });
    for (const auto& e : errors) TORCH_CHECK(e.empty(), "packing ", t, ": ", e);
    base += rows;
  }
}

// pack_into a buffer of its own (the engine packs into _native.PackArena's, which ask for
// huge pages).
at::Tensor pack(std::vector<at::Tensor> raws, std::vector<std::string> types, int64_t k,
                int64_t format) {
  TORCH_CHECK(!raws.empty() && raws.size() == types.size(), "one type a tensor");
  int64_t n = 0;
  for (const auto& r : raws) n += r.dim() == 2 ? r.size(0) : 0;
  at::Tensor out = at::empty({packed_size(format, n, k)}, at::kByte);
  pack_into(std::move(raws), std::move(types), k, format, out);
  return out;
}

Matrix matrix(const at::Tensor& packed, int64_t format, int64_t n, int64_t k) {
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.device().is_cpu(),
              "a packed matrix is a contiguous uint8 CPU tensor");
  TORCH_CHECK(format_layout(static_cast<int32_t>(format)) != nullptr, "unknown packed matrix format ",
              format, " (the formats are 1 to 13: api.h)");
  TORCH_CHECK(static_cast<size_t>(packed.numel()) ==
                  packed_bytes(static_cast<int>(format), static_cast<int>(n), static_cast<int>(k)),
              "packed size does not match its shape");
  return Matrix{packed.data_ptr<uint8_t>(), static_cast<int32_t>(format), static_cast<int32_t>(n),
                static_cast<int32_t>(k)};
}

void check_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.device().is_cpu(), "float32 CPU inputs");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1, "inputs (rows, ", k, ")");
}

// y = x W^T into y (rows of x, n), on the pool: panels shared among the threads (the rows'
// block sums first, on this thread).
void linear_into(const float* x, int m, int ldx, const Matrix& w, float* y, int ldy) {
  const int panels = (w.n + 15) / 16;
  const Kernels* kr = kernels();
  const bool gemm = m > kr->gemv_max;
  const int qb = format_sub(w.format);  // the rows' sums of x: one a scale group
  std::vector<float> sums(static_cast<size_t>(m) * (w.k / qb));
  kr->sums(x, m, ldx, w.k, qb, sums.data());
  // The GEMM path's x packed once, by every thread a share of its row groups (each task
  // packing all of x for itself had cost a tenth of a prompt's pass).
  // (not an at::empty: no torch call inside a forward pass's layers)
  std::unique_ptr<float[]> packed(gemm ? new float[static_cast<size_t>(m) * w.k] : nullptr);
  float* const xp = packed.get();
  if (gemm) {
    const int groups = (m + kr->gemm_mr - 1) / kr->gemm_mr;
    const int pack_tasks = tasks_for(groups, 4);
    g_pool.run(pack_tasks, [&](int t) {
      const auto [r0, r1] = share(m, kr->gemm_mr, t, pack_tasks);
      kr->pack(x, m, ldx, w.k, r0, r1, xp);
    });
  }
  // tasks of whole units of the GEMM path's panels, so that none runs a panel alone
  const int unit = gemm ? kr->gemm_np : 1;
  const int tasks = tasks_for((panels + unit - 1) / unit, m >= 4 ? 1 : 4);
  g_pool.run(tasks, [&](int t) {
    const auto [p0, p1] = share(panels, unit, t, tasks);
    kr->linear(x, m, ldx, sums.data(), w, p0, p1, y, ldy, xp);
  });
}

at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t format, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "inputs (rows, k)");
  const int64_t k = x.size(1);
  check_rows(x, k);
  const Matrix w = matrix(packed, format, n, k);
  at::Tensor y = at::empty({x.size(0), n}, at::kFloat);
  if (x.size(0) > 0)
    linear_into(x.data_ptr<float>(), static_cast<int>(x.size(0)), static_cast<int>(x.stride(0)), w,
                y.data_ptr<float>(), static_cast<int>(n));
  return y;
}

at::Tensor dequant(at::Tensor packed, int64_t format, int64_t n, int64_t k, at::Tensor rows) {
  const Matrix w = matrix(packed, format, n, k);
  TORCH_CHECK(rows.dtype() == at::kLong && rows.dim() == 1, "rows: int64 (count,)");
  at::Tensor ids = rows.contiguous();
  at::Tensor out = at::empty({ids.size(0), k}, at::kFloat);
  const int64_t* r = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < ids.size(0); i++) {
    TORCH_CHECK(r[i] >= 0 && r[i] < n, "row out of range");
    kernels()->dequant(w, static_cast<int>(r[i]), static_cast<int>(r[i]) + 1, o + i * k);
  }
  return out;
}

at::Tensor rmsnorm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat, "x: float32 (rows, dim)");
  const int64_t dim = x.size(1);
  TORCH_CHECK(dim % 16 == 0, "dim must be a multiple of 16");
  at::Tensor xc = x.contiguous(), w = weight.contiguous();
  TORCH_CHECK(w.dtype() == at::kFloat && w.numel() == dim, "weight: float32 (dim,)");
  at::Tensor out = at::empty_like(xc);
  for (int64_t i = 0; i < xc.size(0); i++)
    kernels()->rmsnorm(xc.data_ptr<float>() + i * dim, w.data_ptr<float>(), static_cast<int>(dim),
                       static_cast<float>(eps), out.data_ptr<float>() + i * dim);
  return out;
}

at::Tensor elementwise(at::Tensor x, int64_t fn) {
  TORCH_CHECK(x.dtype() == at::kFloat, "float32");
  TORCH_CHECK(fn >= 0 && fn <= 3, "fn: 0 exp, 1 tanh, 2 silu, 3 gelu-tanh");
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  kernels()->elementwise(static_cast<int>(fn), xc.data_ptr<float>(), static_cast<int>(xc.numel()),
                         out.data_ptr<float>());
  return out;
}

// ---- top-p ---------------------------------------------------------------------------------

// The ids top-p keeps of a row of probabilities, in id order: what
// `_sampling.top_p_kept` computes (its definition, to the bit), in one pass over the row
// and a sort of the few candidates instead of a dozen torch calls (~0.3 ms a row).
at::Tensor top_p(at::Tensor probs, double p, double floor) {
  TORCH_CHECK(probs.dtype() == at::kFloat && probs.dim() == 1, "probs: float32 (V,)");
  at::Tensor row = probs.contiguous();
  const float* v = row.data_ptr<float>();
  const int64_t n = row.numel();
  TORCH_CHECK(n > 0, "an empty row");
  double total = 0.0;
  float most = v[0];
  for (int64_t i = 0; i < n; i++) {
    total += static_cast<double>(v[i]);  // in id order, as a float64 cumsum
    most = v[i] > most ? v[i] : most;
  }
  const double bound = p * total;
  double threshold = static_cast<double>(most) * floor;
  std::vector<int64_t> cand;
  for (;;) {
    cand.clear();
    for (int64_t i = 0; i < n; i++)
      if (threshold <= 0 || static_cast<double>(v[i]) >= threshold) cand.push_back(i);
    // most likely first; equal probabilities in id order (a stable sort of id order)
    std::sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) {
      return v[a] > v[b] || (v[a] == v[b] && a < b);
    });
    // each token whose mass before it (the running float64 sum, less itself) is under
    // the bound; the likeliest always
    double sum = 0.0;
    bool any_dropped = false;
    std::vector<int64_t> kept;
    for (size_t j = 0; j < cand.size(); j++) {
      const double r = static_cast<double>(v[cand[j]]);
      sum += r;
      if (j == 0 || !(sum - r >= bound)) {
        kept.push_back(cand[j]);
      } else {
        any_dropped = true;
      }
    }
    if (any_dropped || static_cast<int64_t>(cand.size()) == n) {
      std::sort(kept.begin(), kept.end());
      at::Tensor out = at::empty({static_cast<int64_t>(kept.size())}, at::kLong);
      std::copy(kept.begin(), kept.end(), out.data_ptr<int64_t>());
      return out;
    }
    const double lower = threshold * floor;
    threshold = lower > 1e-38 ? lower : 0.0;
  }
}

// The ids of a row of n values' k highest and of every one tied with the k-th, in id
// order (0 < k < n), into `kept`: the k-th found with a heap of k in one pass, then every
// id at or above it in another. What `_sampling.top_k_ids` gives (torch.topk, then the
// ties).
void top_k_ids(const float* v, int64_t n, int64_t k, std::vector<int64_t>& kept) {
  // Runs of 64 with no value above the bound (at or above, for the ids) are passed over
  // whole: most of a row, once the heap holds a few large values. (A test without a
  // chain from one value to the next, so that it runs as vector compares.)
  constexpr int64_t kRun = 64;
  auto any_above = [&](int64_t i0, int64_t i1, float bound) {
    int hit = 0;
    for (int64_t i = i0; i < i1; i++) hit |= v[i] > bound;
    return hit != 0;
  };
  auto any_at_least = [&](int64_t i0, int64_t i1, float bound) {
    int hit = 0;
    for (int64_t i = i0; i < i1; i++) hit |= v[i] >= bound;
    return hit != 0;
  };
  std::vector<float> heap(v, v + k);  // the k largest so far, smallest on top
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (int64_t i0 = k; i0 < n; i0 += kRun) {
    const int64_t i1 = std::min(n, i0 + kRun);
    if (!any_above(i0, i1, heap.front())) continue;
    for (int64_t i = i0; i < i1; i++) {
      if (v[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = v[i];
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
  }
  const float kth = heap.front();
  kept.clear();
  kept.reserve(static_cast<size_t>(k));
  for (int64_t i0 = 0; i0 < n; i0 += kRun) {
    const int64_t i1 = std::min(n, i0 + kRun);
    if (!any_at_least(i0, i1, kth)) continue;
    for (int64_t i = i0; i < i1; i++)
      if (v[i] >= kth) kept.push_back(i);
  }
}

// `top_k_ids` of a (V,) row, as a tensor.
at::Tensor top_k(at::Tensor logits, int64_t k) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 1, "logits: float32 (V,)");
  at::Tensor row = logits.contiguous();
  const int64_t n = row.numel();
  TORCH_CHECK(k > 0 && k < n, "k: 0 < k < V");
  std::vector<int64_t> kept;
  top_k_ids(row.data_ptr<float>(), n, k, kept);
  at::Tensor out = at::empty({static_cast<int64_t>(kept.size())}, at::kLong);
  std::copy(kept.begin(), kept.end(), out.data_ptr<int64_t>());
  return out;
}

// ---- sampling a step's rows ----------------------------------------------------------------

// One token for each of the rows a step samples with top-k in the default order (top-k,
// temperature, min-p, top-p, the draw): row i from logits[rows[i]], with
// params[i] = (k, temperature, min_p, top_p) and uniform[i] its generator's draw in
// [0, 1). The rows are independent (a row's token never depends on the others), spread
// over the pool. On row i, with k < V:
//   ids   top_k_ids (the k highest and the ties with the k-th, in id order)
//   x_j   (logit_j - max) / temperature, in float32 (the best at 0, a banned one -inf)
//   e_j   e^x_j with the kernels' own exponential (the same bits on every CPU; -inf: 0)
//   min-p drops e_j < min_p * max e (in float64)
//   top-p keeps, most likely first (ties in id order), each token whose float64 sum of
//         e before it (the running sum less itself) is under top_p of the survivors'
//         float64 total; the likeliest always
//   draw  over the kept tokens in id order, the first whose float64 running sum of e
//         passes uniform * their total (the last kept with any mass, if rounding passes
//         none)
// Softmax's normalization is left out: every stage compares or sums the e_j, whose ratios
// are the probabilities'. What `_sampling.RowSampler.pick` computes with torch calls, in
// one call for the step (~12 torch calls a row there, each dispatched and each giving the
// GIL up).
at::Tensor sample(at::Tensor logits, at::Tensor rows, at::Tensor params, at::Tensor uniform) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 2, "logits: float32 (B, V)");
  const int64_t n = rows.numel(), V = logits.size(1);
  TORCH_CHECK(rows.dtype() == at::kLong && rows.dim() == 1, "rows: int64 (n,)");
  TORCH_CHECK(params.dtype() == at::kDouble && params.dim() == 2 && params.size(0) == n &&
                  params.size(1) == 4,
              "params: float64 (n, 4): k, temperature, min_p, top_p");
  TORCH_CHECK(uniform.dtype() == at::kDouble && uniform.numel() == n, "uniform: float64 (n,)");
  at::Tensor lg = logits.contiguous(), rc = rows.contiguous(), pc = params.contiguous(),
             uc = uniform.contiguous();
  const int64_t* row = rc.data_ptr<int64_t>();
  const double* par = pc.data_ptr<double>();
  const double* u = uc.data_ptr<double>();
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(row[i] >= 0 && row[i] < lg.size(0), "a row outside the logits");
    TORCH_CHECK(par[i * 4] >= 1 && par[i * 4] < V && par[i * 4] == std::floor(par[i * 4]),
                "k: a whole number, 0 < k < V");
    TORCH_CHECK(par[i * 4 + 1] > 0, "temperature: > 0");
    TORCH_CHECK(u[i] >= 0 && u[i] < 1, "uniform: in [0, 1)");
  }
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* chosen = out.data_ptr<int64_t>();
  const float* base = lg.data_ptr<float>();
  const Kernels* kr = kernels();
  const int tasks = tasks_for(static_cast<int>(n), 1);
  g_pool.run(tasks, [&](int t) {
    const auto [r0, r1] = share(static_cast<int>(n), 1, t, tasks);
    std::vector<int64_t> ids, order;
    std::vector<float> x, e;
    for (int64_t r = r0; r < r1; r++) {
      const float* v = base + row[r] * V;
      const double* pr = par + r * 4;
      top_k_ids(v, V, static_cast<int64_t>(pr[0]), ids);
      const size_t m = ids.size();
      float best = v[ids[0]];
      for (int64_t id : ids) best = v[id] > best ? v[id] : best;
      if (best == -INFINITY) {  // every candidate banned: the first of them
        chosen[r] = ids[0];
        continue;
      }
      const float temperature = static_cast<float>(pr[1]);
      x.resize(m);
      e.resize(m);
      for (size_t j = 0; j < m; j++) x[j] = (v[ids[j]] - best) / temperature;
      kr->elementwise(0, x.data(), static_cast<int>(m), e.data());
      // min-p: against the likeliest (e = 1 at x = 0; its e taken as computed)
      if (pr[2] > 0) {
        float most = 0.0f;
        for (size_t j = 0; j < m; j++) most = e[j] > most ? e[j] : most;
        const double floor = pr[2] * static_cast<double>(most);
        for (size_t j = 0; j < m; j++)
          if (static_cast<double>(e[j]) < floor) e[j] = 0.0f;
      }
      // top-p: most likely first, ties in id order (ids ascend, so a stable sort)
      if (pr[3] < 1.0) {
        double total = 0.0;
        for (size_t j = 0; j < m; j++) total += static_cast<double>(e[j]);
        const double bound = pr[3] * total;
        order.resize(m);
        for (size_t j = 0; j < m; j++) order[j] = static_cast<int64_t>(j);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return e[a] > e[b]; });
        // the mass before a token is the running sum less itself, as `top_p_kept` has it
        double sum = 0.0;
        for (size_t q = 0; q < m; q++) {
          const double w = static_cast<double>(e[order[q]]);
          sum += w;
          if (q > 0 && sum - w >= bound) e[order[q]] = 0.0f;  // dropped
        }
      }
      // the draw: the kept tokens' running sum in id order
      double total = 0.0;
      for (size_t j = 0; j < m; j++) total += static_cast<double>(e[j]);
      const double target = u[r] * total;
      double sum = 0.0;
      int64_t pick = -1, last = ids[0];
      for (size_t j = 0; j < m; j++) {
        if (e[j] <= 0.0f) continue;
        last = ids[j];
        sum += static_cast<double>(e[j]);
        if (pick < 0 && sum > target) pick = ids[j];
      }
      chosen[r] = pick >= 0 ? pick : last;
    }
  });
  return out;
}

// ---- attention over the page pool ---------------------------------------------------------

// What a KV pool stores a number as.
enum class Store { Float, Half, Int8 };

struct Pool5 {  // one layer's keys or values: (pages, G, S, D), and int8's scales
  const void* data;
  const float* scale;
};

void check_pool(const at::Tensor& t, const std::optional<at::Tensor>& scale);

// The pools: values (layers, pages, kv heads, page size, head dim); keys (layers, pages,
// kv heads, head dim, page size), each head's page transposed (api.h).
void check_pools(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                 const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(v.dim() == 5 && k.dim() == 5 && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                  k.size(2) == v.size(2) && k.size(3) == v.size(4) && k.size(4) == v.size(3),
              "pools: values (layers, pages, kv heads, page size, head dim), keys with the last "
              "two transposed");
  TORCH_CHECK(v.size(3) % 16 == 0, "page size: a multiple of 16");
  TORCH_CHECK(k.dtype() == v.dtype(), "keys and values of one dtype");
  check_pool(k, k_scale);
  check_pool(v, v_scale);
}

void check_pool(const at::Tensor& t, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(t.dim() == 5 && t.is_contiguous() && t.device().is_cpu(), "a pool: contiguous, 5 dims");
  TORCH_CHECK(t.dtype() == at::kFloat || t.dtype() == at::kHalf ||
                  (t.dtype() == at::kChar && scale.has_value()),
              "a float32 or float16 pool, or int8 with its scales");
  TORCH_CHECK(t.dtype() == at::kChar || !scale.has_value(), "scales belong to an int8 pool");
  if (scale.has_value()) {
    TORCH_CHECK(scale->dtype() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() * t.size(3) * t.size(4) == t.numel() * std::min(t.size(3), t.size(4)),
                "scales: float32, one a position and head");
  }
}

Pool5 pool_layer(const at::Tensor& t, const std::optional<at::Tensor>& scale, int64_t layer) {
  const int64_t per_layer = t.numel() / t.size(0);
  Pool5 p;
  p.data = static_cast<const uint8_t*>(t.data_ptr()) + layer * per_layer * t.element_size();
  p.scale = scale.has_value() ? scale->data_ptr<float>() + layer * (scale->numel() / t.size(0)) : nullptr;
  return p;
}

void attend(const float* q, float* out, int64_t n, int64_t heads, const at::Tensor& k_pool,
            const at::Tensor& v_pool, Pool5 k, Pool5 v, const int64_t* table, int64_t table_width,
            const int64_t* row, const int64_t* position, int64_t window, double scale,
            double softcap) {
  if (n == 0) return;
  Attention a{};
  a.q = q;
  a.out = out;
  a.k = k.data;
  a.v = v.data;
  a.k_scale = k.scale;
  a.v_scale = v.scale;
  a.half = k_pool.dtype() == at::kHalf ? 1 : 0;
  a.page_table = table;
  a.row = row;
  a.position = position;
  a.n = static_cast<int32_t>(n);
  a.h = static_cast<int32_t>(heads);
  a.g = static_cast<int32_t>(k_pool.size(2));
  a.s = static_cast<int32_t>(v_pool.size(3));
  a.d = static_cast<int32_t>(v_pool.size(4));
  a.p = static_cast<int32_t>(table_width);
  a.window = static_cast<int32_t>(window);
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  // blocks: runs of consecutive queries of one row, up to kBlockHeads query heads a kv head
  const int per_group = a.h / a.g;
  TORCH_CHECK(per_group <= kMaxBlockHeads, "more than ", kMaxBlockHeads, " query heads a kv head");
  const int64_t block_queries = std::max(1, std::min(16, kBlockHeads / per_group));
  std::vector<int32_t> block{0};
  for (int64_t i = 1; i < n; i++)
    if (row[i] != row[i - 1] || i - block.back() == block_queries) block.push_back(static_cast<int32_t>(i));
  block.push_back(static_cast<int32_t>(n));
  // One row's queries (a prompt's chunk) whose (block, kv head) tasks are too few to
  // share out evenly: cut in blocks of equal size, as few as give every thread the same
  // number of tasks (none under 4 queries). A 16-token chunk of SmolLM2 (3 kv heads) was
  // one block, three tasks on two threads, and Gemma 3's (one kv head) one task, so a
  // deep chunk's attention ran at 3/4 and 1/2 of the pool (1.25x and 2x faster cut in
  // two); 20 tokens were blocks of 16 and 4. Where the tasks are many they stay as they
  // are: blocks of 16 queries keep the query heads in whole groups of the kernel's
  // (kScoreHeads, kValueHeads); 15 a block cost a 300-token chunk 10%. The numbers do
  // not depend on the blocks.
  const int threads = g_pool.threads();
  const int64_t first_blocks = static_cast<int64_t>(block.size() - 1);
  const bool one_row = std::all_of(row, row + n, [&](int64_t r) { return r == row[0]; });
  if (n > 1 && one_row && first_blocks * a.g < 4 * threads) {
    for (int64_t nb = first_blocks; nb <= first_blocks + threads && n / nb >= 4; nb++) {
      if (nb * a.g % threads != 0) continue;
      block.assign(1, 0);
      for (int64_t b = 1; b <= nb; b++) block.push_back(static_cast<int32_t>(n * b / nb));
      break;
    }
  }
  a.block = block.data();
  a.blocks = static_cast<int32_t>(block.size() - 1);
  // A decode step (a query a block) with fewer (block, kv head) pairs than threads: each
  // pair's query heads in parts, a task each, as many parts as leave no thread more
  // than one task. A part reads all of its pair's keys and values again, and a long
  // context's attention is bound by those reads, so parts pay only where a thread
  // would otherwise have nothing to do: Gemma 3 270M's one kv head on 2 threads at
  // 8,000 keys 1.2x faster in 2 parts, SmolLM2's 3 kv heads 1.5x slower in 6.
  const int pairs = a.blocks * a.g;
  a.parts = a.blocks == n ? std::max(1, std::min(per_group, threads / pairs)) : 1;
  const int items = pairs * a.parts;
  int64_t most = 1;
  for (int64_t i = 0; i < n; i++) most = std::max(most, position[i] + 1);
  int widest = 1;  // the most queries a block has
  for (int b = 0; b < a.blocks; b++) widest = std::max(widest, block[b + 1] - block[b]);
  const size_t scratch_floats =
      static_cast<size_t>(widest * per_group) * (static_cast<size_t>(a.d + most) + 32);
  const int tasks = tasks_for(items, 1);
  const Kernels* kr = kernels();
  g_pool.run(tasks, [&](int t) {
    // Each thread's scratch, kept from call to call and grown as needed, never cleared
    // (the kernel writes every number of it before reading it): a vector made and
    // zeroed for each task (2 MB for a SmolLM2 query at 8,000 keys) cost a long
    // context's decode step more than its attention did.
    thread_local std::vector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    const auto [i0, i1] = share(items, 1, t, tasks);
    kr->attention(a, i0, i1, scratch.data());
  });
}

void check_plan(const at::Tensor& table, const at::Tensor& row, const at::Tensor& position,
                int64_t n, int64_t pages, int64_t page_size) {
  TORCH_CHECK(table.dtype() == at::kLong && table.dim() == 2 && table.is_contiguous(),
              "page table: contiguous int64 (rows, pages)");
  TORCH_CHECK(row.dtype() == at::kLong && row.numel() == n && row.is_contiguous(), "row: int64 (n,)");
  TORCH_CHECK(position.dtype() == at::kLong && position.numel() == n && position.is_contiguous(),
              "position: int64 (n,)");
  const int64_t* r = row.data_ptr<int64_t>();
  const int64_t* p = position.data_ptr<int64_t>();
  const int64_t* t = table.data_ptr<int64_t>();
  const int64_t width = table.size(1);
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(r[i] >= 0 && r[i] < table.size(0), "a row outside the page table");
    TORCH_CHECK(p[i] >= 0 && p[i] / page_size < width, "a position beyond its row's pages");
    for (int64_t j = 0; j <= p[i] / page_size; j++)
      TORCH_CHECK(t[r[i] * width + j] >= 0 && t[r[i] * width + j] < pages, "a page outside the pool");
  }
}

// q (n, heads, d) attending to layer `layer` of the pools: (n, heads, d).
at::Tensor attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                     std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale,
                     int64_t layer, at::Tensor page_table, at::Tensor row, at::Tensor position,
                     int64_t window, double scale, double softcap) {
  check_pools(k_pool, v_pool, k_scale, v_scale);
  TORCH_CHECK(q.dtype() == at::kFloat && q.dim() == 3 && q.size(2) == v_pool.size(4),
              "q: float32 (n, heads, head dim)");
  TORCH_CHECK(v_pool.size(4) % 16 == 0 && v_pool.size(4) <= 256, "head dim: a multiple of 16, <= 256");
  TORCH_CHECK(q.size(1) % k_pool.size(2) == 0, "heads: a multiple of kv heads");
  TORCH_CHECK(layer >= 0 && layer < k_pool.size(0), "layer out of range");
  const int64_t n = q.size(0);
  check_plan(page_table, row, position, n, v_pool.size(1), v_pool.size(3));
  at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  attend(qc.data_ptr<float>(), out.data_ptr<float>(), n, q.size(1), k_pool, v_pool,
         pool_layer(k_pool, k_scale, layer), pool_layer(v_pool, v_scale, layer),
         page_table.data_ptr<int64_t>(), page_table.size(1), row.data_ptr<int64_t>(),
         position.data_ptr<int64_t>(), window, scale, softcap);
  return out;
}

// ---- the layers, one call a pass -----------------------------------------------------------

struct PackedRef {
  at::Tensor data;
  Matrix m;
};

struct Layer {
  at::Tensor attn_norm, ffn_norm;
  PackedRef wqkv, wo, gate_up, down;
  at::Tensor qkv_bias, q_norm, k_norm, post_attn_norm, post_ffn_norm;  // undefined: none
  bool local = false;
};

// How a row's pair of a head is rotated: (x[2i], x[2i+1]) in llama's order, (x[i],
// x[i + D/2]) in NEOX's; by (cos, sin) of the position: a*cos - b*sin, a*sin + b*cos (two
// products, then their sum: no fused multiply-add, so every build gives the same bits).
inline void rotate(float* x, const float* table, int d, bool neox) {
  const int half = d / 2;
  for (int i = 0; i < half; i++) {
    const float c = table[2 * i], s = table[2 * i + 1];
    float& a = neox ? x[i] : x[2 * i];
    float& b = neox ? x[i + half] : x[2 * i + 1];
    const float ac = a * c, bs = b * s, as = a * s, bc = b * c;
    a = ac - bs;
    b = as + bc;
  }
}

class Layers : public torch::CustomClassHolder {
 public:
  // ints: dim, heads, kv heads, head dim, ffn, neox, gelu, window;
  // floats: eps, attention scale, attention softcap
  Layers(std::vector<int64_t> ints, std::vector<double> floats) {
    TORCH_CHECK(ints.size() == 8 && floats.size() == 3, "Layers(ints[8], floats[3])");
    dim_ = ints[0];
    heads_ = ints[1];
    kv_heads_ = ints[2];
    head_dim_ = ints[3];
    ffn_ = ints[4];
    neox_ = ints[5] != 0;
    gelu_ = ints[6] != 0;
    window_ = ints[7];
    eps_ = static_cast<float>(floats[0]);
    scale_ = floats[1];
    softcap_ = floats[2];
    TORCH_CHECK(dim_ % 16 == 0 && ffn_ % 16 == 0 && head_dim_ % 16 == 0 && head_dim_ <= 256,
                "dims must be multiples of 16 (head dim at most 256)");
  }

  // tensors: attn_norm, ffn_norm, wqkv, wo, gate_up, down (packed), then the optional ones
  // (an empty tensor: none) qkv_bias, q_norm, k_norm, post_attn_norm, post_ffn_norm;
  // ints: the four matrices' formats, then local (0/1).
  void add_layer(std::vector<at::Tensor> t, std::vector<int64_t> ints) {
    TORCH_CHECK(t.size() == 11 && ints.size() == 5, "add_layer(tensors[11], ints[5])");
    Layer l;
    l.attn_norm = norm(t[0], dim_);
    l.ffn_norm = norm(t[1], dim_);
    const int64_t qkv = (heads_ + 2 * kv_heads_) * head_dim_;
    l.wqkv = {t[2], matrix(t[2], ints[0], qkv, dim_)};
    l.wo = {t[3], matrix(t[3], ints[1], dim_, heads_ * head_dim_)};
    l.gate_up = {t[4], matrix(t[4], ints[2], 2 * ffn_, dim_)};
    l.down = {t[5], matrix(t[5], ints[3], dim_, ffn_)};
    if (t[6].numel()) l.qkv_bias = norm(t[6], qkv);
    if (t[7].numel()) l.q_norm = norm(t[7], head_dim_);
    if (t[8].numel()) l.k_norm = norm(t[8], head_dim_);
    if (t[9].numel()) l.post_attn_norm = norm(t[9], dim_);
    if (t[10].numel()) l.post_ffn_norm = norm(t[10], dim_);
    l.local = ints[4] != 0;
    layers_.push_back(std::move(l));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // The residual stream x (n, dim), every layer applied in place, their keys and values
  // written: position p of query i goes to (write_page[i], write_offset[i]); query i sees
  // row[i]'s pages of page_table up to positions[i]. rope, rope_local: (positions, D/2, 2)
  // (cos, sin) tables (rope_local used by local layers). Layers [first, first + count) run
  // (count < 0: to the last).
  at::Tensor forward(at::Tensor x, at::Tensor rope, at::Tensor rope_local, at::Tensor positions,
                     at::Tensor write_page, at::Tensor write_offset, at::Tensor row,
                     at::Tensor page_table, at::Tensor k_pool, at::Tensor v_pool,
                     std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale,
                     int64_t first, int64_t count) {
    const int64_t last = count < 0 ? size() : first + count;
    TORCH_CHECK(first >= 0 && first <= last && last <= size(), "layers out of range");
    check_rows(x, dim_);
    TORCH_CHECK(x.is_contiguous(), "x: contiguous");
    const int64_t n = x.size(0);
    check_pools(k_pool, v_pool, k_scale, v_scale);
    TORCH_CHECK(v_pool.size(0) == size() && v_pool.size(2) == kv_heads_ && v_pool.size(4) == head_dim_,
                "the pool's shape is not the model's");
    check_plan(page_table, row, positions, n, v_pool.size(1), v_pool.size(3));
    TORCH_CHECK(write_page.dtype() == at::kLong && write_page.numel() == n && write_page.is_contiguous() &&
                    write_offset.dtype() == at::kLong && write_offset.numel() == n &&
                    write_offset.is_contiguous(),
                "write slots: int64 (n,)");
    for (const at::Tensor* r : {&rope, &rope_local})
      TORCH_CHECK(r->dtype() == at::kFloat && r->is_contiguous() && r->dim() == 3 &&
                      r->size(1) == head_dim_ / 2 && r->size(2) == 2,
                  "rope tables: float32 (positions, head dim / 2, 2)");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* wp = write_page.data_ptr<int64_t>();
    const int64_t* wo = write_offset.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; i++) {
      TORCH_CHECK(pos[i] < rope.size(0) && pos[i] < rope_local.size(0), "a position beyond the rope table");
      TORCH_CHECK(wp[i] >= 0 && wp[i] < v_pool.size(1) && wo[i] >= 0 && wo[i] < v_pool.size(3),
                  "a write slot outside the pool");
    }
    if (n == 0) return x;
    const int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    const int64_t qkv_dim = q_dim + 2 * kv_dim;
    at::Tensor h = at::empty({n, dim_}, at::kFloat), qkv = at::empty({n, qkv_dim}, at::kFloat);
    at::Tensor q = at::empty({n, q_dim}, at::kFloat), attn = at::empty({n, q_dim}, at::kFloat);
    at::Tensor gu = at::empty({n, 2 * ffn_}, at::kFloat), act = at::empty({n, ffn_}, at::kFloat);
    at::Tensor out = at::empty({n, dim_}, at::kFloat);
    float* xp = x.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* ap = attn.data_ptr<float>();
    float* gup = gu.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const Kernels* kr = kernels();
    const int rows = static_cast<int>(n);
    const int row_tasks = tasks_for(rows, 8);
    auto per_row = [&](const std::function<void(int64_t)>& fn) {
      g_pool.run(row_tasks, [&](int t) {
        const auto [r0, r1] = share(rows, 1, t, row_tasks);
        for (int64_t r = r0; r < r1; r++) fn(r);
      });
    };
    const Store store = k_scale.has_value() ? Store::Int8 : k_pool.dtype() == at::kHalf ? Store::Half : Store::Float;
    const int64_t page_size = v_pool.size(3);
    const int64_t page_elems = kv_heads_ * page_size * head_dim_;  // one page, one layer
    for (int64_t li = first; li < last; li++) {
      const Layer& l = layers_[li];
      const float* table = (l.local ? rope_local : rope).data_ptr<float>();
      const Pool5 kl = pool_layer(k_pool, k_scale, li), vl = pool_layer(v_pool, v_scale, li);
      per_row([&](int64_t r) {
        kr->rmsnorm(xp + r * dim_, l.attn_norm.data_ptr<float>(), static_cast<int>(dim_), eps_, hp + r * dim_);
      });
      linear_into(hp, rows, static_cast<int>(dim_), l.wqkv.m, qkvp, static_cast<int>(qkv_dim));
      per_row([&](int64_t r) {
        float* v = qkvp + r * qkv_dim;
        if (l.qkv_bias.defined()) {
          const float* b = l.qkv_bias.data_ptr<float>();
          for (int64_t i = 0; i < qkv_dim; i++) v[i] = v[i] + b[i];
        }
        float* qr = qp + r * q_dim;
        std::copy(v, v + q_dim, qr);
        float* kr_ = v + q_dim;
        const float* rot = table + pos[r] * head_dim_;
        for (int64_t hh = 0; hh < heads_ + kv_heads_; hh++) {
          float* head = hh < heads_ ? qr + hh * head_dim_ : kr_ + (hh - heads_) * head_dim_;
          const at::Tensor& nw = hh < heads_ ? l.q_norm : l.k_norm;
          if (nw.defined())
            kr->rmsnorm(head, nw.data_ptr<float>(), static_cast<int>(head_dim_), eps_, head);
          rotate(head, rot, static_cast<int>(head_dim_), neox_);
        }
        write_kv(kl, vl, store, page_elems, page_size, wp[r], wo[r], kr_, kr_ + kv_dim);
      });
      attend(qp, ap, n, heads_, k_pool, v_pool, kl, vl, page_table.data_ptr<int64_t>(),
             page_table.size(1), row.data_ptr<int64_t>(), pos, l.local ? window_ : 0, scale_, softcap_);
      linear_into(ap, rows, static_cast<int>(q_dim), l.wo.m, op, static_cast<int>(dim_));
      per_row([&](int64_t r) {
        float* o = op + r * dim_;
        if (l.post_attn_norm.defined())
          kr->rmsnorm(o, l.post_attn_norm.data_ptr<float>(), static_cast<int>(dim_), eps_, o);
        float* xr = xp + r * dim_;
        for (int64_t i = 0; i < dim_; i++) xr[i] = xr[i] + o[i];
        kr->rmsnorm(xr, l.ffn_norm.data_ptr<float>(), static_cast<int>(dim_), eps_, hp + r * dim_);
      });
      linear_into(hp, rows, static_cast<int>(dim_), l.gate_up.m, gup, static_cast<int>(2 * ffn_));
      per_row([&](int64_t r) {
        kr->gated(gup + r * 2 * ffn_, static_cast<int>(ffn_), gelu_ ? 1 : 0, actp + r * ffn_);
      });
      linear_into(actp, rows, static_cast<int>(ffn_), l.down.m, op, static_cast<int>(dim_));
      per_row([&](int64_t r) {
        float* o = op + r * dim_;
        if (l.post_ffn_norm.defined())
          kr->rmsnorm(o, l.post_ffn_norm.data_ptr<float>(), static_cast<int>(dim_), eps_, o);
        float* xr = xp + r * dim_;
        for (int64_t i = 0; i < dim_; i++) xr[i] = xr[i] + o[i];
      });
    }
    return x;
  }

 private:
  static at::Tensor norm(const at::Tensor& t, int64_t n) {
    TORCH_CHECK(t.dtype() == at::kFloat && t.numel() == n && t.device().is_cpu(),
                "a float32 vector of ", n);
    return t.contiguous();
  }

  // A position's keys and values (each kv heads x head dim) into slot (page, offset): as
  // they are, as halves (each rounded to the nearest half, ties to even: what torch's
  // float32 -> float16 conversion gives), or as int8 with a scale a head (max |x| / 127;
  // x / scale rounded to nearest, ties to even: what `_kvpool._quantize` computes).
  // Keys go transposed: element d of slot `offset` at [d][offset] of the head's page.
  void write_kv(Pool5 k, Pool5 v, Store store, int64_t page_elems, int64_t page_size,
                int64_t page, int64_t offset, const float* keys, const float* values) const {
    const bool quantized = store == Store::Int8;
    for (int64_t g = 0; g < kv_heads_; g++) {
      const int64_t head = page * page_elems + g * page_size * head_dim_;  // the head's page
      for (int which = 0; which < 2; which++) {
        const float* src = (which == 0 ? keys : values) + g * head_dim_;
        const Pool5& dst = which == 0 ? k : v;
        // element i's place: keys [i][offset], values [offset][i]
        const int64_t start = which == 0 ? head + offset : head + offset * head_dim_;
        const int64_t step = which == 0 ? page_size : 1;
        float s = 1.0f, div = 1.0f;
        if (quantized) {
          float amax = 0.0f;
          for (int64_t i = 0; i < head_dim_; i++) amax = std::max(amax, std::fabs(src[i]));
          s = amax / 127.0f;
          div = s > 0.0f ? s : 1.0f;
          const_cast<float*>(dst.scale)[(page * kv_heads_ + g) * page_size + offset] = s;
        }
        for (int64_t i = 0; i < head_dim_; i++) {
          if (quantized) {
            int8_t* q = const_cast<int8_t*>(static_cast<const int8_t*>(dst.data));
            q[start + i * step] =
                static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(src[i] / div))));
          } else if (store == Store::Half) {
            const_cast<uint16_t*>(static_cast<const uint16_t*>(dst.data))[start + i * step] =
                c10::Half(src[i]).x;
          } else {
            const_cast<float*>(static_cast<const float*>(dst.data))[start + i * step] = src[i];
          }
        }
      }
    }
  }

  int64_t dim_, heads_, kv_heads_, head_dim_, ffn_, window_;
  bool neox_, gelu_;
  float eps_;
  double scale_, softcap_;
  std::vector<Layer> layers_;
};

}  // namespace
}  // namespace ninfer

TORCH_LIBRARY(ninfer, m) {
  m.def("configure(str isa, int threads, int spin_us) -> str", &ninfer::configure);
  m.def("supports(str isa) -> bool", &ninfer::supports);
  m.def("pool_stats() -> int[]", &ninfer::pool_stats);
  m.def("top_p(Tensor probs, float p, float floor) -> Tensor", &ninfer::top_p);
  m.def("top_k(Tensor logits, int k) -> Tensor", &ninfer::top_k);
  m.def("sample(Tensor logits, Tensor rows, Tensor params, Tensor uniform) -> Tensor", &ninfer::sample);
  m.def("pack_format(str[] types) -> int", &ninfer::pack_format);
  m.def("pack(Tensor[] raws, str[] types, int k, int format) -> Tensor", &ninfer::pack);
  m.def("packed_size(int format, int n, int k) -> int", &ninfer::packed_size);
  m.def("pack_into(Tensor[] raws, str[] types, int k, int format, Tensor(a!) out) -> ()",
        &ninfer::pack_into);
  m.def("linear(Tensor x, Tensor packed, int format, int n) -> Tensor", &ninfer::linear);
  m.def("dequant(Tensor packed, int format, int n, int k, Tensor rows) -> Tensor", &ninfer::dequant);
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor", &ninfer::rmsnorm);
  m.def("elementwise(Tensor x, int fn) -> Tensor", &ninfer::elementwise);
  m.def(
      "attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor? k_scale, Tensor? v_scale, int layer, "
      "Tensor page_table, Tensor row, Tensor position, int window, float scale, float softcap) -> Tensor",
      &ninfer::attention);
  m.class_<ninfer::Layers>("Layers")
      .def(torch::init<std::vector<int64_t>, std::vector<double>>())
      .def("add_layer", &ninfer::Layers::add_layer)
      .def("size", &ninfer::Layers::size)
      .def("forward", &ninfer::Layers::forward);
}
