// ninfer's native kernels: what each instruction-set build exports (a table of functions),
// shared by the builds and by the torch operators that call them (ops.cpp).
//
// Packed matrices. A matrix of N outputs by K inputs is stored in panels of 16 outputs;
// a panel holds the K inputs in blocks of QB (16 or 32) consecutive inputs, laid out as
// its format says (FORMATS, below). Output n of a panel is vector lane n. The values are
// exactly the GGUF file's (code * scale [+ offset]), and y = x W^T computes each output
// block by block
// in float32: the block's partial sum over its inputs in order, x[k] * code[k], one fused
// multiply-add a term from 0; then acc = part * scale + acc, and (formats with offsets)
// acc = (the block's sum of x) * offset + acc, each one fused multiply-add. That sum is
// the same whatever the number of rows, the panels a thread takes, or the vector width
// of the CPU.
#pragma once

#include <cstdint>

namespace ninfer {

// The packed formats, the one description of each (the packer, pack.h, and the kernels,
// kernels.h, both read FORMATS). A block of QB inputs for 16 outputs holds, in order:
// the 16 scales (halves or floats; none for a dense format), the 16 offsets (formats
// with offsets), then for each of the QB inputs the 16 outputs' codes: 4-bit (8 bytes:
// output l < 8 in the low nibble of byte l, else the high nibble of byte l - 8), 8-bit
// signed (16 bytes), or the values themselves (halves, 32 bytes; floats, 64 bytes).
//
// A K-quant format (`kquant`: the K-quants' own) keeps the file's two-level scales
// instead of one float a group: its block is the file's super-block of 256 inputs, and
// holds the 16 outputs' d (floats), their -dmin (floats; formats with offsets), then for
// each group of `sub` inputs the 16 outputs' 8-bit multipliers of d (and of -dmin), then
// the codes. A group's scale is d * multiplier, its offset -dmin * multiplier: exact
// products in float (11 bits by 8 at most), the very floats a format with one float a
// group stores, so the sums are the same bits in fewer bytes: Q4_K 4.75 bits a weight
// instead of 6 (U4K against U4F), Q6_K 8.625 instead of 10 (I8K against I8F16), Q5_K
// 8.75 instead of 10 (I8KM32 against I8FM), a stack of K-quants 9.25 instead of 12 (I8KM
// against I8FM16).
enum Format : int32_t {
  FMT_U4H = 1,    // Q4_0, Q4_1
  FMT_U4F = 2,    // Q4_K
  FMT_I8H = 3,    // Q8_0, Q5_0
  FMT_I8HM = 4,   // Q5_1
  FMT_I8FM = 5,   // Q5_K
  FMT_I8F16 = 6,  // Q6_K, Q3_K
  FMT_I8FM16 = 7, // Q2_K; and any mix of quantized types
  FMT_F16 = 8,    // F16
  FMT_F32 = 9,    // F32, BF16; and a mix with a dense type
  FMT_U4K = 10,   // Q4_K, its scales as the file keeps them
  FMT_I8K = 11,   // Q6_K, Q3_K, likewise
  FMT_I8KM = 12,  // a stack of K-quants (Q4_K_M's Q, K and V), likewise
  FMT_I8KM32 = 13,  // Q5_K, likewise
};

struct FormatLayout {
  int32_t format;
  const char* name;
  int32_t block;       // inputs a block (QB)
  int32_t code_bytes;  // bytes of one input's 16 codes
  bool half_scales;    // scales (and offsets) as halves, else floats
  bool offsets;        // an offset per output and block
  bool dense;          // the codes are the values (no scales)
  int32_t sub;         // inputs a scale covers (QB, but for a K-quant format)
  bool kquant;         // scales as d (a float a block) times an 8-bit multiplier a sub-block
};

inline constexpr FormatLayout FORMATS[] = {
    {FMT_U4H, "U4H (4-bit codes, half scales and offsets)", 32, 8, true, true, false, 32, false},
    {FMT_U4F, "U4F (4-bit codes, float scales and offsets)", 32, 8, false, true, false, 32, false},
    {FMT_I8H, "I8H (8-bit codes, half scales)", 32, 16, true, false, false, 32, false},
    {FMT_I8HM, "I8HM (8-bit codes, half scales and offsets)", 32, 16, true, true, false, 32, false},
    {FMT_I8FM, "I8FM (8-bit codes, float scales and offsets)", 32, 16, false, true, false, 32,
     false},
    {FMT_I8F16, "I8F16 (8-bit codes, float scales, 16 inputs a block)", 16, 16, false, false,
     false, 16, false},
    {FMT_I8FM16, "I8FM16 (8-bit codes, float scales and offsets, 16 a block)", 16, 16, false,
     true, false, 16, false},
    {FMT_F16, "F16 (half values)", 32, 32, true, false, true, 32, false},
    {FMT_F32, "F32 (float values)", 32, 64, false, false, true, 32, false},
    {FMT_U4K, "U4K (4-bit codes, Q4_K's scales: d and dmin times 6-bit multipliers)", 256, 8,
     false, true, false, 32, true},
    {FMT_I8K, "I8K (8-bit codes, K-quant scales: d times 8-bit multipliers)", 256, 16, false,
     false, false, 16, true},
    {FMT_I8KM, "I8KM (8-bit codes, K-quant scales and offsets: d, -dmin times 8-bit multipliers)",
     256, 16, false, true, false, 16, true},
    {FMT_I8KM32, "I8KM32 (8-bit codes, Q5_K's scales and offsets: d, -dmin times 6-bit multipliers)",
     256, 16, false, true, false, 32, true},
};

// The layout of format `f`, or null for a format that is not one of these.
inline constexpr const FormatLayout* format_layout(int32_t f) {
  for (const FormatLayout& l : FORMATS)
    if (l.format == f) return &l;
  return nullptr;
}

struct Matrix {
  const uint8_t* data;
  int32_t format;
  int32_t n;  // outputs
  int32_t k;  // inputs
};

// One attention call: for each query q (N of them, H heads of D), the keys and values of
// its row's pages. One layer's keys are [pages][G][D][S] (each head's page transposed: a
// vector of 16 keys' element d is contiguous), its values [pages][G][S][D]; float32, IEEE
// half (each read as the float of the same value), or int8 with a float scale per position
// and head ([pages][G][S]). S: a multiple of 16.
struct Attention {
  const float* q;        // (N, H, D)
  float* out;            // (N, H, D)
  const void* k;         // the layer's keys
  const void* v;
  const float* k_scale;  // int8 only, else null
  const float* v_scale;
  int32_t half;          // 1: the keys and values are IEEE halves (no scales)
  const int64_t* page_table;  // (R, P)
  const int64_t* row;         // (N,): the query's row of page_table
  const int64_t* position;    // (N,): the query's position; it sees keys 0..position
  int32_t n, h, g, d, s, p;   // queries, heads, kv heads, head dim, page size, pages a row
  int32_t window;             // > 0: only the keys less than this far behind
  float scale;                // scores are scale * q.k
  float softcap;              // > 0: scores -> softcap * tanh(scores / softcap)
  // The queries in blocks: block b is queries block[b]..block[b + 1] - 1, all of one row:
  // at most kBlockHeads query heads of a kv head, or a single query (whose kv head may
  // have up to kMaxBlockHeads). Blocks share loads, never numbers (kernels.h, attention).
  const int32_t* block;       // (blocks + 1,)
  int32_t blocks;
  // Each block's query heads of a kv head in `parts` parts (1: whole), a task each: where
  // every block is one query (a decode step) and its kv heads are fewer than the threads.
  // Parts share no numbers either: a query head's are its own.
  int32_t parts;
};

// A block aims at kBlockHeads query heads of a kv head (its queries' scores stay in a
// core's cache); no kv head may have more than kMaxBlockHeads query heads.
constexpr int kBlockHeads = 64;
constexpr int kMaxBlockHeads = 256;

struct Kernels {
  const char* name;
  // each row's sums of x over blocks of qb inputs, in order from 0: out (m, k / qb)
  void (*sums)(const float* x, int m, int ldx, int k, int qb, float* out);
  // y[m][n] for the panels [p0, p1) of w, rows 0..m-1 (row stride ldx, ldy); sums: the
  // rows' block sums for w's block size; xp: x packed by `pack` where m > gemv_max (the
  // GEMM path's rows), else unused
  void (*linear)(const float* x, int m, int ldx, const float* sums, const Matrix& w, int p0,
                 int p1, float* y, int ldy, const float* xp);
  // Products of more rows than gemv_max take the GEMM path: x packed once a product (m x k
  // floats, rows in groups of gemm_mr) and gemm_np panels at a time (tasks split there).
  int gemv_max, gemm_mr, gemm_np;
  // x's rows [r0, r1) (r0 a multiple of gemm_mr; r1 too, or m) packed for the GEMM path:
  // into dst + r0 * k
  void (*pack)(const float* x, int m, int ldx, int k, int r0, int r1, float* dst);
  // rows [n0, n1) of w as their values, each k floats
  void (*dequant)(const Matrix& w, int n0, int n1, float* out);
  // one row: out = x / sqrt(mean(x^2) + eps) * weight
  void (*rmsnorm)(const float* x, const float* weight, int dim, float eps, float* out);
  // one row of a gate/up output (2 * ffn): out = act(gate) * up (act: SiLU, or GELU-tanh)
  void (*gated)(const float* gate_up, int ffn, int gelu, float* out);
  // blocks [i0, i1) x kv heads x parts (item i: block i / (g * parts), kv head
  // (i / parts) % g, part i % parts); scratch: the most query heads a block has x (head
  // dim + the most keys a query sees + 32) floats
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
