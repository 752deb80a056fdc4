// The kernels compiled for plain x86-64 (or any CPU): the reference the vector builds equal.
#define NINFER_NS ninfer_default
#define NINFER_NAME "default"

#include "kernels.h"

extern "C" const ninfer::Kernels* ninfer_kernels_default() { return &ninfer_default::table; }
