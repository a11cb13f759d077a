// <immintrin.h>; in the AVX2 build (SEAMLINE_AVX2) also the AVX-512 names the kernels use,
// emulated on 256-bit registers. Included after a file's SEAMLINE_TARGET.
#pragma once

#include <immintrin.h>

#if SEAMLINE_AVX2
#include "avx2_512.h"
#endif
