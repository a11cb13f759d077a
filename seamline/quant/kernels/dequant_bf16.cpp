// Dequantisation to bfloat16 for prefill, rounding with AVX512-BF16 (one instruction per 32
// weights instead of six integer ones). Compiled for its own target; kernels.cpp calls it
// only when the CPU has AVX512-BF16.
#include "kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && !SEAMLINE_AVX2
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,f16c,fma,avx2,bmi2")
#include "blocks.h"

namespace seamline_quant {

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

template <class D>
static void dequant_native(const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0, int64_t r1, uint16_t* out) {
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* dst = out + r * cols;
    for_pairs<D>(w + r * w_stride, cols, [&](int64_t p, const Pair& P) {
      _mm512_storeu_si512(dst + 64 * p, (__m512i)_mm512_cvtne2ps_pbh(chunk_f32<D, 1>(P), chunk_f32<D, 0>(P)));
      if (64 * p + 64 <= cols)  // else the odd last block of a row
        _mm512_storeu_si512(dst + 64 * p + 32, (__m512i)_mm512_cvtne2ps_pbh(chunk_f32<D, 3>(P), chunk_f32<D, 2>(P)));
    });
  }
}

void dequant_rows_bf16_native(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0, int64_t r1,
                              uint16_t* out) {
#define SEAMLINE_DEQ_NATIVE(D) dequant_native<D>(w, w_stride, cols, r0, r1, out)
  SEAMLINE_DISPATCH(qtype, SEAMLINE_DEQ_NATIVE)
}

}  // namespace seamline_quant

#else

namespace seamline_quant {
bool cpu_has_bf16() { return false; }
void dequant_rows_bf16_native(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
}  // namespace seamline_quant

#endif
