// Packing GGUF tensors into the kernels' panels (api.h), once at load, without changing a
// value: each GGML type's block is read as codes with a scale (and an offset) per group of
// 16 inputs, exactly as llama.cpp's reference dequantizer (the `gguf` package) reads it:
//
//   Q4_0  d * (q - 8)        -> U4H  code q, scale d, offset -8d (exact in half)
//   Q4_1  d * q + m          -> U4H
//   Q4_K  (d sc) q - dmin m  -> U4K  (d sc and dmin m are exact products in float; U4K
//                                     keeps d, dmin and the 6-bit sc, m as the file does)
//   Q8_0  d * q              -> I8H
//   Q5_0  d * (q - 16)       -> I8H  code q - 16
//   Q5_1  d * q + m          -> I8HM
//   Q5_K  (d sc) q - dmin m  -> I8KM32  (d, dmin and the 6-bit sc, m as the file keeps them)
//   Q6_K  (d sc) (q - 32)    -> I8K  (d and the 8-bit sc as the file keeps them)
//   Q3_K  (d (sc - 32)) q    -> I8K
//   Q2_K  (d sc) q - dmin m  -> I8KM
//   F16                      -> F16;  BF16, F32 -> F32
//
// Several tensors stacked along their outputs (Q, K and V as one matrix) take the format
// of their types when it is one, else I8KM when all are K-quants (a Q4_K_M file's Q4_K
// and Q6_K), else I8FM16 (every quantized type fits it), else F32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "api.h"
#include "half.h"

namespace ninfer {


// The half float equal to f; false when there is none (f is not exactly a half).
inline bool float_to_half_exact(float f, uint16_t* out) {
  if (f == 0.0f) {
    *out = std::signbit(f) ? 0x8000u : 0;
    return true;
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  int exp = static_cast<int>((bits >> 23) & 0xff) - 127;
  uint32_t man = bits & 0x7fffffu;
  uint16_t h;
  if (exp > 15) return false;
  if (exp >= -14) {
    if (man & 0x1fffu) return false;
    h = static_cast<uint16_t>(sign | ((exp + 15) << 10) | (man >> 13));
  } else {  // a half subnormal: man * 2^-24
    if (exp < -24) return false;
    uint32_t full = man | 0x800000u;
    int shift = 13 + (-14 - exp);
    if (full & ((1u << shift) - 1)) return false;
    h = static_cast<uint16_t>(sign | (full >> shift));
  }
  if (half_to_float(h) != f) return false;
  *out = h;
  return true;
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One row of a tensor as groups of 16 inputs: codes with a scale and an offset each (a
// quantized type), or plain values (F16, BF16, F32).
struct Row {
  bool dense = false;
  std::vector<int8_t> codes;   // k
  std::vector<float> scale;    // k / 16
  std::vector<float> offset;   // k / 16
  std::vector<float> values;   // k (dense)
  std::vector<uint16_t> half;  // k (F16, kept as stored)
  // A K-quant's scales as the file keeps them (else empty): d and dmin a super-block of
  // 256, and each group of 16's multipliers: scale = d * sc, offset = -(dmin * m)
  std::vector<float> kd, kdmin;   // k / 256
  std::vector<int8_t> ksc, km;    // k / 16
};

// The GGML tensor types the packer reads.
enum class GType { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16, F32 };

inline GType gtype(const std::string& t) {
  static const struct {
    const char* name;
    GType type;
  } names[] = {{"Q4_0", GType::Q4_0}, {"Q4_1", GType::Q4_1}, {"Q5_0", GType::Q5_0},
               {"Q5_1", GType::Q5_1}, {"Q8_0", GType::Q8_0}, {"Q2_K", GType::Q2_K},
               {"Q3_K", GType::Q3_K}, {"Q4_K", GType::Q4_K}, {"Q5_K", GType::Q5_K},
               {"Q6_K", GType::Q6_K}, {"F16", GType::F16},   {"BF16", GType::BF16},
               {"F32", GType::F32}};
  for (const auto& n : names)
    if (t == n.name) return n.type;
  throw std::invalid_argument("no native packing for tensor type " + t);
}

inline int type_block(const std::string& t) {
  if (t == "Q4_0" || t == "Q4_1" || t == "Q5_0" || t == "Q5_1" || t == "Q8_0") return 32;
  if (t == "Q2_K" || t == "Q3_K" || t == "Q4_K" || t == "Q5_K" || t == "Q6_K") return 256;
  if (t == "F16" || t == "BF16" || t == "F32") return 1;
  throw std::invalid_argument("no native packing for tensor type " + t);
}

// A K-quant (Q2_K to Q6_K): 256-input super-blocks with two-level scales.
inline bool k_quant(const std::string& t) { return type_block(t) == 256; }

inline int type_bytes(const std::string& t) {
  static const struct {
    const char* name;
    int bytes;
  } sizes[] = {{"Q4_0", 18}, {"Q4_1", 20}, {"Q5_0", 22}, {"Q5_1", 24}, {"Q8_0", 34},
               {"Q2_K", 84}, {"Q3_K", 110}, {"Q4_K", 144}, {"Q5_K", 176}, {"Q6_K", 210},
               {"F16", 2},   {"BF16", 2},   {"F32", 4}};
  for (const auto& s : sizes)
    if (t == s.name) return s.bytes;
  throw std::invalid_argument("no native packing for tensor type " + t);
}

inline int natural_format(const std::string& t) {
  if (t == "Q4_0" || t == "Q4_1") return FMT_U4H;
  if (t == "Q4_K") return FMT_U4K;
  if (t == "Q8_0" || t == "Q5_0") return FMT_I8H;
  if (t == "Q5_1") return FMT_I8HM;
  if (t == "Q5_K") return FMT_I8KM32;
  if (t == "Q6_K" || t == "Q3_K") return FMT_I8K;
  if (t == "Q2_K") return FMT_I8KM;
  if (t == "F16") return FMT_F16;
  if (t == "BF16" || t == "F32") return FMT_F32;
  throw std::invalid_argument("no native packing for tensor type " + t);
}

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Q4_K and Q5_K: the 6-bit scale and offset of sub-block j (of 8) of a super-block.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void unpack_row(const std::string& t, const uint8_t* src, int k, Row* row) {
  // The type compared as a number: a string compared per value (as this once did) made
  // packing 130 MB/s, most of a 1.7B model's load.
  const GType g = gtype(t);
  const int g16 = k / 16;
  if (g == GType::F16 || g == GType::BF16 || g == GType::F32) {
    row->dense = true;
    row->values.resize(k);
    if (g == GType::F16) row->half.resize(k);
    for (int i = 0; i < k; i++) {
      if (g == GType::F32) {
        std::memcpy(&row->values[i], src + 4 * i, 4);
      } else if (g == GType::F16) {
        row->half[i] = rd16(src + 2 * i);
        row->values[i] = half_to_float(row->half[i]);
      } else {
        row->values[i] = bf16_to_float(rd16(src + 2 * i));
      }
    }
    return;
  }
  row->codes.assign(k, 0);
  row->scale.assign(g16, 0.0f);
  row->offset.assign(g16, 0.0f);
  int8_t* c = row->codes.data();
  float* sc = row->scale.data();
  float* of = row->offset.data();
  if (g == GType::Q4_0 || g == GType::Q4_1 || g == GType::Q5_0 || g == GType::Q5_1 || g == GType::Q8_0) {
    const int bytes = type_bytes(t);
    for (int b = 0; b < k / 32; b++) {
      const uint8_t* p = src + b * bytes;
      const float d = half_to_float(rd16(p));
      float m = 0.0f;
      const uint8_t* qs;
      uint32_t qh = 0;
      int8_t* out = c + b * 32;
      if (g == GType::Q8_0) {
        for (int i = 0; i < 32; i++) out[i] = static_cast<int8_t>(p[2 + i]);
      } else {
        if (g == GType::Q4_0) {
          qs = p + 2;
          m = -8.0f * d;
        } else if (g == GType::Q4_1) {
          m = half_to_float(rd16(p + 2));
          qs = p + 4;
        } else if (g == GType::Q5_0) {
          std::memcpy(&qh, p + 2, 4);
          qs = p + 6;
        } else {
          m = half_to_float(rd16(p + 2));
          std::memcpy(&qh, p + 4, 4);
          qs = p + 8;
        }
        for (int i = 0; i < 16; i++) {
          int lo = qs[i] & 15, hi = qs[i] >> 4;
          if (g == GType::Q5_0 || g == GType::Q5_1) {
            lo |= ((qh >> i) & 1) << 4;
            hi |= ((qh >> (i + 16)) & 1) << 4;
          }
          if (g == GType::Q5_0) {
            lo -= 16;
            hi -= 16;
          }
          out[i] = static_cast<int8_t>(lo);
          out[i + 16] = static_cast<int8_t>(hi);
        }
      }
      sc[2 * b] = sc[2 * b + 1] = d;
      of[2 * b] = of[2 * b + 1] = m;
    }
    return;
  }
  const int bytes = type_bytes(t);
  const bool kscales = k_quant(t);
  row->kd.assign(kscales ? k / 256 : 0, 0.0f);
  row->kdmin.assign(kscales ? k / 256 : 0, 0.0f);
  row->ksc.assign(kscales ? g16 : 0, 0);
  row->km.assign(kscales ? g16 : 0, 0);
  for (int b = 0; b < k / 256; b++) {
    const uint8_t* p = src + b * bytes;
    int8_t* out = c + b * 256;
    float* bsc = sc + b * 16;
    float* bof = of + b * 16;
    if (g == GType::Q4_K || g == GType::Q5_K) {
      const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
      const uint8_t* scales = p + 4;
      const uint8_t* qh = p + 16;
      const uint8_t* qs = g == GType::Q4_K ? p + 16 : p + 48;
      row->kd[b] = d;
      row->kdmin[b] = dmin;
      for (int j = 0; j < 8; j++) {
        int s, m;
        scale_min_k4(j, scales, &s, &m);
        bsc[2 * j] = bsc[2 * j + 1] = d * static_cast<float>(s);
        bof[2 * j] = bof[2 * j + 1] = -(dmin * static_cast<float>(m));
        row->ksc[b * 16 + 2 * j] = row->ksc[b * 16 + 2 * j + 1] = static_cast<int8_t>(s);
        row->km[b * 16 + 2 * j] = row->km[b * 16 + 2 * j + 1] = static_cast<int8_t>(m);
        const int chunk = j / 2, shift = (j % 2) * 4;
        for (int l = 0; l < 32; l++) {
          int q = (qs[chunk * 32 + l] >> shift) & 15;
          if (g == GType::Q5_K) q |= ((qh[l] >> j) & 1) << 4;
          out[j * 32 + l] = static_cast<int8_t>(q);
        }
      }
    } else if (g == GType::Q6_K) {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half_to_float(rd16(p + 208));
      row->kd[b] = d;
      for (int j = 0; j < 16; j++) {
        bsc[j] = d * static_cast<float>(scales[j]);
        bof[j] = 0.0f;
        row->ksc[b * 16 + j] = scales[j];
      }
      // value h * 128 + q * 32 + l of the super-block (half h, quarter q): the low
      // nibble of ql[h * 64 + l] (q 0) or ql[h * 64 + 32 + l] (q 1), their high nibbles
      // (q 2, 3), and bits 2q, 2q + 1 of qh[h * 32 + l] above them
      for (int h = 0; h < 2; h++) {
        const uint8_t* lo = ql + h * 64;
        const uint8_t* hi = qh + h * 32;
        int8_t* o = out + h * 128;
        for (int l = 0; l < 32; l++) {
          const int a = lo[l], c = lo[l + 32], bits = hi[l];
          o[l] = static_cast<int8_t>(((a & 15) | ((bits & 3) << 4)) - 32);
          o[l + 32] = static_cast<int8_t>(((c & 15) | (((bits >> 2) & 3) << 4)) - 32);
          o[l + 64] = static_cast<int8_t>(((a >> 4) | (((bits >> 4) & 3) << 4)) - 32);
          o[l + 96] = static_cast<int8_t>(((c >> 4) | (((bits >> 6) & 3) << 4)) - 32);
        }
      }
    } else if (g == GType::Q3_K) {
      const uint8_t* hmask = p;
      const uint8_t* qs = p + 32;
      const uint8_t* s = p + 96;
      const float d = half_to_float(rd16(p + 108));
      row->kd[b] = d;
      for (int j = 0; j < 16; j++) {
        const int lo = (s[j % 8] >> ((j / 8) * 4)) & 15;
        const int hi = (s[8 + j % 4] >> ((j / 4) * 2)) & 3;
        bsc[j] = d * static_cast<float>((lo | (hi << 4)) - 32);
        bof[j] = 0.0f;
        row->ksc[b * 16 + j] = static_cast<int8_t>((lo | (hi << 4)) - 32);
      }
      for (int i = 0; i < 256; i++) {
        const int h = i / 128, r = i % 128, l = r % 32, quarter = r / 32;
        const int lo = (qs[h * 32 + l] >> (quarter * 2)) & 3;
        const int high = (hmask[l] >> (h * 4 + quarter)) & 1;
        out[i] = static_cast<int8_t>(lo - (high ? 0 : 4));
      }
    } else if (g == GType::Q2_K) {
      const uint8_t* scales = p;
      const uint8_t* qs = p + 16;
      const float d = half_to_float(rd16(p + 80)), dmin = half_to_float(rd16(p + 82));
      row->kd[b] = d;
      row->kdmin[b] = dmin;
      for (int j = 0; j < 16; j++) {
        bsc[j] = d * static_cast<float>(scales[j] & 15);
        bof[j] = -(dmin * static_cast<float>(scales[j] >> 4));
        row->ksc[b * 16 + j] = static_cast<int8_t>(scales[j] & 15);
        row->km[b * 16 + j] = static_cast<int8_t>(scales[j] >> 4);
      }
      for (int i = 0; i < 256; i++) {
        const int h = i / 128, r = i % 128, l = r % 32, quarter = r / 32;
        out[i] = static_cast<int8_t>((qs[h * 32 + l] >> (quarter * 2)) & 3);
      }
    } else {
      throw std::invalid_argument("no native packing for tensor type " + t);
    }
  }
}

// The format's layout (api.h's FORMATS), refusing one that is not a format by name.
inline const FormatLayout& layout_of(int f) {
  const FormatLayout* l = format_layout(f);
  if (l == nullptr)
    throw std::invalid_argument("unknown packed matrix format " + std::to_string(f) +
                                " (the formats are 1 to 13: api.h)");
  return *l;
}
inline int format_block(int f) { return layout_of(f).block; }
inline bool format_min(int f) { return layout_of(f).offsets; }
inline bool format_dense(int f) { return layout_of(f).dense; }
inline int format_code_bytes(int f) { return layout_of(f).code_bytes; }
// The inputs a scale covers (the rows' sums of x are over groups of as many).
inline int format_sub(int f) { return layout_of(f).sub; }
// The bytes of a block's scales (and of its offsets, as many, in formats with them): a
// K-quant's d and its multipliers, else one scale a block (none for a dense format).
inline int format_scale_bytes(int f) {
  const FormatLayout& l = layout_of(f);
  if (l.kquant) return 64 + (l.block / l.sub) * 16;
  return l.dense ? 0 : 16 * (l.half_scales ? 2 : 4);
}
inline size_t format_block_bytes(int f) {
  const int scale = format_scale_bytes(f);
  return static_cast<size_t>(scale + (format_min(f) ? scale : 0) + format_block(f) * format_code_bytes(f));
}
inline size_t packed_bytes(int f, int n, int k) {
  return static_cast<size_t>((n + 15) / 16) * (k / format_block(f)) * format_block_bytes(f);
}

// The format a stack of tensors of these types is packed in.
inline int stack_format(const std::vector<std::string>& types) {
  int f = natural_format(types[0]);
  bool same = true, dense = false;
  for (const auto& t : types) {
    same = same && natural_format(t) == f;
    dense = dense || format_dense(natural_format(t));
  }
  if (same) return f;
  bool kquants = true;
  for (const auto& t : types) kquants = kquants && k_quant(t);
  return dense ? FMT_F32 : kquants ? FMT_I8KM : FMT_I8FM16;
}

// Block b's scale and offset of a quantized row into lane `lane` of its packed block
// (`fl`: the format's layout, looked up once by the caller, not for each lane and block).
inline void put_scale(const Row& row, const FormatLayout& fl, int b, int lane, uint8_t* blk) {
  if (row.dense) throw std::invalid_argument("a dense tensor in a quantized format");
  const int qb = fl.block;
  if (fl.kquant) {  // d, -dmin, the scales' multipliers, the offsets'
    if (row.kd.empty()) throw std::invalid_argument("a K-quant format for a tensor of another type");
    const int ns = qb / fl.sub, per = fl.sub / 16;
    const float d = row.kd[b], neg_dmin = -row.kdmin[b];
    std::memcpy(blk + lane * 4, &d, 4);
    if (fl.offsets) std::memcpy(blk + 64 + lane * 4, &neg_dmin, 4);
    uint8_t* mult = blk + (fl.offsets ? 128 : 64);
    for (int s = 0; s < ns; s++) {
      const int g = b * (qb / 16) + s * per;
      for (int i = 1; i < per; i++)
        if (row.ksc[g + i] != row.ksc[g] || row.km[g + i] != row.km[g])
          throw std::invalid_argument("a scale group with two scales");
      // the packed scale is the row's own: d * sc exact, and -dmin * m = -(dmin * m) (a
      // file's NaN stays one, as in the formats that store the products)
      auto same = [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); };
      if (!same(d * static_cast<float>(row.ksc[g]), row.scale[g]) ||
          (fl.offsets && !same(neg_dmin * static_cast<float>(row.km[g]), row.offset[g])) ||
          (!fl.offsets && row.offset[g] != 0.0f))
        throw std::invalid_argument("a K-quant scale that is not d times its multiplier");
      mult[s * 16 + lane] = static_cast<uint8_t>(row.ksc[g]);
      if (fl.offsets) mult[ns * 16 + s * 16 + lane] = static_cast<uint8_t>(row.km[g]);
    }
    return;
  }
  const int scale_bytes = 16 * (fl.half_scales ? 2 : 4);
  const int g = b * qb / 16;
  if (qb == 32 && (row.scale[g] != row.scale[g + 1] || row.offset[g] != row.offset[g + 1]))
    throw std::invalid_argument("a 32-input block with two scales");
  const float d = row.scale[g], m = row.offset[g];
  if (fl.half_scales) {
    uint16_t hd, hm;
    if (!float_to_half_exact(d, &hd) || (fl.offsets && !float_to_half_exact(m, &hm)))
      throw std::invalid_argument("a scale that is not a half float");
    std::memcpy(blk + lane * 2, &hd, 2);
    if (fl.offsets) std::memcpy(blk + scale_bytes + lane * 2, &hm, 2);
  } else {
    std::memcpy(blk + lane * 4, &d, 4);
    if (fl.offsets) std::memcpy(blk + scale_bytes + lane * 4, &m, 4);
  }
  if (!fl.offsets && m != 0.0f) throw std::invalid_argument("an offset in a format without");
}

// The 16 rows of panel `p` (rows[l]: lane l) of a quantized format written whole, block
// by block, each code byte once (pack_row, a row at a time, reads and writes each byte of
// 4-bit codes for each of its two rows and strides across every block for each row: a
// Q4_K matrix packed 1.5x faster this way). The same bytes as pack_row's for each row.
inline void pack_panel(const Row* rows, int f, int p, int k, uint8_t* out) {
  const FormatLayout& fl = layout_of(f);
  const int qb = format_block(f), nb = k / qb;
  const size_t bb = format_block_bytes(f);
  const int scale_bytes = format_scale_bytes(f);
  const int min_bytes = format_min(f) ? scale_bytes : 0;
  const int cb = format_code_bytes(f);
  for (int l = 0; l < 16; l++) {
    if (rows[l].dense) throw std::invalid_argument("a dense tensor in a quantized format");
    if (rows[l].codes.size() != static_cast<size_t>(k))
      throw std::invalid_argument("a row of another length");
  }
  for (int b = 0; b < nb; b++) {
    uint8_t* blk = out + (static_cast<size_t>(p) * nb + b) * bb;
    uint8_t* codes = blk + scale_bytes + min_bytes;
    for (int l = 0; l < 16; l++) put_scale(rows[l], fl, b, l, blk);
    const int k0 = b * qb;
    if (cb == 8) {  // U4: lane l < 8 in the low nibble of byte l, lane l + 8 in its high
      for (int i = 0; i < qb; i++) {
        uint8_t* at = codes + i * 8;
        for (int l = 0; l < 8; l++) {
          const int8_t lo = rows[l].codes[k0 + i], hi = rows[l + 8].codes[k0 + i];
          if (lo < 0 || lo > 15 || hi < 0 || hi > 15)
            throw std::invalid_argument("a 4-bit code out of range");
          at[l] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
    } else {
      for (int i = 0; i < qb; i++)
        for (int l = 0; l < 16; l++) codes[i * cb + l] = static_cast<uint8_t>(rows[l].codes[k0 + i]);
    }
  }
}

// The 16 rows of a panel (src[l]: lane l's row as the file stores it) of Q4_K straight
// into U4K, most of a Q4_K_M file's matrices: the same bytes as unpack_row and pack_panel
// write (tests/test_kernels.py compares them), without staging each row's codes and
// scales (a 1.7B model's 8192 x 2048 Q4_K matrix packed in 3.4-4.0 ms against 5.2, best
// of three). Q4_K has no code or scale U4K cannot hold, so nothing is refused here. (Q6_K
// the same way into I8K was no faster: 9.6 ms against 9.0 for its 2048 x 8192 down.)
inline void pack_panel_q4k(const uint8_t* const* src, int k, uint8_t* out) {
  const FormatLayout& fl = layout_of(FMT_U4K);
  const int nb = k / 256, ns = 256 / fl.sub;
  const size_t bb = format_block_bytes(FMT_U4K);
  const int head = 2 * format_scale_bytes(FMT_U4K);
  for (int b = 0; b < nb; b++) {
    uint8_t* blk = out + static_cast<size_t>(b) * bb;
    uint8_t* mult = blk + 128;  // d and -dmin before: the multipliers, then the offsets'
    uint8_t* codes = blk + head;
    const uint8_t* qs[16];
    for (int l = 0; l < 16; l++) {
      const uint8_t* p = src[l] + static_cast<size_t>(b) * 144;
      const float d = half_to_float(rd16(p)), neg_dmin = -half_to_float(rd16(p + 2));
      std::memcpy(blk + l * 4, &d, 4);
      std::memcpy(blk + 64 + l * 4, &neg_dmin, 4);
      for (int j = 0; j < ns; j++) {
        int sc, m;
        scale_min_k4(j, p + 4, &sc, &m);
        mult[j * 16 + l] = static_cast<uint8_t>(sc);
        mult[ns * 16 + j * 16 + l] = static_cast<uint8_t>(m);
      }
      qs[l] = p + 16;
    }
    // input j * 32 + i of the block: nibble j % 2 of byte (j / 2) * 32 + i
    for (int j = 0; j < ns; j++) {
      const int shift = (j % 2) * 4, at = (j / 2) * 32;
      for (int l = 0; l < 8; l++) {
        const uint8_t* lo = qs[l] + at;
        const uint8_t* hi = qs[l + 8] + at;
        uint8_t* o = codes + static_cast<size_t>(j) * 32 * 8 + l;
        for (int i = 0; i < 32; i++)
          o[i * 8] = static_cast<uint8_t>(((lo[i] >> shift) & 15) | (((hi[i] >> shift) & 15) << 4));
      }
    }
  }
}

// Write row `n` (of the whole matrix) into the packed buffer of format f.
inline void pack_row(const Row& row, int f, int n, int k, uint8_t* out) {
  if ((row.dense ? row.values.size() : row.codes.size()) != static_cast<size_t>(k))
    throw std::invalid_argument("a row of another length");
  const FormatLayout& fl = layout_of(f);
  const int qb = format_block(f), nb = k / qb;
  const size_t bb = format_block_bytes(f);
  const int p = n / 16, lane = n % 16;
  const int scale_bytes = format_scale_bytes(f);
  const int min_bytes = format_min(f) ? scale_bytes : 0;
  const int cb = format_code_bytes(f);
  for (int b = 0; b < nb; b++) {
    uint8_t* blk = out + (static_cast<size_t>(p) * nb + b) * bb;
    uint8_t* codes = blk + scale_bytes + min_bytes;
    if (format_dense(f)) {
      if (f == FMT_F16 && (!row.dense || row.half.empty()))
        throw std::invalid_argument("F16 packing of a tensor that is not F16");
      for (int i = 0; i < qb; i++) {
        const int kk = b * qb + i;
        if (f == FMT_F16) {
          std::memcpy(codes + i * cb + lane * 2, &row.half[kk], 2);
          continue;
        }
        // a quantized row stacked with dense ones: its values, as the reference
        // computes them (code * scale is exact; one rounding with the offset)
        const float v = row.dense ? row.values[kk]
                                  : std::fma(static_cast<float>(row.codes[kk]), row.scale[kk / 16],
                                             row.offset[kk / 16]);
        std::memcpy(codes + i * cb + lane * 4, &v, 4);
      }
      continue;
    }
    put_scale(row, fl, b, lane, blk);
    for (int i = 0; i < qb; i++) {
      const int8_t q = row.codes[b * qb + i];
      if (cb == 8) {  // U4: lane l < 8 in the low nibble of byte l, else the high of l - 8
        if (q < 0 || q > 15) throw std::invalid_argument("a 4-bit code out of range");
        uint8_t& byte = codes[i * cb + (lane % 8)];
        byte = static_cast<uint8_t>(lane < 8 ? (byte & 0xF0) | q : (byte & 0x0F) | (q << 4));
      } else {
        codes[i * cb + lane] = static_cast<uint8_t>(q);
      }
    }
  }
}

}  // namespace ninfer
