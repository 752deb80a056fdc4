// ninfer's native kernels: a vector of 16 float lanes, written once per instruction set.
//
// Every kernel computes on V16 values; each lane of each operation is one IEEE float
// operation (fma, mul, add, ...), the same in the plain C++ build (NINFER_ISA_DEFAULT),
// the AVX2 build (two 8-lane registers) and the AVX-512 build (one 16-lane register).
// So a kernel gives bit-identical numbers on every CPU it runs on, and whatever number of
// rows or threads it is called with: nothing here depends on how many lanes the hardware
// has. The translation units are compiled with -ffp-contract=off, so the compiler never
// fuses a multiply and an add that the code wrote apart (or splits an fma it wrote).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"

#if defined(NINFER_ISA_AVX512) || defined(NINFER_ISA_AVX2)
#include <immintrin.h>
#endif

namespace NINFER_NS {

#if defined(NINFER_ISA_AVX512)

struct V16 {
  __m512 v;
};
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vset1(float s) { return {_mm512_set1_ps(s)}; }
static inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
// 16 half floats -> 16 floats (exact).
static inline V16 vload_half(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// 8 bytes: the low nibble of byte i is lane i, the high nibble lane i + 8 (as floats).
static inline V16 vnibbles(const uint8_t* p) {
  uint64_t bytes;
  std::memcpy(&bytes, p, 8);
  // the 8 bytes in lanes 0..7 and again in 8..15 (one widening), then lanes 8..15
  // shifted down a nibble; each lane's low nibble then picks its float from a table of
  // 0..15 (the permute reads only an index's low 4 bits: no mask, no conversion; a
  // one-row product on 4-bit codes 1.14x faster than the and + convert it replaced)
  __m512i b = _mm512_cvtepu8_epi32(_mm_set1_epi64x(static_cast<long long>(bytes)));
  const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return {_mm512_permutexvar_ps(_mm512_srlv_epi32(b, shift), values)};
}
// 16 signed bytes -> 16 floats.
static inline V16 vbytes(const int8_t* p) {
  return {_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// lanes where a < b get c, the others d
static inline V16 vselect_lt(V16 a, V16 b, V16 c, V16 d) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), d.v, c.v)};
}
// 2^n for integral-valued float lanes n in [-126, 127]
static inline V16 vexp2i(V16 n) {
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(e)};
}
static inline V16 vabs(V16 a) {
  return {_mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7fffffff)))};
}
static inline V16 vcopysign(V16 mag, V16 sign) {
  __m512i s = _mm512_and_si512(_mm512_castps_si512(sign.v), _mm512_set1_epi32(INT32_MIN));
  return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag.v), s))};
}

#elif defined(NINFER_ISA_AVX2)

struct V16 {
  __m256 a, b;  // lanes 0..7, 8..15
};
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vset1(float s) {
  __m256 t = _mm256_set1_ps(s);
  return {t, t};
}
static inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V16 x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
static inline V16 vfma(V16 x, V16 y, V16 z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
static inline V16 vmul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V16 vadd(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline V16 vsub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
static inline V16 vdiv(V16 x, V16 y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
static inline V16 vmax(V16 x, V16 y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
static inline V16 vmin(V16 x, V16 y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
static inline V16 vload_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline V16 vnibbles(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))),
          _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
static inline V16 vbytes(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(
              _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
static inline V16 vselect_lt(V16 x, V16 y, V16 c, V16 d) {
  return {_mm256_blendv_ps(d.a, c.a, _mm256_cmp_ps(x.a, y.a, _CMP_LT_OQ)),
          _mm256_blendv_ps(d.b, c.b, _mm256_cmp_ps(x.b, y.b, _CMP_LT_OQ))};
}
static inline __m256 exp2i8(__m256 n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(e);
}
static inline V16 vexp2i(V16 n) { return {exp2i8(n.a), exp2i8(n.b)}; }
static inline V16 vabs(V16 x) {
  __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(x.a, m), _mm256_and_ps(x.b, m)};
}
static inline V16 vcopysign(V16 mag, V16 sign) {
  __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  return {_mm256_or_ps(mag.a, _mm256_and_ps(sign.a, s)), _mm256_or_ps(mag.b, _mm256_and_ps(sign.b, s))};
}

#else  // plain C++: the reference every vector build must equal, lane for lane

struct V16 {
  float v[16];
};
#define NINFER_LANES(expr)          \
  V16 r;                            \
  for (int i = 0; i < 16; i++) {    \
    r.v[i] = (expr);                \
  }                                 \
  return r
static inline V16 vzero() { NINFER_LANES(0.0f); }
static inline V16 vset1(float s) { NINFER_LANES(s); }
static inline V16 vload(const float* p) { NINFER_LANES(p[i]); }
static inline void vstore(float* p, V16 a) { std::memcpy(p, a.v, sizeof(a.v)); }
// std::fma: the C library's, rounded once as the FMA instruction rounds (glibc takes the
// instruction where the CPU has it, an exact software path where not).
static inline V16 vfma(V16 a, V16 b, V16 c) { NINFER_LANES(std::fma(a.v[i], b.v[i], c.v[i])); }
static inline V16 vmul(V16 a, V16 b) { NINFER_LANES(a.v[i] * b.v[i]); }
static inline V16 vadd(V16 a, V16 b) { NINFER_LANES(a.v[i] + b.v[i]); }
static inline V16 vsub(V16 a, V16 b) { NINFER_LANES(a.v[i] - b.v[i]); }
static inline V16 vdiv(V16 a, V16 b) { NINFER_LANES(a.v[i] / b.v[i]); }
// x86's max/min: the second operand when either is NaN or both are zeros
static inline V16 vmax(V16 a, V16 b) { NINFER_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
static inline V16 vmin(V16 a, V16 b) { NINFER_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
static inline V16 vload_half(const uint16_t* p) { NINFER_LANES(half_to_float(p[i])); }
static inline V16 vnibbles(const uint8_t* p) {
  NINFER_LANES(static_cast<float>(i < 8 ? (p[i] & 15) : (p[i - 8] >> 4)));
}
static inline V16 vbytes(const int8_t* p) { NINFER_LANES(static_cast<float>(p[i])); }
static inline V16 vselect_lt(V16 a, V16 b, V16 c, V16 d) { NINFER_LANES(a.v[i] < b.v[i] ? c.v[i] : d.v[i]); }
static inline V16 vexp2i(V16 n) {
  V16 r;
  for (int i = 0; i < 16; i++) {
    uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(std::nearbyint(n.v[i])) + 127) << 23;
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
static inline V16 vabs(V16 a) { NINFER_LANES(std::fabs(a.v[i])); }
static inline V16 vcopysign(V16 mag, V16 sign) { NINFER_LANES(std::copysign(mag.v[i], sign.v[i])); }
#undef NINFER_LANES

#endif

// The sum of the 16 lanes, always in this tree: (i, i + 8), then (i, i + 4), (i, i + 2),
// (0, 1).
static inline float vsum(V16 x) {
  alignas(64) float t[16];
  vstore(t, x);
  float s8[8], s4[4];
  for (int i = 0; i < 8; i++) s8[i] = t[i] + t[i + 8];
  for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float vmaxall(V16 x) {
  alignas(64) float t[16];
  vstore(t, x);
  float m = t[0];
  for (int i = 1; i < 16; i++) m = t[i] > m ? t[i] : m;
  return m;
}

// exp(x) lane by lane, about 1 ulp: x = n ln 2 + r with |r| <= ln2 / 2, e^r by a degree-6
// polynomial, times 2^n. Below -87.3 (where e^x is subnormal or zero) it gives 0, and -inf
// gives 0; above 88.7 it gives +inf. The same operations in every build, so the same bits.
static inline V16 vexp(V16 x) {
  const V16 hi = vset1(88.72f), lo = vset1(-87.33f);
  V16 xc = vmin(vmax(x, lo), hi);
  // n = round(x / ln 2): adding 1.5 * 2^23 rounds to an integer (to nearest, ties even)
  const V16 magic = vset1(12582912.0f);
  V16 n = vsub(vfma(xc, vset1(1.44269504088896341f), magic), magic);
  V16 r = vfma(n, vset1(-0.693359375f), xc);  // ln 2, split: an exact high part
  r = vfma(n, vset1(2.12194440e-4f), r);      // and the rest
  V16 p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  V16 r2 = vmul(r, r);
  p = vfma(p, r2, vadd(r, vset1(1.0f)));
  // 2^n in two halves, so that n = 128 (x near 88.7) does not overflow the exponent
  V16 half_n = vmul(n, vset1(0.5f));
  V16 n1 = vsub(vadd(half_n, magic), magic);  // round(n / 2)
  V16 n2 = vsub(n, n1);
  V16 out = vmul(vmul(p, vexp2i(n1)), vexp2i(n2));
  // below the range: 0 (also for -inf); above: +inf
  out = vselect_lt(x, lo, vzero(), out);
  return vselect_lt(hi, x, vset1(INFINITY), out);
}

// tanh(x): for |x| < 0.625 an odd polynomial, x + x^3 P(x^2) (Cephes' tanhf), where the
// form below would cancel; else sign(x) (1 - 2 / (e^{2|x|} + 1)). About 2 ulp.
static inline V16 vtanh(V16 x) {
  V16 a = vabs(x);
  V16 e = vexp(vadd(a, a));
  V16 big = vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(e, vset1(1.0f))));
  V16 s = vmul(x, x);
  V16 p = vset1(-5.70498872745e-3f);
  p = vfma(p, s, vset1(2.06390887954e-2f));
  p = vfma(p, s, vset1(-5.37397155531e-2f));
  p = vfma(p, s, vset1(1.33314422036e-1f));
  p = vfma(p, s, vset1(-3.33332819422e-1f));
  V16 small = vfma(vmul(p, s), x, x);
  return vselect_lt(a, vset1(0.625f), small, vcopysign(big, x));
}

// x * sigmoid(x) = x / (1 + e^-x)
static inline V16 vsilu(V16 x) {
  V16 e = vexp(vsub(vzero(), x));
  return vdiv(x, vadd(vset1(1.0f), e));
}

// GELU, tanh approximation: x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), written
// x / (1 + e^{-2u}) (the same function; 1 + tanh(u) would cancel for negative x).
static inline V16 vgelu_tanh(V16 x) {
  V16 x3 = vmul(vmul(x, x), x);
  V16 u2 = vmul(vset1(-1.5957691216057308f), vfma(vset1(0.044715f), x3, x));  // -2u
  return vdiv(x, vadd(vset1(1.0f), vexp(u2)));
}

}  // namespace NINFER_NS
