// Up to 16 floats (mask: which) stored as float32, float16 or bfloat16 (rounded to nearest even
// as torch rounds; NaN stays NaN). For files compiled with AVX-512 F/BW/VL (decode.cpp, amx.cpp).
#pragma once

#include "intrinsics.h"

#include "kernels.h"

namespace seamline_quant {

static inline void store16(void* p, int dt, __mmask16 m, __m512 v) {
  if (dt == F32) return _mm512_mask_storeu_ps(p, m, v);
  if (dt == F16) return _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));  // NaN
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(u));
}

}  // namespace seamline_quant
