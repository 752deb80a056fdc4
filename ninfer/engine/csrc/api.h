// ninfer's native kernels: what each instruction-set build exports (a table of functions),
// shared by the builds and by the torch operators that call them (ops.cpp).
//
// Packed matrices. A matrix of N outputs by K inputs is stored in panels of 16 outputs;
// a panel holds the K inputs in blocks of QB (16 or 32) consecutive inputs, and a block
// holds, for its 16 outputs: their scales (and offsets), then for each of the QB inputs
// the 16 outputs' codes. Output n of a panel is vector lane n. The values are exactly the
// GGUF file's (code * scale [+ offset]), and y = x W^T computes each output block by block
// in float32: the block's partial sum over its inputs in order, x[k] * code[k], one fused
// multiply-add a term from 0; then acc = part * scale + acc, and (formats with offsets)
// acc = (the block's sum of x) * offset + acc, each one fused multiply-add. That sum is
// the same whatever the number of rows, the panels a thread takes, or the vector width
// of the CPU.
#pragma once

#include <cstdint>

namespace ninfer {

enum Format : int32_t {
  // codes, scale type, offset, inputs a block
  FMT_U4H = 1,   // 4-bit codes, half scale and offset, 32 (Q4_0, Q4_1)
  FMT_U4F = 2,   // 4-bit codes, float scale and offset, 32 (Q4_K)
  FMT_I8H = 3,   // 8-bit codes, half scale, 32 (Q8_0, Q5_0)
  FMT_I8HM = 4,  // 8-bit codes, half scale and offset, 32 (Q5_1)
  FMT_I8FM = 5,  // 8-bit codes, float scale and offset, 32 (Q5_K)
  FMT_I8F16 = 6, // 8-bit codes, float scale, 16 (Q6_K, Q3_K)
  FMT_I8FM16 = 7,// 8-bit codes, float scale and offset, 16 (Q2_K; and any mix of types)
  FMT_F16 = 8,   // half values, 32 (F16)
  FMT_F32 = 9,   // float values, 32 (F32, BF16)
};

struct Matrix {
  const uint8_t* data;
  int32_t format;
  int32_t n;  // outputs
  int32_t k;  // inputs
};

// One attention call: for each query q (N of them, H heads of D), the keys and values of
// its row's pages. One layer's keys are [pages][G][D][S] (each head's page transposed: a
// vector of 16 keys' element d is contiguous), its values [pages][G][S][D]; float32, or
// int8 with a float scale per position and head ([pages][G][S]). S: a multiple of 16.
struct Attention {
  const float* q;        // (N, H, D)
  float* out;            // (N, H, D)
  const void* k;         // the layer's keys
  const void* v;
  const float* k_scale;  // int8 only, else null
  const float* v_scale;
  const int64_t* page_table;  // (R, P)
  const int64_t* row;         // (N,): the query's row of page_table
  const int64_t* position;    // (N,): the query's position; it sees keys 0..position
  int32_t n, h, g, d, s, p;   // queries, heads, kv heads, head dim, page size, pages a row
  int32_t window;             // > 0: only the keys less than this far behind
  float scale;                // scores are scale * q.k
  float softcap;              // > 0: scores -> softcap * tanh(scores / softcap)
};

struct Kernels {
  const char* name;
  // each row's sums of x over blocks of qb inputs, in order from 0: out (m, k / qb)
  void (*sums)(const float* x, int m, int ldx, int k, int qb, float* out);
  // y[m][n] for the panels [p0, p1) of w, rows 0..m-1 (row stride ldx, ldy); sums: the
  // rows' block sums for w's block size
  void (*linear)(const float* x, int m, int ldx, const float* sums, const Matrix& w, int p0,
                 int p1, float* y, int ldy);
  // rows [n0, n1) of w as their values, each k floats
  void (*dequant)(const Matrix& w, int n0, int n1, float* out);
  // one row: out = x / sqrt(mean(x^2) + eps) * weight
  void (*rmsnorm)(const float* x, const float* weight, int dim, float eps, float* out);
  // one row of a gate/up output (2 * ffn): out = act(gate) * up (act: SiLU, or GELU-tanh)
  void (*gated)(const float* gate_up, int ffn, int gelu, float* out);
  // queries [i0, i1) x kv heads (items i = query * g + kv head); scratch: 8 x (the most
  // keys a query sees, rounded up to 16, plus 16) floats
  void (*attention)(const Attention& a, int i0, int i1, float* scratch);
  // the vector functions on n floats (what the tests compare with float64): 0 exp,
  // 1 tanh, 2 silu, 3 gelu-tanh
  void (*elementwise)(int fn, const float* x, int n, float* out);
};

}  // namespace ninfer

extern "C" {
const ninfer::Kernels* ninfer_kernels_default();
const ninfer::Kernels* ninfer_kernels_avx2();
const ninfer::Kernels* ninfer_kernels_avx512();
}
