// IEEE half-precision bits to the float of the same value (every half is exactly a float),
// for the packing code and the plain build's vector loads alike.
//
// static: each translation unit, compiled for its own instruction set, keeps its own
// copy. An inline function with external linkage would be one symbol across the builds,
// and the linker could hand the plain build the AVX-512 build's code.
#pragma once

#include <cstdint>
#include <cstring>

static inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 113;
      while (!(man & 0x400u)) {
        man <<= 1;
        exp--;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
