// The kernels compiled for AVX2 CPUs (see _kernels.py for the flags).
#define NINFER_NS ninfer_avx2
#define NINFER_NAME "avx2"
#define NINFER_ISA_AVX2 1
#include "kernels.h"

extern "C" const ninfer::Kernels* ninfer_kernels_avx2() { return &ninfer_avx2::table; }
