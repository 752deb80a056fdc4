// ninfer's native kernels, written once on V16 (simd.h) and compiled once per instruction
// set (isa_*.cpp), each build in its own namespace. See api.h for the layouts and the
// promise: every number these kernels give is the same in every build.
#pragma once

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "api.h"
#include "simd.h"

namespace NINFER_NS {

using ninfer::Attention;
using ninfer::Matrix;

enum Code { U4, I8, H16, F32 };

// A packed block's layout and how it decodes: Code of the codes, scales as halves (else
// floats), an offset per output, QB inputs a block, SB inputs a scale (QB but for a
// K-quant format), K: the K-quant's two-level scales (api.h).
template <Code C, bool Half, bool Min, int QB_, int SB_, bool K>
struct Fmt {
  static constexpr int QB = QB_;
  static constexpr int SB = SB_;
  static constexpr int NS = QB / SB;  // scales a block
  static constexpr bool dense = C == H16 || C == F32;
  static constexpr bool offset = Min;
  // a K-quant's d (and -dmin) a block, then its multipliers (and the offsets'); else a
  // scale (and an offset) a block
  static constexpr int d_bytes = K ? 64 : 0;
  static constexpr int mult_bytes = K ? NS * 16 : 0;
  static constexpr int scale_bytes = K ? d_bytes + mult_bytes : dense ? 0 : 16 * (Half ? 2 : 4);
  static constexpr int min_bytes = Min ? scale_bytes : 0;
  static constexpr int code_bytes = C == U4 ? 8 : C == I8 ? 16 : C == H16 ? 32 : 64;
  static constexpr int block_bytes = scale_bytes + min_bytes + QB * code_bytes;
  static_assert(QB % SB == 0 && (K || NS == 1));

  // One block's 16 outputs: their scales and offsets (of scale group s), and per input k
  // the codes as floats (`q`; a dense format's values) or the values themselves (`at`).
  struct Block {
    const uint8_t* p;
    inline void load(const uint8_t* at_) { p = at_; }
    inline V16 scale(int s) const {
      if constexpr (K) {
        return vmul(vload(reinterpret_cast<const float*>(p)),
                    vbytes(reinterpret_cast<const int8_t*>(p + d_bytes * (Min ? 2 : 1) + s * 16)));
      } else if constexpr (Half) {
        return vload_half(reinterpret_cast<const uint16_t*>(p));
      } else {
        return vload(reinterpret_cast<const float*>(p));
      }
    }
    inline V16 offset(int s) const {
      if constexpr (K) {
        return vmul(vload(reinterpret_cast<const float*>(p + d_bytes)),
                    vbytes(reinterpret_cast<const int8_t*>(p + 2 * d_bytes + mult_bytes + s * 16)));
      } else if constexpr (Half) {
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
        return vfma(q(k), scale(k / SB), offset(k / SB));
      } else {
        return vmul(q(k), scale(k / SB));
      }
    }
  };

  // A scale group's scale and offset, decoded once for every row that folds with them.
  struct Scales {
    V16 scale, offset;
    inline void load(const Block& b, int s) {
      if constexpr (!dense) scale = b.scale(s);
      if constexpr (Min) offset = b.offset(s);
    }
  };

  // A block's scales and offsets as floats: a K-quant's decoded once a block into this
  // buffer (its products, d and the multipliers, held in registers across the block's
  // groups, left the products' own loop short of registers: its pointers and a sum
  // spilled, twice as slow), any other format's read where the block stores them.
  struct ScaleBuf {
    alignas(64) float v[K ? NS * 16 * (Min ? 2 : 1) : 16];
    inline void fill(const Block& b) {
      if constexpr (K) {
        for (int s = 0; s < NS; s++) {
          vstore(v + s * 16, b.scale(s));
          if constexpr (Min) vstore(v + (NS + s) * 16, b.offset(s));
        }
      }
    }
    inline Scales at(const Block& b, int s) const {
      Scales out;
      if constexpr (K) {
        out.scale = vload(v + s * 16);
        if constexpr (Min) out.offset = vload(v + (NS + s) * 16);
      } else {
        out.load(b, s);
      }
      return out;
    }
  };

  // Fold one scale group's partial sums (over its SB inputs, from 0) into the
  // accumulator: acc + part * scale + (the group's sum of x) * offset; a dense format's
  // acc + part.
  static inline V16 fold(V16 acc, V16 part, const Scales& sc, float x_sum) {
    if constexpr (dense) {
      return vadd(acc, part);
    } else {
      acc = vfma(part, sc.scale, acc);
      if constexpr (Min) acc = vfma(vset1(x_sum), sc.offset, acc);
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

// The packed matrices' lines PREFETCH_BYTES ahead of the block being multiplied, asked
// for a scale group's share of a block's lines at a time (spread over the block: a whole
// Q4_K block's 36 lines asked for at once filled the core's line buffers and made the
// 1B's one-row step 1.2-1.4x slower). The hardware's own prefetchers left the products of
// a few rows waiting on memory: AVX2, Gemma 3's 262,144 x 640 Q8_0 head at 4 rows read
// 9.6 GB/s (18.5 ms) and spent ~40% of its samples on the first load of each code line;
// with these, 16.0-17.2 GB/s (10.4-11.2 ms). Where to read changes, never what is summed:
// the same bits. 1,024 bytes measured as well as 2,048 and 4,096 (docs/benchmarks.md).
constexpr int PREFETCH_BYTES = 1024;
template <class F>
static inline void prefetch_ahead(const uint8_t* block, int s) {
  constexpr int lines = (F::block_bytes + 63) / 64;
  for (int l = s * lines / F::NS; l < (s + 1) * lines / F::NS; l++)
    __builtin_prefetch(block + PREFETCH_BYTES + l * 64, 0, 3);
}

// MR rows (1..8) by P panels at once, each code decoded once and used by every row. nb:
// blocks a panel; the rows' sums are a scale group's (nb * NS a row).
// Mem: the outputs' sums kept in memory between scale groups (loaded, folded and stored
// once a group, as the GEMM's are), so the registers hold only the group's partial sums,
// a code vector and the inputs: on AVX2 (16 registers, a V16 two of them) 2 rows by 2
// panels or 4 rows by 1 hold 8 partial-sum chains without spilling, on AVX-512 8 rows
// by 2 panels 16 (gemv_mem, GEMV_PASS below).
template <class F, int MR, int P, bool Mem = false>
static inline void gemv(const float* x, int ldx, const float* sums, const uint8_t* w, int nb,
                        int p0, float* y, int ldy, int n_out) {
  V16 acc[Mem ? 1 : MR][Mem ? 1 : P];
  alignas(64) float accm[Mem ? MR * P * 16 : 16];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < P; j++) {
      if constexpr (Mem) vstore(accm + (i * P + j) * 16, vzero());
      else acc[i][j] = vzero();
    }
  const size_t panel_bytes = static_cast<size_t>(nb) * F::block_bytes;
  const int ns = nb * F::NS;
  for (int b = 0; b < nb; b++) {
    typename F::Block blk[P];
    typename F::ScaleBuf sb[P];
    for (int j = 0; j < P; j++) {
      blk[j].load(w + (p0 + j) * panel_bytes + b * F::block_bytes);
      sb[j].fill(blk[j]);
    }
    for (int s = 0; s < F::NS; s++) {
      const int k0 = b * F::QB + s * F::SB;
      for (int j = 0; j < P; j++) prefetch_ahead<F>(blk[j].p, s);
      V16 part[MR][P];
      for (int i = 0; i < MR; i++)
        for (int j = 0; j < P; j++) part[i][j] = vzero();
      // unrolled: a K-quant's loops over its groups left too few general registers for
      // the panels' code pointers, and the compiler kept them in vector registers, moved
      // back for every load (AVX-512, one row: the head 12.0-14.2 -> 10.9-12.5 ms; AVX2's
      // the same or faster)
#pragma GCC unroll 32
      for (int k = 0; k < F::SB; k++) {
        V16 xk[MR];
        for (int i = 0; i < MR; i++) xk[i] = vset1(x[i * ldx + k0 + k]);
        for (int j = 0; j < P; j++) {
          const V16 qk = blk[j].q(s * F::SB + k);
          for (int i = 0; i < MR; i++) part[i][j] = vfma(xk[i], qk, part[i][j]);
        }
      }
      for (int j = 0; j < P; j++) {
        const typename F::Scales sc = sb[j].at(blk[j], s);
        for (int i = 0; i < MR; i++) {
          const float x_sum = sums[i * ns + b * F::NS + s];
          if constexpr (Mem) {
            float* a = accm + (i * P + j) * 16;
            vstore(a, F::fold(vload(a), part[i][j], sc, x_sum));
          } else {
            acc[i][j] = F::fold(acc[i][j], part[i][j], sc, x_sum);
          }
        }
      }
    }
  }
  alignas(64) float out[16];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < P; j++) {
      const int n0 = (p0 + j) * 16;
      if constexpr (Mem) vstore(out, vload(accm + (i * P + j) * 16));
      else vstore(out, acc[i][j]);
      const int count = std::min(16, n_out - n0);
      for (int l = 0; l < count; l++) y[i * ldy + n0 + l] = out[l];
    }
}

// The GEMM micro-kernel: MR rows' partial sums over one scale group g (SB inputs x 16
// outputs of codes in each of NP panels, decoded in w: panel j's at w + j * SB * 16),
// folded into their accumulators acc (row i's panel j at acc + (i * NP + j) * 16, kept
// between groups); ns: the groups a row (its sums' stride). Each broadcast input feeds NP
// panels' fused multiply-adds (with one panel each multiply-add took a load of its own).
// xp: the MR rows' inputs of the block packed input by input (xp[k * MR + i] is row i's
// input k0 + k, `pack_rows`), so the loads run consecutively: read from x itself, rows a
// power of two of bytes apart (2,048 or 8,192 inputs) all fall in one set of the L1 cache
// and evict each other, which cost a third of the GEMM's speed.
template <class F, int MR, int NP>
static inline void micro(const float* xp, const float* sums, int ns, const float* w,
                         const typename F::Scales* sc, int g, float* acc) {
  V16 part[MR][NP];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NP; j++) part[i][j] = vzero();
  for (int k = 0; k < F::SB; k++) {
    V16 wk[NP];
    for (int j = 0; j < NP; j++) wk[j] = vload(w + j * F::SB * 16 + k * 16);
    for (int i = 0; i < MR; i++) {
      const V16 xk = vset1(xp[k * MR + i]);
      for (int j = 0; j < NP; j++) part[i][j] = vfma(xk, wk[j], part[i][j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NP; j++) {
      float* a = acc + (i * NP + j) * 16;
      vstore(a, F::fold(vload(a), part[i][j], sc[j], sums[i * ns + g]));
    }
}

// Rows [r0, r0 + mr) of x (k inputs, ldx apart) into dst input by input: dst[kk * mr + i].
// 16 inputs of every row at a time, so the stores stay within a few cache lines.
static inline void pack_rows(const float* x, int ldx, int k, int r0, int mr, float* dst) {
  for (int k0 = 0; k0 < k; k0 += 16) {
    const int k1 = std::min(k, k0 + 16);
    for (int i = 0; i < mr; i++) {
      const float* row = x + static_cast<size_t>(r0 + i) * ldx;
      for (int kk = k0; kk < k1; kk++) dst[static_cast<size_t>(kk) * mr + i] = row[kk];
    }
  }
}

// Bytes of x a GEMM tile of rows holds (linear_fmt): well inside a core's L2.
constexpr size_t GEMM_TILE_BYTES = 512 * 1024;

#if defined(NINFER_ISA_AVX512)
// 6 rows by 4 panels: 24 sums, 4 code vectors and the broadcast input in 32 registers
// (12 rows by one panel, its shape before: 1.2-1.3x slower on Gemma 3's and the 1B's
// products; 8 x 2 and 14 x 2 in between)
constexpr int GEMM_MR = 6;
constexpr int GEMM_NP = 4;
// the matrix-vector path's panels at once for 1, 2, 3 and 4 rows (gemv_mem below: which
// keep their sums in memory); one row by 8 panels measured 1.05x slower than 4
constexpr int GEMV_P1 = 4;
constexpr int GEMV_P2 = 4;
constexpr int GEMV_P3 = 3;
constexpr int GEMV_P4 = 2;
#elif defined(NINFER_ISA_AVX2)
// 4, not 6: 6 rows' sums are 12 of AVX2's 16 registers, leaving none once a block's two
// code vectors and the broadcast input are loaded; 6 measured slower than 4 on the 1B's
// products (its down at 16 rows 120-129 against 151-155 GFLOP/s). One panel: a row's
// panel is already two registers here.
constexpr int GEMM_MR = 4;
constexpr int GEMM_NP = 1;
// one row by 4 panels, its sums in memory (gemv's Mem): 8 partial sums (3 panels with the
// sums in registers before: 6 chains, and 1.05x the step's time)
constexpr int GEMV_P1 = 4;
// two rows by two panels with their sums in memory (gemv's Mem): in registers, sums and
// partial sums were all 16 of AVX2's registers, and spilled (the 1B's two-row step
// 1.2-1.35x slower than one panel); one panel left 4 chains of fused multiply-adds,
// each waiting on the one before
constexpr int GEMV_P2 = 2;
constexpr int GEMV_P3 = 1;
constexpr int GEMV_P4 = 1;
#else
constexpr int GEMM_MR = 4;
constexpr int GEMM_NP = 1;
constexpr int GEMV_P1 = 1;
constexpr int GEMV_P2 = 1;
constexpr int GEMV_P3 = 1;
constexpr int GEMV_P4 = 1;
#endif

// Up to GEMV_MAX rows: each code decoded in registers for every row it multiplies; on
// AVX-512 four rows at a time (4 rows x 2 panels of sums fit its 32 registers): at 4-11
// rows 1.1-1.7x the GEMM path's speed there, whose micro-kernel had 4 or 1 rows' chains
// of fused multiply-adds to keep busy. More rows: the GEMM path.
#if defined(NINFER_ISA_AVX512)
constexpr int GEMV_MAX = 11;
// which row counts keep their sums in memory (gemv's Mem): two and three rows, whose 4 and
// 3 chains became 8 and 9 (the 1B's two-row step 60-66 -> 49-52 ms, three rows 67-76 ->
// 62-65); one row and four keep theirs in registers (in memory: 1.05x and 1.04x slower)
constexpr bool gemv_mem(int mr) { return mr == 2 || mr == 3; }
// the most rows one pass over the codes takes: 8 rows by 2 panels are 16 partial sums,
// 2 code vectors and 8 inputs in 32 registers, their sums in memory (two passes, 4 rows
// and the rest, read every code twice: the 1B's 6-row step 121 against 86 ms)
constexpr int GEMV_PASS = 8;
#elif defined(NINFER_ISA_AVX2)
constexpr int GEMV_MAX = 4;  // 4 rows by one panel, sums in memory (the GEMM path: 1.2x slower)
constexpr bool gemv_mem(int) { return true; }
constexpr int GEMV_PASS = 4;
#else
constexpr int GEMV_MAX = 3;
constexpr bool gemv_mem(int) { return false; }
constexpr int GEMV_PASS = 4;
#endif

// MR rows by P panels from p while whole groups of P remain, then one panel at a time.
template <class F, int MR, int P, bool Mem = gemv_mem(MR)>
static inline void gemv_panels(const float* x, int ldx, const float* sums, const Matrix& w, int nb, int& p,
                               int p1, float* y, int ldy) {
  for (; p + P <= p1; p += P) gemv<F, MR, P, Mem>(x, ldx, sums, w.data, nb, p, y, ldy, w.n);
  for (; p < p1; p++) gemv<F, MR, 1, Mem>(x, ldx, sums, w.data, nb, p, y, ldy, w.n);
}

template <class F>
static void gemv_rows(const float* x, int m, int ldx, const float* sums, const Matrix& w, int p0,
                      int p1, float* y, int ldy) {
  const int nb = w.k / F::QB;
  int p = p0;
  if (m == 1) {
    gemv_panels<F, 1, GEMV_P1>(x, ldx, sums, w, nb, p, p1, y, ldy);
  } else if (m == 2) {
    gemv_panels<F, 2, GEMV_P2>(x, ldx, sums, w, nb, p, p1, y, ldy);
  } else if (m == 3) {
    gemv_panels<F, 3, GEMV_P3>(x, ldx, sums, w, nb, p, p1, y, ldy);
  } else if (m == 4 || GEMV_PASS == 4) {
    gemv_panels<F, 4, GEMV_P4>(x, ldx, sums, w, nb, p, p1, y, ldy);
    if (m > 4)
      gemv_rows<F>(x + static_cast<size_t>(4) * ldx, m - 4, ldx, sums + static_cast<size_t>(4) * nb * F::NS, w, p0,
                   p1, y + static_cast<size_t>(4) * ldy, ldy);
  } else if constexpr (GEMV_PASS > 4) {
    // 5-8 rows by 2 panels in one pass over the codes, their sums in memory
    const int r = std::min(m, GEMV_PASS);
    if (r == 5) gemv_panels<F, 5, 2, true>(x, ldx, sums, w, nb, p, p1, y, ldy);
    else if (r == 6) gemv_panels<F, 6, 2, true>(x, ldx, sums, w, nb, p, p1, y, ldy);
    else if (r == 7) gemv_panels<F, 7, 2, true>(x, ldx, sums, w, nb, p, p1, y, ldy);
    else gemv_panels<F, 8, 2, true>(x, ldx, sums, w, nb, p, p1, y, ldy);
    if (m > r)
      gemv_rows<F>(x + static_cast<size_t>(r) * ldx, m - r, ldx, sums + static_cast<size_t>(r) * nb * F::NS, w, p0,
                   p1, y + static_cast<size_t>(r) * ldy, ldy);
  }
}

// micro<F, rest, NP>: the last row group's, rest (1..GEMM_MR-1) rows
template <class F, int NP, int R = 1>
static inline void micro_last(int rest, const float* xp, const float* sums, int ns, const float* w,
                              const typename F::Scales* sc, int g, float* acc) {
  if constexpr (R < GEMM_MR) {
    if (rest == R) {
      micro<F, R, NP>(xp, sums, ns, w, sc, g, acc);
    } else {
      micro_last<F, NP, R + 1>(rest, xp, sums, ns, w, sc, g, acc);
    }
  }
}

// The GEMM path's NP panels from p over one packed tile of `rows` rows (row groups of
// GEMM_MR, then the last 1..GEMM_MR-1 as one; group r's packed inputs at xp + r * k),
// into y's rows from y0. acc: rows x NP x 16 floats.
template <class F, int NP>
static void gemm_panels(const float* xp, int rows, const float* st, int ns, const Matrix& w, int p,
                        float* acc, float* y0, int ldy) {
  const int nb = w.k / F::QB;
  const size_t panel_bytes = static_cast<size_t>(nb) * F::block_bytes;
  alignas(64) float wbuf[NP * F::SB * 16];
  const int full = rows / GEMM_MR * GEMM_MR, rest = rows - full;
  for (int i = 0; i < rows * NP; i++) vstore(acc + i * 16, vzero());
  for (int b = 0; b < nb; b++) {
    typename F::Block blk[NP];
    typename F::ScaleBuf sb[NP];
    for (int j = 0; j < NP; j++) {
      blk[j].load(w.data + (p + j) * panel_bytes + b * F::block_bytes);
      sb[j].fill(blk[j]);
    }
    for (int s = 0; s < F::NS; s++) {
      for (int j = 0; j < NP; j++) prefetch_ahead<F>(blk[j].p, s);
      typename F::Scales sc[NP];
      for (int j = 0; j < NP; j++) {
        for (int k = 0; k < F::SB; k++) vstore(wbuf + (j * F::SB + k) * 16, blk[j].q(s * F::SB + k));
        sc[j] = sb[j].at(blk[j], s);
      }
      const int g = b * F::NS + s;
      // group r (mr rows)'s inputs of scale group g
      auto xg = [&](int r, int mr) {
        return xp + static_cast<size_t>(r) * w.k + static_cast<size_t>(g) * F::SB * mr;
      };
      int r = 0;
      for (; r < full; r += GEMM_MR)
        micro<F, GEMM_MR, NP>(xg(r, GEMM_MR), st + r * ns, ns, wbuf, sc, g, acc + r * NP * 16);
      if (rest > 0) micro_last<F, NP>(rest, xg(r, rest), st + r * ns, ns, wbuf, sc, g, acc + r * NP * 16);
    }
  }
  for (int j = 0; j < NP; j++) {
    const int n0 = (p + j) * 16;
    const int count = std::min(16, w.n - n0);
    for (int r = 0; r < rows; r++) {
      const float* a = acc + (r * NP + j) * 16;
      float* yr = y0 + static_cast<size_t>(r) * ldy + n0;
      if (count == 16) {
        vstore(yr, vload(a));
      } else {
        for (int l = 0; l < count; l++) yr[l] = a[l];
      }
    }
  }
}

// x's rows [r0, r1) packed for the GEMM path: groups of GEMM_MR rows from row 0, the
// last 1..GEMM_MR-1 as one (group r's inputs at dst + r * k, xp[k * mr + i] row r + i's).
static void pack(const float* x, int m, int ldx, int k, int r0, int r1, float* dst) {
  for (int r = r0; r < r1; r += GEMM_MR)
    pack_rows(x, ldx, k, r, std::min(GEMM_MR, m - r), dst + static_cast<size_t>(r) * k);
}

// sums: the rows' sums of x a scale group (m x k / SB), from block_sums; xp: x packed
// (`pack`) where m > GEMV_MAX
template <class F>
static void linear_fmt(const float* x, int m, int ldx, const float* sums, const Matrix& w, int p0,
                       int p1, float* y, int ldy, const float* xp) {
  const int nb = w.k / F::QB;
  if (m <= GEMV_MAX) {
    gemv_rows<F>(x, m, ldx, sums, w, p0, p1, y, ldy);
    return;
  }
  // Many rows: each block's codes decoded once into a buffer, then every row group on it;
  // the rows a tile at a time (GEMM_TILE_BYTES of x, packed once for every task), every
  // panel of the task over one tile before the next, so the tile stays in cache instead of
  // all of x being read again for each panel (512 rows of 2,048 inputs are 4 MiB). A row's
  // sums are the same whatever tile, group or panels it falls in.
  const int ns = nb * F::NS;
  // at least four row groups a tile, past GEMM_TILE_BYTES if it must: 512 KiB holds 16
  // rows of 8,192 inputs, and each block decoded for one or two groups alone (AVX-512's
  // groups were 12 rows then) cost the 1B's down products 1.13-1.21x
  const int tile = std::max(4 * GEMM_MR, static_cast<int>(GEMM_TILE_BYTES / (sizeof(float) * w.k)) /
                                             GEMM_MR * GEMM_MR);
  thread_local std::vector<float> scratch;  // the accumulators
  scratch.resize(std::max(scratch.size(), static_cast<size_t>(std::min(m, tile)) * 16 * GEMM_NP));
  float* acc = scratch.data();
  for (int t0 = 0; t0 < m; t0 += tile) {
    const int rows = std::min(tile, m - t0);
    const float* xt = xp + static_cast<size_t>(t0) * w.k;
    const float* st = sums + static_cast<size_t>(t0) * ns;
    float* yt = y + static_cast<size_t>(t0) * ldy;
    int p = p0;
    for (; p + GEMM_NP <= p1; p += GEMM_NP) gemm_panels<F, GEMM_NP>(xt, rows, st, ns, w, p, acc, yt, ldy);
    for (; p < p1; p++) gemm_panels<F, 1>(xt, rows, st, ns, w, p, acc, yt, ldy);
  }
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
                  ninfer::format_layout(F)->offsets, ninfer::format_layout(F)->block,
                  ninfer::format_layout(F)->sub, ninfer::format_layout(F)->kquant>;
using FU4H = FmtOf<ninfer::FMT_U4H>;
using FU4F = FmtOf<ninfer::FMT_U4F>;
using FI8H = FmtOf<ninfer::FMT_I8H>;
using FI8HM = FmtOf<ninfer::FMT_I8HM>;
using FI8FM = FmtOf<ninfer::FMT_I8FM>;
using FI8F16 = FmtOf<ninfer::FMT_I8F16>;
using FI8FM16 = FmtOf<ninfer::FMT_I8FM16>;
using FF16 = FmtOf<ninfer::FMT_F16>;
using FF32 = FmtOf<ninfer::FMT_F32>;
using FU4K = FmtOf<ninfer::FMT_U4K>;
using FI8K = FmtOf<ninfer::FMT_I8K>;
using FI8KM = FmtOf<ninfer::FMT_I8KM>;
using FI8KM32 = FmtOf<ninfer::FMT_I8KM32>;
static_assert(FF16::dense && FF32::dense && !FI8FM16::dense && FI8FM16::QB == 16);
static_assert(FU4K::block_bytes == 2432 && FI8K::block_bytes == 4416 && FI8KM::block_bytes == 4736 &&
              FI8KM32::block_bytes == 4480);

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
    case ninfer::FMT_U4K: call(FU4K); break;     \
    case ninfer::FMT_I8K: call(FI8K); break;     \
    case ninfer::FMT_I8KM: call(FI8KM); break;   \
    case ninfer::FMT_I8KM32: call(FI8KM32); break; \
    default: unknown_format(fmt);            \
  }

// Never reached through ops.cpp, which refuses an unknown format before any kernel runs.
[[noreturn]] static void unknown_format(int32_t fmt) {
  throw std::invalid_argument("unknown packed matrix format " + std::to_string(fmt));
}

static void linear(const float* x, int m, int ldx, const float* sums, const Matrix& w, int p0,
                   int p1, float* y, int ldy, const float* xp) {
#define NINFER_CALL(F) linear_fmt<F>(x, m, ldx, sums, w, p0, p1, y, ldy, xp)
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

// Attention, a block of queries of one row at a time (api.h's `block`) against one kv
// head: every query head of the block that sees a vector of 16 keys shares its loads, and
// the values are read a tile of keys at a time for all of them, so a key is read from
// memory once a block, not once a query. Each query head's own numbers are computed in
// one fixed order that nothing else in the call changes:
//   score of key j = scale * (sum over d, in order, of q[d] * k_j[d], one fma a term),
//     (softcapped), -inf for a key the query does not see (before its window, after its
//     position); scores are kept from its first key rounded down to 16, in whole vectors;
//   m = the largest score it sees; e_j = exp(score_j - m) (vexp);
//   total = e_first + e_first+1 + ... + e_position, added in key order;
//   o = sum over its keys in key order of e_j * v_j (one fma a key and lane), / total.
// So a query's output does not depend on the other queries, rows or keys of its call, on
// which block or tile it falls in, nor on the page a key sits in: the same bits in a
// prefill of thousands of tokens as in a decode step of one.

// How many query heads share each key vector's loads (scores) and each value row's (the
// weighted sums): as many accumulators as the registers hold.
#if defined(NINFER_ISA_AVX512)
constexpr int kScoreHeads = 8, kValueHeads = 4;
#else
constexpr int kScoreHeads = 4, kValueHeads = 2;
#endif

// The hot loops' helpers, always inlined: a call would pass their vectors through memory.
#define NINFER_INLINE static inline __attribute__((always_inline))
#define NINFER_LAMBDA __attribute__((always_inline))

// fn(std::integral_constant<int, count>) for 1 <= count <= N: a count known at run time
// as a template argument (each helper below is compiled for every count it can take).
template <int N, class Fn>
NINFER_INLINE void with_count(int count, Fn fn) {
  if constexpr (N > 1) {
    if (count < N) return with_count<N - 1>(count, fn);
  }
  fn(std::integral_constant<int, N>{});
}

struct QueryHead {
  const float* q;  // d floats
  float* sc;       // its scores, then their exponentials: key j at sc[j - origin]
  float* o;        // d floats: its weighted sum of values so far
  int64_t first, pos, base;  // it sees keys first..pos; scored from base (first, down to 16)
};

struct Block {
  const Attention* a;
  const int64_t* pages;  // the row's page table
  int g;                 // the kv head
  int64_t origin;        // the lowest base of the block's queries
  size_t head_block;     // one head's page of keys or values: S x D
};

// One page's kv head g block of keys or values.
NINFER_INLINE size_t head_offset(const Block& b, int64_t key) {
  return (static_cast<size_t>(b.pages[key / b.a->s]) * b.a->g + b.g) * b.head_block;
}

// Asks for the page holding `key`'s kv head block of keys or values (`pool`: a.k or a.v),
// ahead of its use: a row's pages lie anywhere in the pool, so the hardware's prefetchers
// cannot follow a page table (native, SmolLM2 at 4,000 tokens of context: a one-row step
// read its keys and values at ~4 GB/s before these).
NINFER_INLINE void prefetch_page(const Block& b, const void* pool, int64_t key) {
  const Attention& a = *b.a;
  const size_t bytes = a.half ? 2 : a.k_scale != nullptr ? 1 : 4;
  const char* p = static_cast<const char*>(pool) + head_offset(b, key) * bytes;
  for (size_t o = 0; o < b.head_block * bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// How far ahead the scores' loop asks for keys, in keys (pages of 16: two pages).
constexpr int64_t kKeysAhead = 32;

// The scores of keys key0..key0 + 15 (key0 a multiple of 16) for M query heads.
template <int M>
static void score_vector(const Block& b, int64_t key0, QueryHead* const* xs) {
  const Attention& a = *b.a;
  const int d = a.d, S = a.s;
  const int slot0 = static_cast<int>(key0 % S);
  const size_t head = head_offset(b, key0);
  V16 acc[M];
  for (int i = 0; i < M; i++) acc[i] = vzero();
  if (a.half) {
    const uint16_t* k = static_cast<const uint16_t*>(a.k) + head + slot0;
    for (int dd = 0; dd < d; dd++) {
      const V16 kv = vload_half(k + static_cast<size_t>(dd) * S);
      for (int i = 0; i < M; i++) acc[i] = vfma(vset1(xs[i]->q[dd]), kv, acc[i]);
    }
  } else if (a.k_scale == nullptr) {
    const float* k = static_cast<const float*>(a.k) + head + slot0;
    for (int dd = 0; dd < d; dd++) {
      const V16 kv = vload(k + static_cast<size_t>(dd) * S);
      for (int i = 0; i < M; i++) acc[i] = vfma(vset1(xs[i]->q[dd]), kv, acc[i]);
    }
  } else {
    const int8_t* k = static_cast<const int8_t*>(a.k) + head + slot0;
    const V16 ks = vload(a.k_scale + head / d + slot0);
    for (int dd = 0; dd < d; dd++) {
      const V16 kv = vmul(vbytes(k + static_cast<size_t>(dd) * S), ks);
      for (int i = 0; i < M; i++) acc[i] = vfma(vset1(xs[i]->q[dd]), kv, acc[i]);
    }
  }
  alignas(64) float lane_key[16];
  for (int l = 0; l < 16; l++) lane_key[l] = static_cast<float>(key0 + l);
  const V16 key = vload(lane_key);
  const V16 scale = vset1(a.scale);
  for (int i = 0; i < M; i++) {
    V16 s = vmul(acc[i], scale);
    if (a.softcap > 0) s = vmul(vtanh(vdiv(s, vset1(a.softcap))), vset1(a.softcap));
    s = vselect_lt(key, vset1(static_cast<float>(xs[i]->first)), vset1(-INFINITY), s);
    s = vselect_lt(vset1(static_cast<float>(xs[i]->pos)), key, vset1(-INFINITY), s);
    vstore(xs[i]->sc + (key0 - b.origin), s);
  }
}

// Calls row(j, v) for keys j = j0..j1 in order, v: value row j's lanes [c0 * 16, (c0 + C)
// * 16) as floats; the rows are found a page at a time (a key's row follows the last one
// within its page).
// fetch_to >= 0: each page's next page's values asked for as it starts, up to key fetch_to.
template <int C, class Row>
NINFER_INLINE void value_rows(const Block& b, int64_t j0, int64_t j1, int c0, int64_t fetch_to, Row row) {
  const Attention& a = *b.a;
  const int64_t S = a.s;
  for (int64_t j = j0; j <= j1;) {
    const int64_t end = std::min(j1, (j / S + 1) * S - 1);  // the last key of j's page
    if (end + 1 <= fetch_to) prefetch_page(b, a.v, end + 1);
    const size_t at = head_offset(b, j) + static_cast<size_t>(j % S) * a.d;
    if (a.half) {
      const uint16_t* vp = static_cast<const uint16_t*>(a.v) + at + c0 * 16;
      for (; j <= end; j++, vp += a.d) {
        V16 v[C];
        for (int c = 0; c < C; c++) v[c] = vload_half(vp + c * 16);
        row(j, v);
      }
    } else if (a.v_scale == nullptr) {
      const float* vp = static_cast<const float*>(a.v) + at + c0 * 16;
      for (; j <= end; j++, vp += a.d) {
        V16 v[C];
        for (int c = 0; c < C; c++) v[c] = vload(vp + c * 16);
        row(j, v);
      }
    } else {
      const int8_t* vp = static_cast<const int8_t*>(a.v) + at + c0 * 16;
      const float* sp = a.v_scale + at / a.d;
      for (; j <= end; j++, vp += a.d, sp++) {
        const V16 vs = vset1(*sp);
        V16 v[C];
        for (int c = 0; c < C; c++) v[c] = vmul(vbytes(vp + c * 16), vs);
        row(j, v);
      }
    }
  }
}

// One query head's weighted sums over keys [j0, j1], lanes [c0 * 16, (c0 + C) * 16).
template <int C>
NINFER_INLINE void weigh_one(const Block& b, const QueryHead& x, int64_t j0, int64_t j1, int c0, int64_t fetch_to,
                             V16* o) {
  const float* p = x.sc - b.origin;
  value_rows<C>(b, j0, j1, c0, fetch_to, [&](int64_t j, const V16* v) NINFER_LAMBDA {
    const V16 pj = vset1(p[j]);
    for (int c = 0; c < C; c++) o[c] = vfma(pj, v[c], o[c]);
  });
}

// M query heads' weighted sums over the keys of [t0, t1] each sees, lanes [c0 * 16,
// (c0 + C) * 16): the keys all of them see with each value row read once, the others
// before and after them one head at a time, so each head's keys still go in key order.
// fetch_to: as value_rows' (the first pass over a tile asks for the pages ahead).
template <int M, int C>
static void weigh_tile(const Block& b, QueryHead* const* xs, int64_t t0, int64_t t1, int c0, int64_t fetch_to) {
  int64_t lo[M], hi[M];
  int64_t joint0 = t0, joint1 = t1;
  for (int i = 0; i < M; i++) {
    lo[i] = std::max(xs[i]->first, t0);
    hi[i] = std::min(xs[i]->pos, t1);
    joint0 = std::max(joint0, lo[i]);
    joint1 = std::min(joint1, hi[i]);
  }
  V16 o[M][C];
  for (int i = 0; i < M; i++)
    for (int c = 0; c < C; c++) o[i][c] = vload(xs[i]->o + (c0 + c) * 16);
  if (joint0 > joint1) {  // no key they all see: one at a time
    for (int i = 0; i < M; i++) weigh_one<C>(b, *xs[i], lo[i], hi[i], c0, fetch_to, o[i]);
  } else {
    for (int i = 0; i < M; i++) weigh_one<C>(b, *xs[i], lo[i], joint0 - 1, c0, -1, o[i]);
    const float* p[M];
    for (int i = 0; i < M; i++) p[i] = xs[i]->sc - b.origin;
    value_rows<C>(b, joint0, joint1, c0, fetch_to, [&](int64_t j, const V16* v) NINFER_LAMBDA {
      for (int i = 0; i < M; i++) {
        const V16 pj = vset1(p[i][j]);
        for (int c = 0; c < C; c++) o[i][c] = vfma(pj, v[c], o[i][c]);
      }
    });
    for (int i = 0; i < M; i++) weigh_one<C>(b, *xs[i], joint1 + 1, hi[i], c0, -1, o[i]);
  }
  for (int i = 0; i < M; i++)
    for (int c = 0; c < C; c++) vstore(xs[i]->o + (c0 + c) * 16, o[i][c]);
}

template <int M>
static void weigh_tile_lanes(const Block& b, QueryHead* const* xs, int64_t t0, int64_t t1, int64_t fetch_to) {
  const int chunks = b.a->d / 16;
  int c0 = 0;
  for (; c0 + 4 <= chunks; c0 += 4, fetch_to = -1) weigh_tile<M, 4>(b, xs, t0, t1, c0, fetch_to);
  if (c0 < chunks)
    with_count<3>(chunks - c0, [&](auto C) { weigh_tile<M, decltype(C)::value>(b, xs, t0, t1, c0, fetch_to); });
}

// Each of M query heads' total: the sum of its exponentials over its keys in key order,
// the chains side by side over the keys all of them see (each head's own first and last
// keys alone).
template <int M>
static void ordered_totals(const Block& b, QueryHead* const* xs, float* total) {
  const float* r[M];
  float t[M];
  int64_t joint0 = 0, joint1 = INT64_MAX;
  for (int i = 0; i < M; i++) {
    r[i] = xs[i]->sc - b.origin;
    t[i] = 0.0f;
    joint0 = std::max(joint0, xs[i]->first);
    joint1 = std::min(joint1, xs[i]->pos);
  }
  if (joint0 > joint1) joint0 = INT64_MAX, joint1 = INT64_MAX - 1;  // none shared
  for (int i = 0; i < M; i++)
    for (int64_t j = xs[i]->first; j <= std::min(xs[i]->pos, joint0 - 1); j++) t[i] += r[i][j];
  for (int64_t j = joint0; j <= joint1; j++)
    for (int i = 0; i < M; i++) t[i] += r[i][j];
  for (int i = 0; i < M; i++)
    for (int64_t j = std::max(xs[i]->first, joint1 + 1); j <= xs[i]->pos; j++) t[i] += r[i][j];
  for (int i = 0; i < M; i++) total[i] = t[i];
}

// The first key query n sees (its window's, else 0).
NINFER_INLINE int64_t first_key(const Attention& a, int n) {
  return a.window > 0 ? std::max<int64_t>(0, a.position[n] - a.window + 1) : 0;
}

// Queries [n0, n1) (one row's) against kv head g, each query's heads [i0, i1) of those
// the kv head serves. scratch: the block's query heads x (head dim + its widest span of
// scored keys) floats (api.h, Kernels::attention).
static void attend_block(const Attention& a, int n0, int n1, int g, int i0, int i1, float* scratch) {
  const int per_group = a.h / a.g, d = a.d, width = i1 - i0;
  const int heads = (n1 - n0) * width;
  Block b{&a, a.page_table + a.row[n0] * a.p, g, 0, static_cast<size_t>(a.s) * d};
  int64_t origin = INT64_MAX, last = 0;
  for (int n = n0; n < n1; n++) {
    origin = std::min(origin, first_key(a, n) / 16 * 16);
    last = std::max(last, a.position[n]);
  }
  b.origin = origin;
  const int64_t stride = (last + 1 - origin + 15) / 16 * 16;
  QueryHead xs[ninfer::kMaxBlockHeads];
  QueryHead* all[ninfer::kMaxBlockHeads];
  float* o = scratch;  // heads x d, then heads x stride of scores
  for (int n = n0; n < n1; n++) {
    const int64_t first = first_key(a, n);
    for (int i = i0; i < i1; i++) {
      const int x = (n - n0) * width + (i - i0);
      xs[x].q = a.q + (static_cast<size_t>(n) * a.h + g * per_group + i) * d;
      xs[x].o = o + static_cast<size_t>(x) * d;
      xs[x].sc = scratch + static_cast<size_t>(heads) * d + static_cast<size_t>(x) * stride;
      xs[x].first = first;
      xs[x].pos = a.position[n];
      xs[x].base = first / 16 * 16;
      all[x] = &xs[x];
    }
  }
  // scores: each vector of 16 keys once, for every query head that sees it
  QueryHead* sel[ninfer::kMaxBlockHeads];
  for (int64_t key0 = origin; key0 <= last; key0 += 16) {
    if (key0 + kKeysAhead <= last) prefetch_page(b, a.k, key0 + kKeysAhead);
    int m = 0;
    for (int x = 0; x < heads; x++)
      if (xs[x].base <= key0 && key0 <= xs[x].pos) sel[m++] = &xs[x];
    for (int i = 0; i < m; i += kScoreHeads)
      with_count<kScoreHeads>(std::min(kScoreHeads, m - i),
                              [&](auto M) { score_vector<decltype(M)::value>(b, key0, sel + i); });
  }
  // each head's largest score (max is exact in any order: the vectors' lanes, then across
  // them; a max of 0 may come out -0 or +0, which changes no difference below), the
  // exponentials, and the totals, eight heads' chains side by side
  float total[ninfer::kMaxBlockHeads];
  for (int x = 0; x < heads; x++) {
    QueryHead& h = xs[x];
    float* s = h.sc + (h.base - origin);
    const int64_t padded = (h.pos + 1 - h.base + 15) / 16 * 16;
    V16 mv = vset1(-INFINITY);
    for (int64_t j = 0; j < padded; j += 16) mv = vmax(vload(s + j), mv);
    mv = vset1(vmaxall(mv));
    for (int64_t j = 0; j < padded; j += 16) vstore(s + j, vexp(vsub(vload(s + j), mv)));
    for (int c = 0; c < d; c += 16) vstore(h.o + c, vzero());
  }
  for (int x = 0; x < heads; x += 8)
    with_count<8>(std::min(8, heads - x),
                  [&](auto M) { ordered_totals<decltype(M)::value>(b, all + x, total + x); });
  // the weighted sums of the values, a tile of keys at a time (it stays in cache while
  // every head of the block reads it)
  int64_t lowest = last;
  for (int x = 0; x < heads; x++) lowest = std::min(lowest, xs[x].first);
  const int64_t tile = std::max(16, 8192 / d);
  for (int64_t t0 = lowest; t0 <= last; t0 += tile) {
    const int64_t t1 = std::min(last, t0 + tile - 1);
    for (int x = 0; x < heads; x += kValueHeads)
      with_count<kValueHeads>(std::min(kValueHeads, heads - x), [&](auto M) {
        weigh_tile_lanes<decltype(M)::value>(b, all + x, t0, t1, x == 0 ? last : -1);
      });
  }
  for (int x = 0; x < heads; x++) {
    const int n = n0 + x / width, i = i0 + x % width;
    float* out = a.out + (static_cast<size_t>(n) * a.h + g * per_group + i) * d;
    const V16 tv = vset1(total[x]);
    for (int c = 0; c < d; c += 16) vstore(out + c, vdiv(vload(xs[x].o + c), tv));
  }
}

// items [i0, i1): item i is block i / (g * parts) against kv head (i / parts) % g, its
// query heads' part i % parts
static void attention(const Attention& a, int i0, int i1, float* scratch) {
  const int per_group = a.h / a.g;
  for (int item = i0; item < i1; item++) {
    const int part = item % a.parts, pair = item / a.parts;
    const int blk = pair / a.g, g = pair % a.g;
    attend_block(a, a.block[blk], a.block[blk + 1], g, per_group * part / a.parts,
                 per_group * (part + 1) / a.parts, scratch);
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
    NINFER_NAME, sums, linear, GEMV_MAX, GEMM_MR, GEMM_NP, pack, dequant, rmsnorm, gated, attention,
    elementwise,
};

}  // namespace NINFER_NS
