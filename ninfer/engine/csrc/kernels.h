// ninfer's native kernels, written once on V16 (simd.h) and compiled once per instruction
// set (isa_*.cpp), each build in its own namespace. See api.h for the layouts and the
// promise: every number these kernels give is the same in every build.
#pragma once

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "api.h"
#include "simd.h"

namespace NINFER_NS {

using ninfer::Attention;
using ninfer::Matrix;

enum Code { U4, I8, H16, F32 };

// A packed block's layout and how it decodes: Code of the codes, scales as halves (else
// floats), an offset per output, QB inputs a block.
template <Code C, bool Half, bool Min, int QB_>
struct Fmt {
  static constexpr int QB = QB_;
  static constexpr bool dense = C == H16 || C == F32;
  static constexpr bool offset = Min;
  static constexpr int scale_bytes = dense ? 0 : 16 * (Half ? 2 : 4);
  static constexpr int min_bytes = Min ? scale_bytes : 0;
  static constexpr int code_bytes = C == U4 ? 8 : C == I8 ? 16 : C == H16 ? 32 : 64;
  static constexpr int block_bytes = scale_bytes + min_bytes + QB * code_bytes;

  // One block's 16 outputs: their scales and offsets, and per input k the codes as floats
  // (`q`; a dense format's values) or the values themselves (`at`).
  struct Block {
    const uint8_t* p;
    inline void load(const uint8_t* at_) { p = at_; }
    inline V16 scale() const {
      if constexpr (Half) {
        return vload_half(reinterpret_cast<const uint16_t*>(p));
      } else {
        return vload(reinterpret_cast<const float*>(p));
      }
    }
    inline V16 offset() const {
      if constexpr (Half) {
        return vload_half(reinterpret_cast<const uint16_t*>(p + scale_bytes));
      } else {
        return vload(reinterpret_cast<const float*>(p + scale_bytes));
      }
    }
    inline V16 q(int k) const {
      const uint8_t* c = p + scale_bytes + min_bytes + k * code_bytes;
      if constexpr (C == F32) {
        return vload(reinterpret_cast<const float*>(c));
      } else if constexpr (C == H16) {
        return vload_half(reinterpret_cast<const uint16_t*>(c));
      } else if constexpr (C == U4) {
        return vnibbles(c);
      } else {
        return vbytes(reinterpret_cast<const int8_t*>(c));
      }
    }
    // The value the file stores: code * scale [+ offset], the product exact, one rounding
    // (what the reference dequantizer computes).
    inline V16 at(int k) const {
      if constexpr (dense) {
        return q(k);
      } else if constexpr (Min) {
        return vfma(q(k), scale(), offset());
      } else {
        return vmul(q(k), scale());
      }
    }
  };

  // Fold one block's partial sums (over its QB inputs, from 0) into the accumulator:
  // acc + part * scale + (the block's sum of x) * offset; a dense format's acc + part.
  static inline V16 fold(V16 acc, V16 part, const Block& b, float x_sum) {
    if constexpr (dense) {
      return vadd(acc, part);
    } else {
      acc = vfma(part, b.scale(), acc);
      if constexpr (Min) acc = vfma(vset1(x_sum), b.offset(), acc);
      return acc;
    }
  }
};

// ---- y = x W^T ---------------------------------------------------------------------------
//
// Each output is summed a block at a time: over the block's inputs, in order, x[k] * code[k]
// (one fused multiply-add a term, from 0), then folded into the output's sum (`fold`): a
// block's scale multiplies its partial sum once instead of every code, and its offset the
// block's sum of x (`block_sums`, computed once a row). The same sums in the same order
// whatever the number of rows, the panels a thread takes or the vector width.

// The sums of x over each block of `qb` inputs, in order from 0: sums[b].
static inline void block_sums(const float* x, int k, int qb, float* sums) {
  for (int b = 0; b < k / qb; b++) {
    float s = 0.0f;
    for (int i = 0; i < qb; i++) s = s + x[b * qb + i];
    sums[b] = s;
  }
}

// MR rows (1..3) by P panels at once, each code decoded once and used by every row.
template <class F, int MR, int P>
static inline void gemv(const float* x, int ldx, const float* sums, const uint8_t* w, int nb,
                        int p0, float* y, int ldy, int n_out) {
  V16 acc[MR][P];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < P; j++) acc[i][j] = vzero();
  const size_t panel_bytes = static_cast<size_t>(nb) * F::block_bytes;
  for (int b = 0; b < nb; b++) {
    typename F::Block blk[P];
    for (int j = 0; j < P; j++) blk[j].load(w + (p0 + j) * panel_bytes + b * F::block_bytes);
    const int k0 = b * F::QB;
    V16 part[MR][P];
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < P; j++) part[i][j] = vzero();
    for (int k = 0; k < F::QB; k++) {
      V16 xk[MR];
      for (int i = 0; i < MR; i++) xk[i] = vset1(x[i * ldx + k0 + k]);
      for (int j = 0; j < P; j++) {
        const V16 qk = blk[j].q(k);
        for (int i = 0; i < MR; i++) part[i][j] = vfma(xk[i], qk, part[i][j]);
      }
    }
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < P; j++) acc[i][j] = F::fold(acc[i][j], part[i][j], blk[j], sums[i * nb + b]);
  }
  alignas(64) float out[16];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < P; j++) {
      const int n0 = (p0 + j) * 16;
      vstore(out, acc[i][j]);
      const int count = std::min(16, n_out - n0);
      for (int l = 0; l < count; l++) y[i * ldy + n0 + l] = out[l];
    }
}

// The GEMM micro-kernel: MR rows' partial sums over one block (QB inputs x 16 outputs of
// codes, decoded in w), folded into their accumulators acc (MR x 16, kept between blocks).
template <class F, int MR>
static inline void micro(const float* x, int ldx, const float* sums, int nb, const float* w,
                         const typename F::Block& blk, int b, float* acc) {
  V16 part[MR];
  for (int i = 0; i < MR; i++) part[i] = vzero();
  for (int k = 0; k < F::QB; k++) {
    const V16 wk = vload(w + k * 16);
    for (int i = 0; i < MR; i++) part[i] = vfma(vset1(x[i * ldx + k]), wk, part[i]);
  }
  for (int i = 0; i < MR; i++)
    vstore(acc + i * 16, F::fold(vload(acc + i * 16), part[i], blk, sums[i * nb + b]));
}

#if defined(NINFER_ISA_AVX512)
constexpr int GEMM_MR = 12;
constexpr int GEMV_P1 = 4;
#elif defined(NINFER_ISA_AVX2)
constexpr int GEMM_MR = 6;
constexpr int GEMV_P1 = 3;
#else
constexpr int GEMM_MR = 4;
constexpr int GEMV_P1 = 1;
#endif

// sums: the rows' block sums (m x k / QB), from block_sums
template <class F>
static void linear_fmt(const float* x, int m, int ldx, const float* sums, const Matrix& w, int p0,
                       int p1, float* y, int ldy) {
  const int nb = w.k / F::QB;
  if (m <= 3) {  // each code decoded in registers, for every row
    int p = p0;
    if (m == 1) {
      for (; p + GEMV_P1 <= p1; p += GEMV_P1) gemv<F, 1, GEMV_P1>(x, ldx, sums, w.data, nb, p, y, ldy, w.n);
      for (; p < p1; p++) gemv<F, 1, 1>(x, ldx, sums, w.data, nb, p, y, ldy, w.n);
    } else if (m == 2) {
      for (; p + 2 <= p1; p += 2) gemv<F, 2, 2>(x, ldx, sums, w.data, nb, p, y, ldy, w.n);
      for (; p < p1; p++) gemv<F, 2, 1>(x, ldx, sums, w.data, nb, p, y, ldy, w.n);
    } else {
      for (; p < p1; p++) gemv<F, 3, 1>(x, ldx, sums, w.data, nb, p, y, ldy, w.n);
    }
    return;
  }
  // Many rows: each block's codes decoded once into a buffer, then every row group on it.
  alignas(64) float wbuf[F::QB * 16];
  const size_t panel_bytes = static_cast<size_t>(nb) * F::block_bytes;
  float* acc = new float[static_cast<size_t>(m) * 16];
  for (int p = p0; p < p1; p++) {
    std::fill(acc, acc + static_cast<size_t>(m) * 16, 0.0f);
    for (int b = 0; b < nb; b++) {
      typename F::Block blk;
      blk.load(w.data + p * panel_bytes + b * F::block_bytes);
      for (int k = 0; k < F::QB; k++) vstore(wbuf + k * 16, blk.q(k));
      const int k0 = b * F::QB;
      int r = 0;
      for (; r + GEMM_MR <= m; r += GEMM_MR)
        micro<F, GEMM_MR>(x + static_cast<size_t>(r) * ldx + k0, ldx, sums + r * nb, nb, wbuf, blk, b,
                          acc + r * 16);
      for (; r + 4 <= m; r += 4)
        micro<F, 4>(x + static_cast<size_t>(r) * ldx + k0, ldx, sums + r * nb, nb, wbuf, blk, b,
                    acc + r * 16);
      for (; r < m; r++)
        micro<F, 1>(x + static_cast<size_t>(r) * ldx + k0, ldx, sums + r * nb, nb, wbuf, blk, b,
                    acc + r * 16);
    }
    const int n0 = p * 16;
    const int count = std::min(16, w.n - n0);
    for (int r = 0; r < m; r++)
      std::copy(acc + r * 16, acc + r * 16 + count, y + static_cast<size_t>(r) * ldy + n0);
  }
  delete[] acc;
}

template <class F>
static void dequant_fmt(const Matrix& w, int n0, int n1, float* out) {
  const int nb = w.k / F::QB;
  const size_t panel_bytes = static_cast<size_t>(nb) * F::block_bytes;
  alignas(64) float lanes[16];
  for (int n = n0; n < n1; n++) {
    const int p = n / 16, lane = n % 16;
    for (int b = 0; b < nb; b++) {
      typename F::Block blk;
      blk.load(w.data + p * panel_bytes + b * F::block_bytes);
      for (int k = 0; k < F::QB; k++) {
        vstore(lanes, blk.at(k));
        out[static_cast<size_t>(n - n0) * w.k + b * F::QB + k] = lanes[lane];
      }
    }
  }
}

// Each format's block, from its one description (api.h's FORMATS).
constexpr Code code_of(const ninfer::FormatLayout& l) {
  return l.code_bytes == 8 ? U4 : l.code_bytes == 16 ? I8 : l.code_bytes == 32 ? H16 : F32;
}
template <int32_t F>
using FmtOf = Fmt<code_of(*ninfer::format_layout(F)), ninfer::format_layout(F)->half_scales,
                  ninfer::format_layout(F)->offsets, ninfer::format_layout(F)->block>;
using FU4H = FmtOf<ninfer::FMT_U4H>;
using FU4F = FmtOf<ninfer::FMT_U4F>;
using FI8H = FmtOf<ninfer::FMT_I8H>;
using FI8HM = FmtOf<ninfer::FMT_I8HM>;
using FI8FM = FmtOf<ninfer::FMT_I8FM>;
using FI8F16 = FmtOf<ninfer::FMT_I8F16>;
using FI8FM16 = FmtOf<ninfer::FMT_I8FM16>;
using FF16 = FmtOf<ninfer::FMT_F16>;
using FF32 = FmtOf<ninfer::FMT_F32>;
static_assert(FF16::dense && FF32::dense && !FI8FM16::dense && FI8FM16::QB == 16);

#define NINFER_BY_FORMAT(fmt, call)          \
  switch (fmt) {                             \
    case ninfer::FMT_U4H: call(FU4H); break;     \
    case ninfer::FMT_U4F: call(FU4F); break;     \
    case ninfer::FMT_I8H: call(FI8H); break;     \
    case ninfer::FMT_I8HM: call(FI8HM); break;   \
    case ninfer::FMT_I8FM: call(FI8FM); break;   \
    case ninfer::FMT_I8F16: call(FI8F16); break; \
    case ninfer::FMT_I8FM16: call(FI8FM16); break; \
    case ninfer::FMT_F16: call(FF16); break;     \
    case ninfer::FMT_F32: call(FF32); break;     \
    default: unknown_format(fmt);            \
  }

// Never reached through ops.cpp, which refuses an unknown format before any kernel runs.
[[noreturn]] static void unknown_format(int32_t fmt) {
  throw std::invalid_argument("unknown packed matrix format " + std::to_string(fmt));
}

static void linear(const float* x, int m, int ldx, const float* sums, const Matrix& w, int p0,
                   int p1, float* y, int ldy) {
#define NINFER_CALL(F) linear_fmt<F>(x, m, ldx, sums, w, p0, p1, y, ldy)
  NINFER_BY_FORMAT(w.format, NINFER_CALL)
#undef NINFER_CALL
}

static void dequant(const Matrix& w, int n0, int n1, float* out) {
#define NINFER_CALL(F) dequant_fmt<F>(w, n0, n1, out)
  NINFER_BY_FORMAT(w.format, NINFER_CALL)
#undef NINFER_CALL
}

// ---- the rest of a layer -------------------------------------------------------------------

// The sum of squares in 16 lanes (lane = index mod 16), then vsum's tree.
static inline float sum_squares(const float* x, int n) {
  V16 acc = vzero();
  for (int i = 0; i < n; i += 16) {
    V16 v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  return vsum(acc);
}

static void rmsnorm(const float* x, const float* weight, int dim, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, dim) / static_cast<float>(dim) + eps);
  const V16 s = vset1(inv);
  for (int i = 0; i < dim; i += 16) vstore(out + i, vmul(vmul(vload(x + i), s), vload(weight + i)));
}

static void gated(const float* gate_up, int ffn, int gelu, float* out) {
  for (int i = 0; i < ffn; i += 16) {
    V16 g = vload(gate_up + i), u = vload(gate_up + ffn + i);
    vstore(out + i, vmul(gelu ? vgelu_tanh(g) : vsilu(g), u));
  }
}

// Attention for one query and one kv head's queries (heads per group). Keys are stored
// transposed in each page (a head's page is [D][S]: element d of 16 consecutive keys is
// one vector), so a score vector holds 16 keys: score = scale * (sum over d, in order, of
// q[d] * k[d], one fused multiply-add a term). Then the maximum of the keys the query sees
// (a window's, or all up to its position), e^(score - max) (vexp), their sum in key order
// and the weighted sum of the values in key order. Nothing depends on which other
// queries, rows or keys share the call, nor on the page a key sits in.
template <int P>
static void attend_heads(const Attention& a, int n, int g, int h0, float* scratch) {
  const int d = a.d, S = a.s, chunks = d / 16;
  const int64_t pos = a.position[n];
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  const int64_t base = first / 16 * 16;  // scores are kept from this key, in whole vectors
  const int64_t span = pos + 1 - base;
  const int64_t padded = (span + 15) / 16 * 16;
  const int64_t* pages = a.page_table + a.row[n] * a.p;
  const size_t head_block = static_cast<size_t>(S) * d;  // one head's page of keys or values
  const float* qh[P];
  for (int i = 0; i < P; i++) qh[i] = a.q + (static_cast<size_t>(n) * a.h + h0 + i) * d;
  float* sc[P];
  for (int i = 0; i < P; i++) sc[i] = scratch + i * padded;
  alignas(64) float lane_key[16];
  for (int l = 0; l < 16; l++) lane_key[l] = static_cast<float>(l);
  const V16 lanes = vload(lane_key);
  const V16 scale = vset1(a.scale);
  for (int64_t key0 = base; key0 <= pos; key0 += 16) {
    const int64_t page = pages[key0 / S];
    const int slot0 = static_cast<int>(key0 % S);
    const size_t block = (static_cast<size_t>(page) * a.g + g) * head_block;
    V16 acc[P];
    for (int i = 0; i < P; i++) acc[i] = vzero();
    if (a.k_scale == nullptr) {
      const float* k = static_cast<const float*>(a.k) + block + slot0;
      for (int dd = 0; dd < d; dd++) {
        const V16 kv = vload(k + static_cast<size_t>(dd) * S);
        for (int i = 0; i < P; i++) acc[i] = vfma(vset1(qh[i][dd]), kv, acc[i]);
      }
    } else {
      const int8_t* k = static_cast<const int8_t*>(a.k) + block + slot0;
      const V16 ks = vload(a.k_scale + (static_cast<size_t>(page) * a.g + g) * S + slot0);
      for (int dd = 0; dd < d; dd++) {
        const V16 kv = vmul(vbytes(k + static_cast<size_t>(dd) * S), ks);
        for (int i = 0; i < P; i++) acc[i] = vfma(vset1(qh[i][dd]), kv, acc[i]);
      }
    }
    // keys the query does not see (before the window, after its position): -inf
    const V16 key = vadd(vset1(static_cast<float>(key0)), lanes);
    const V16 lo = vset1(static_cast<float>(first)), hi = vset1(static_cast<float>(pos));
    for (int i = 0; i < P; i++) {
      V16 s = vmul(acc[i], scale);
      if (a.softcap > 0) s = vmul(vtanh(vdiv(s, vset1(a.softcap))), vset1(a.softcap));
      s = vselect_lt(key, lo, vset1(-INFINITY), s);
      s = vselect_lt(hi, key, vset1(-INFINITY), s);
      vstore(sc[i] + (key0 - base), s);
    }
  }
  const int64_t skip = first - base;  // the window's first key among the scores
  for (int i = 0; i < P; i++) {
    float mx = -INFINITY;
    for (int64_t j = skip; j < span; j++) mx = sc[i][j] > mx ? sc[i][j] : mx;
    const V16 mv = vset1(mx);
    for (int64_t j = 0; j < padded; j += 16) vstore(sc[i] + j, vexp(vsub(vload(sc[i] + j), mv)));
  }
  float total[P];
  for (int i = 0; i < P; i++) {
    total[i] = 0.0f;
    for (int64_t j = skip; j < span; j++) total[i] += sc[i][j];
  }
  for (int c0 = 0; c0 < chunks; c0 += 4) {  // four 16-lane slices of the head at a time
    const int cs = std::min(4, chunks - c0);
    V16 o[P][4];
    for (int i = 0; i < P; i++)
      for (int c = 0; c < 4; c++) o[i][c] = vzero();
    for (int64_t j = skip; j < span; j++) {
      const int64_t key = base + j;
      const size_t slot = (static_cast<size_t>(pages[key / S]) * a.g + g) * head_block +
                          static_cast<size_t>(key % S) * d + c0 * 16;
      V16 v[4];
      if (a.v_scale == nullptr) {
        const float* vp = static_cast<const float*>(a.v) + slot;
        for (int c = 0; c < cs; c++) v[c] = vload(vp + c * 16);
      } else {
        const int8_t* vp = static_cast<const int8_t*>(a.v) + slot;
        const V16 vs = vset1(a.v_scale[(slot - c0 * 16) / d]);
        for (int c = 0; c < cs; c++) v[c] = vmul(vbytes(vp + c * 16), vs);
      }
      for (int i = 0; i < P; i++) {
        const V16 p = vset1(sc[i][j]);
        for (int c = 0; c < cs; c++) o[i][c] = vfma(p, v[c], o[i][c]);
      }
    }
    for (int i = 0; i < P; i++) {
      float* out = a.out + (static_cast<size_t>(n) * a.h + h0 + i) * d + c0 * 16;
      const V16 tv = vset1(total[i]);
      for (int c = 0; c < cs; c++) vstore(out + c * 16, vdiv(o[i][c], tv));
    }
  }
}

// scratch: room for 8 heads' scores of the longest query's keys (plus 32)
static void attention(const Attention& a, int i0, int i1, float* scratch) {
  const int per_group = a.h / a.g;
  for (int item = i0; item < i1; item++) {
    const int n = item / a.g, g = item % a.g;
    for (int h = 0; h < per_group;) {
      const int count = std::min(8, per_group - h);
      const int h0 = g * per_group + h;
      switch (count) {
        case 1: attend_heads<1>(a, n, g, h0, scratch); break;
        case 2: attend_heads<2>(a, n, g, h0, scratch); break;
        case 3: attend_heads<3>(a, n, g, h0, scratch); break;
        case 4: attend_heads<4>(a, n, g, h0, scratch); break;
        case 5: attend_heads<5>(a, n, g, h0, scratch); break;
        case 6: attend_heads<6>(a, n, g, h0, scratch); break;
        case 7: attend_heads<7>(a, n, g, h0, scratch); break;
        default: attend_heads<8>(a, n, g, h0, scratch); break;
      }
      h += count;
    }
  }
}

static void elementwise(int fn, const float* x, int n, float* out) {
  alignas(64) float t[16];
  for (int i = 0; i < n; i += 16) {
    const int count = std::min(16, n - i);
    std::fill(t, t + 16, 0.0f);
    std::copy(x + i, x + i + count, t);
    V16 v = vload(t);
    v = fn == 0 ? vexp(v) : fn == 1 ? vtanh(v) : fn == 2 ? vsilu(v) : vgelu_tanh(v);
    vstore(t, v);
    std::copy(t, t + count, out + i);
  }
}

static void sums(const float* x, int m, int ldx, int k, int qb, float* out) {
  for (int r = 0; r < m; r++) block_sums(x + static_cast<size_t>(r) * ldx, k, qb, out + static_cast<size_t>(r) * (k / qb));
}

static const ninfer::Kernels table = {
    NINFER_NAME, sums, linear, dequant, rmsnorm, gated, attention, elementwise,
};

}  // namespace NINFER_NS
