// The kernels compiled for AVX512 CPUs (see _kernels.py for the flags).
#define NINFER_NS ninfer_avx512
#define NINFER_NAME "avx512"
#define NINFER_ISA_AVX512 1
#include "kernels.h"

extern "C" const ninfer::Kernels* ninfer_kernels_avx512() { return &ninfer_avx512::table; }
