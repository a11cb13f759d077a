// The AVX-512 intrinsics the kernels use, on AVX2 (+FMA, F16C): a 512-bit register is two
// 256-bit halves (lo: elements 0..7 of 32 bits, bytes 0..31), and a mask register's bits pick
// lanes through a compare. The kernels' sources stay the one statement of each algorithm;
// compiled with SEAMLINE_AVX2 (kernels.h) they include this after <immintrin.h>, and its macros
// below rename each _mm512_* (and the AVX512-VL/BW ones) to its emulation here.
// Exact where integers are concerned: vpdpbusd's u8 x s8 sums are taken without the int16
// saturation of vpmaddubsw, truncating conversions truncate.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

struct sl_m512 {
  __m256 lo, hi;
};
struct sl_m512i {
  __m256i lo, hi;
};

// ---- lane masks from mask bits (bit i selects lane i)
static inline __m256i sl_mask32(unsigned bits) {  // 8 dword lanes
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel);
}
static inline __m256i sl_mask16(unsigned bits) {  // 16 word lanes
  const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
  return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), sel), sel);
}
static inline __m256i sl_mask8(uint32_t bits) {  // 32 byte lanes: byte j takes bit j
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(b, sel), sel);
}
static inline __m256i sl_mask64(unsigned bits) {  // 4 qword lanes
  const __m256i sel = _mm256_setr_epi64x(1, 2, 4, 8);
  return _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(bits), sel), sel);
}

// ---- float vectors
static inline sl_m512 sl_setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline sl_m512 sl_set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
static inline sl_m512 sl_loadu_ps(const void* p) {
  return {_mm256_loadu_ps((const float*)p), _mm256_loadu_ps((const float*)p + 8)};
}
static inline void sl_storeu_ps(void* p, sl_m512 v) {
  _mm256_storeu_ps((float*)p, v.lo);
  _mm256_storeu_ps((float*)p + 8, v.hi);
}
static inline sl_m512 sl_maskz_loadu_ps(unsigned m, const void* p) {  // masked lanes are never read
  return {_mm256_maskload_ps((const float*)p, sl_mask32(m & 0xFF)),
          _mm256_maskload_ps((const float*)p + 8, sl_mask32((m >> 8) & 0xFF))};
}
static inline void sl_mask_storeu_ps(void* p, unsigned m, sl_m512 v) {
  _mm256_maskstore_ps((float*)p, sl_mask32(m & 0xFF), v.lo);
  _mm256_maskstore_ps((float*)p + 8, sl_mask32((m >> 8) & 0xFF), v.hi);
}
#define SL_PS2(name, op) \
  static inline sl_m512 name(sl_m512 a, sl_m512 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SL_PS2(sl_add_ps, _mm256_add_ps)
SL_PS2(sl_sub_ps, _mm256_sub_ps)
SL_PS2(sl_mul_ps, _mm256_mul_ps)
SL_PS2(sl_div_ps, _mm256_div_ps)
SL_PS2(sl_max_ps, _mm256_max_ps)
SL_PS2(sl_min_ps, _mm256_min_ps)
SL_PS2(sl_andnot_ps, _mm256_andnot_ps)
#undef SL_PS2
static inline sl_m512 sl_fmadd_ps(sl_m512 a, sl_m512 b, sl_m512 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline sl_m512 sl_blend_ps(sl_m512 src, unsigned m, sl_m512 v) {
  return {_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(sl_mask32(m & 0xFF))),
          _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(sl_mask32((m >> 8) & 0xFF)))};
}
static inline sl_m512 sl_mask_add_ps(sl_m512 src, unsigned m, sl_m512 a, sl_m512 b) {
  return sl_blend_ps(src, m, sl_add_ps(a, b));
}
static inline sl_m512 sl_mask_sub_ps(sl_m512 src, unsigned m, sl_m512 a, sl_m512 b) {
  return sl_blend_ps(src, m, sl_sub_ps(a, b));
}
static inline float sl_hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float sl_reduce_add_ps(sl_m512 v) { return sl_hsum8(_mm256_add_ps(v.lo, v.hi)); }
static inline float sl_reduce_max_ps(sl_m512 v) {
  const __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline sl_m512 sl_broadcastss_ps(__m128 v) { return {_mm256_broadcastss_ps(v), _mm256_broadcastss_ps(v)}; }
static inline sl_m512 sl_permutexvar_ps(sl_m512i idx, sl_m512 v) {  // out[i] = v[idx[i] & 15]
  auto half = [&](__m256i ix) {
    const __m256 from_hi = _mm256_castsi256_ps(_mm256_slli_epi32(ix, 28));  // sign bit: index bit 3
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(v.lo, ix), _mm256_permutevar8x32_ps(v.hi, ix), from_hi);
  };
  return {half(idx.lo), half(idx.hi)};
}
template <int IMM>
static inline sl_m512 sl_roundscale_ps(sl_m512 v) {
  static_assert((IMM & 0xF0) == 0, "only rounding to an integer (scale 2^0) is emulated");
  return {_mm256_round_ps(v.lo, IMM & 0x0F), _mm256_round_ps(v.hi, IMM & 0x0F)};
}
// a * 2^n for integral n: two normal powers of two, so that results down to denormals come out
static inline __m256 sl_scalef8(__m256 a, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
static inline sl_m512 sl_scalef_ps(sl_m512 a, sl_m512 n) { return {sl_scalef8(a.lo, n.lo), sl_scalef8(a.hi, n.hi)}; }
template <int PRED>
static inline unsigned sl_cmp_ps_mask(sl_m512 a, sl_m512 b) {
  return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, PRED)) |
         (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, PRED)) << 8;
}

// ---- conversions
static inline sl_m512 sl_cvtepi32_ps(sl_m512i v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
static inline sl_m512i sl_cvtps_epi32(sl_m512 v) { return {_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi)}; }
static inline sl_m512i sl_castps_si512(sl_m512 v) { return {_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi)}; }
static inline sl_m512 sl_castsi512_ps(sl_m512i v) { return {_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi)}; }
static inline sl_m512 sl_cvtph_ps(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
template <int R>
static inline __m256i sl_cvtps_ph(sl_m512 v) {
  return _mm256_set_m128i(_mm256_cvtps_ph(v.hi, R), _mm256_cvtps_ph(v.lo, R));
}
static inline __m128i sl_low16_of32(__m256i v) {  // 8 dwords -> their low words (truncation)
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12,
                                        13, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08));
}
static inline __m256i sl_cvtepi32_epi16(sl_m512i v) { return _mm256_set_m128i(sl_low16_of32(v.hi), sl_low16_of32(v.lo)); }
static inline uint64_t sl_low8_of32(__m256i v) {  // 8 dwords -> their low bytes (truncation)
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1,
                                        -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(v, pick);
  return (uint64_t)(uint32_t)_mm256_extract_epi32(b, 0) | (uint64_t)(uint32_t)_mm256_extract_epi32(b, 4) << 32;
}
static inline __m128i sl_cvtepi32_epi8(sl_m512i v) {
  return _mm_set_epi64x((long long)sl_low8_of32(v.hi), (long long)sl_low8_of32(v.lo));
}
static inline sl_m512i sl_cvtepu8_epi32(__m128i v) {
  return {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))};
}
static inline sl_m512i sl_cvtepi8_epi32(__m128i v) {
  return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
}
static inline sl_m512i sl_cvtepu16_epi32(__m256i v) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}

// ---- integer vectors
static inline sl_m512i sl_setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline sl_m512i sl_set1_epi8(char v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
static inline sl_m512i sl_set1_epi16(short v) { return {_mm256_set1_epi16(v), _mm256_set1_epi16(v)}; }
static inline sl_m512i sl_set1_epi32(int v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
static inline sl_m512i sl_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7,
                                    int e6, int e5, int e4, int e3, int e2, int e1, int e0) {
  return {_mm256_set_epi32(e7, e6, e5, e4, e3, e2, e1, e0), _mm256_set_epi32(e15, e14, e13, e12, e11, e10, e9, e8)};
}
static inline sl_m512i sl_set_epi16(short e31, short e30, short e29, short e28, short e27, short e26, short e25,
                                    short e24, short e23, short e22, short e21, short e20, short e19, short e18,
                                    short e17, short e16, short e15, short e14, short e13, short e12, short e11,
                                    short e10, short e9, short e8, short e7, short e6, short e5, short e4, short e3,
                                    short e2, short e1, short e0) {
  return {_mm256_set_epi16(e15, e14, e13, e12, e11, e10, e9, e8, e7, e6, e5, e4, e3, e2, e1, e0),
          _mm256_set_epi16(e31, e30, e29, e28, e27, e26, e25, e24, e23, e22, e21, e20, e19, e18, e17, e16)};
}
static inline sl_m512i sl_loadu_si512(const void* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1)};
}
static inline void sl_storeu_si512(void* p, sl_m512i v) {
  _mm256_storeu_si256((__m256i*)p, v.lo);
  _mm256_storeu_si256((__m256i*)p + 1, v.hi);
}
#define SL_SI2(name, op) \
  static inline sl_m512i name(sl_m512i a, sl_m512i b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SL_SI2(sl_and_si512, _mm256_and_si256)
SL_SI2(sl_or_si512, _mm256_or_si256)
SL_SI2(sl_xor_si512, _mm256_xor_si256)
SL_SI2(sl_add_epi16, _mm256_add_epi16)
SL_SI2(sl_add_epi32, _mm256_add_epi32)
SL_SI2(sl_sub_epi32, _mm256_sub_epi32)
SL_SI2(sl_mullo_epi32, _mm256_mullo_epi32)
SL_SI2(sl_madd_epi16, _mm256_madd_epi16)
SL_SI2(sl_maddubs_epi16, _mm256_maddubs_epi16)
#undef SL_SI2
static inline sl_m512i sl_slli_epi16(sl_m512i v, int n) { return {_mm256_slli_epi16(v.lo, n), _mm256_slli_epi16(v.hi, n)}; }
static inline sl_m512i sl_slli_epi32(sl_m512i v, int n) { return {_mm256_slli_epi32(v.lo, n), _mm256_slli_epi32(v.hi, n)}; }
static inline sl_m512i sl_srli_epi16(sl_m512i v, int n) { return {_mm256_srli_epi16(v.lo, n), _mm256_srli_epi16(v.hi, n)}; }
static inline sl_m512i sl_srli_epi32(sl_m512i v, int n) { return {_mm256_srli_epi32(v.lo, n), _mm256_srli_epi32(v.hi, n)}; }
static inline sl_m512i sl_srl_epi16(sl_m512i v, __m128i n) { return {_mm256_srl_epi16(v.lo, n), _mm256_srl_epi16(v.hi, n)}; }
static inline sl_m512i sl_blend8(sl_m512i src, __m256i m_lo, __m256i m_hi, sl_m512i v) {
  return {_mm256_blendv_epi8(src.lo, v.lo, m_lo), _mm256_blendv_epi8(src.hi, v.hi, m_hi)};
}
static inline sl_m512i sl_mask_srli_epi16(sl_m512i src, uint32_t k, sl_m512i a, int n) {
  return sl_blend8(src, sl_mask16(k & 0xFFFF), sl_mask16(k >> 16), sl_srli_epi16(a, n));
}
static inline sl_m512i sl_mask_set1_epi16(sl_m512i src, uint32_t k, short v) {
  return sl_blend8(src, sl_mask16(k & 0xFFFF), sl_mask16(k >> 16), sl_set1_epi16(v));
}
static inline sl_m512i sl_mask_add_epi32(sl_m512i src, unsigned k, sl_m512i a, sl_m512i b) {
  return sl_blend8(src, sl_mask32(k & 0xFF), sl_mask32((k >> 8) & 0xFF), sl_add_epi32(a, b));
}
static inline sl_m512i sl_mask_mov_epi32(sl_m512i src, unsigned k, sl_m512i a) {
  return sl_blend8(src, sl_mask32(k & 0xFF), sl_mask32((k >> 8) & 0xFF), a);
}
static inline sl_m512i sl_mask_blend_epi64(unsigned k, sl_m512i a, sl_m512i b) {
  return sl_blend8(a, sl_mask64(k & 0xF), sl_mask64((k >> 4) & 0xF), b);
}
static inline sl_m512i sl_maskz_mov_epi8(uint64_t k, sl_m512i v) {
  return {_mm256_and_si256(v.lo, sl_mask8((uint32_t)k)), _mm256_and_si256(v.hi, sl_mask8((uint32_t)(k >> 32)))};
}
// the truth table IMM of (a, b, c) bitwise: bit (a << 2 | b << 1 | c) of IMM
template <int IMM>
static inline __m256i sl_ternary8(__m256i a, __m256i b, __m256i c) {
  const __m256i ones = _mm256_set1_epi32(-1);
  __m256i r = _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t) {
    if (!((IMM >> t) & 1)) continue;
    const __m256i x = (t & 4) ? a : _mm256_xor_si256(a, ones), y = (t & 2) ? b : _mm256_xor_si256(b, ones);
    const __m256i z = (t & 1) ? c : _mm256_xor_si256(c, ones);
    r = _mm256_or_si256(r, _mm256_and_si256(x, _mm256_and_si256(y, z)));
  }
  return r;
}
template <int IMM>
static inline sl_m512i sl_ternarylogic_epi32(sl_m512i a, sl_m512i b, sl_m512i c) {
  return {sl_ternary8<IMM>(a.lo, b.lo, c.lo), sl_ternary8<IMM>(a.hi, b.hi, c.hi)};
}
// acc + per dword the 4 products u8 a x s8 b, exactly: a's low 7 bits and its top bit apart,
// so that no pair sum reaches vpmaddubsw's int16 saturation
static inline __m256i sl_dpbusd8(__m256i acc, __m256i a, __m256i b) {
  const __m256i low7 = _mm256_and_si256(a, _mm256_set1_epi8(0x7F));
  const __m256i top = _mm256_and_si256(_mm256_srli_epi16(a, 7), _mm256_set1_epi8(1));
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(low7, b), _mm256_set1_epi16(1)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(top, b), _mm256_set1_epi16(128)));
}
static inline sl_m512i sl_dpbusd_epi32(sl_m512i acc, sl_m512i a, sl_m512i b) {
  return {sl_dpbusd8(acc.lo, a.lo, b.lo), sl_dpbusd8(acc.hi, a.hi, b.hi)};
}
static inline int sl_hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
static inline int sl_reduce_add_epi32(sl_m512i v) { return sl_hsum8i(_mm256_add_epi32(v.lo, v.hi)); }
static inline int sl_mask_reduce_add_epi32(unsigned k, sl_m512i v) {
  return sl_reduce_add_epi32({_mm256_and_si256(v.lo, sl_mask32(k & 0xFF)), _mm256_and_si256(v.hi, sl_mask32((k >> 8) & 0xFF))});
}
template <int SCALE>
static inline sl_m512i sl_i32gather_epi32(sl_m512i idx, const void* base) {
  return {_mm256_i32gather_epi32((const int*)base, idx.lo, SCALE), _mm256_i32gather_epi32((const int*)base, idx.hi, SCALE)};
}

// ---- 128/256-bit parts
template <int C>
static inline __m128i sl_extracti32x4_epi32(sl_m512i v) {
  const __m256i h = C < 2 ? v.lo : v.hi;
  return C % 2 ? _mm256_extracti128_si256(h, 1) : _mm256_castsi256_si128(h);
}
template <int C>
static inline sl_m512i sl_inserti64x4(sl_m512i v, __m256i x) {
  return C ? sl_m512i{v.lo, x} : sl_m512i{x, v.hi};
}
static inline sl_m512i sl_castsi256_si512(__m256i x) { return {x, _mm256_setzero_si256()}; }
static inline sl_m512i sl_zextsi256_si512(__m256i x) { return {x, _mm256_setzero_si256()}; }
static inline __m256i sl_castsi512_si256(sl_m512i v) { return v.lo; }
static inline sl_m512i sl_broadcast_i32x4(__m128i x) {
  const __m256i b = _mm256_broadcastsi128_si256(x);
  return {b, b};
}
static inline sl_m512i sl_broadcast_i64x4(__m256i x) { return {x, x}; }

// ---- word permutes and word-masked memory: through memory (no AVX2 word permute crosses lanes)
static inline sl_m512i sl_permutexvar_epi16(sl_m512i idx, sl_m512i v) {
  alignas(64) uint16_t src[32], ix[32], out[32];
  sl_storeu_si512(src, v);
  sl_storeu_si512(ix, idx);
  for (int i = 0; i < 32; ++i) out[i] = src[ix[i] & 31];
  return sl_loadu_si512(out);
}
static inline __m256i sl_permutexvar_epi16_256(__m256i idx, __m256i v) {
  alignas(32) uint16_t src[16], ix[16], out[16];
  _mm256_store_si256((__m256i*)src, v);
  _mm256_store_si256((__m256i*)ix, idx);
  for (int i = 0; i < 16; ++i) out[i] = src[ix[i] & 15];
  return _mm256_load_si256((const __m256i*)out);
}
static inline void sl_mask_storeu_epi16_256(void* p, unsigned k, __m256i v) {
  alignas(32) uint16_t w[16];
  _mm256_store_si256((__m256i*)w, v);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy((char*)p + 2 * i, &w[i], 2);
}
static inline __m256i sl_maskz_loadu_epi16_256(unsigned k, const void* p) {  // masked words are never read
  alignas(32) uint16_t w[16] = {0};
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(&w[i], (const char*)p + 2 * i, 2);
  return _mm256_load_si256((const __m256i*)w);
}

// ---- shortcuts for the kernels' word permutes whose pattern is known (blocks.h takes them)
// fp16 values at a and b as 16 floats [a x8, b x8]
static inline sl_m512 sl_halves(const uint8_t* a, const uint8_t* b) {
  uint16_t ha, hb;
  std::memcpy(&ha, a, 2);
  std::memcpy(&hb, b, 2);
  return {_mm256_set1_ps(_cvtsh_ss(ha)), _mm256_set1_ps(_cvtsh_ss(hb))};
}
// words 2d and 2d + 1 of w.lo (its dword d): lo = [word 2d x16], hi = [word 2d + 1 x16]
static inline sl_m512i sl_word_pair(sl_m512i w, int d) {
  const __m256i dword = _mm256_permutevar8x32_epi32(w.lo, _mm256_set1_epi32(d));
  return {_mm256_shuffle_epi8(dword, _mm256_set1_epi16(0x0100)), _mm256_shuffle_epi8(dword, _mm256_set1_epi16(0x0302))};
}
// words of w.lo's dwords d0 and d1 (d = words 2d, 2d + 1), each spread over a 128-bit lane:
// lo = [word 2 d0 x8, word 2 d0 + 1 x8], hi = [word 2 d1 x8, word 2 d1 + 1 x8]
static inline sl_m512i sl_spread_words(sl_m512i w, int d0, int d1) {
  const __m256i first_second = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                                2, 3, 2, 3, 2, 3, 2, 3);
  return {_mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(w.lo, _mm256_set1_epi32(d0)), first_second),
          _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(w.lo, _mm256_set1_epi32(d1)), first_second)};
}

// ---- the names the kernels use
#define __m512 sl_m512
#define __m512i sl_m512i
#define _mm512_setzero_ps sl_setzero_ps
#define _mm512_set1_ps sl_set1_ps
#define _mm512_loadu_ps sl_loadu_ps
#define _mm512_storeu_ps sl_storeu_ps
#define _mm512_maskz_loadu_ps sl_maskz_loadu_ps
#define _mm512_mask_storeu_ps sl_mask_storeu_ps
#define _mm512_add_ps sl_add_ps
#define _mm512_sub_ps sl_sub_ps
#define _mm512_mul_ps sl_mul_ps
#define _mm512_div_ps sl_div_ps
#define _mm512_max_ps sl_max_ps
#define _mm512_min_ps sl_min_ps
#define _mm512_andnot_ps sl_andnot_ps
#define _mm512_fmadd_ps sl_fmadd_ps
#define _mm512_mask_add_ps sl_mask_add_ps
#define _mm512_mask_sub_ps sl_mask_sub_ps
#define _mm512_reduce_add_ps sl_reduce_add_ps
#define _mm512_reduce_max_ps sl_reduce_max_ps
#define _mm512_broadcastss_ps sl_broadcastss_ps
#define _mm512_permutexvar_ps sl_permutexvar_ps
#define _mm512_roundscale_ps(v, imm) sl_roundscale_ps<(imm)>(v)
#define _mm512_scalef_ps sl_scalef_ps
#define _mm512_cmp_ps_mask(a, b, pred) sl_cmp_ps_mask<(pred)>(a, b)
#define _mm512_cvtepi32_ps sl_cvtepi32_ps
#define _mm512_cvtps_epi32 sl_cvtps_epi32
#define _mm512_castps_si512 sl_castps_si512
#define _mm512_castsi512_ps sl_castsi512_ps
#define _mm512_cvtph_ps sl_cvtph_ps
#define _mm512_cvtps_ph(v, r) sl_cvtps_ph<(r)>(v)
#define _mm512_cvtepi32_epi16 sl_cvtepi32_epi16
#define _mm512_cvtepi32_epi8 sl_cvtepi32_epi8
#define _mm512_cvtepu8_epi32 sl_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 sl_cvtepi8_epi32
#define _mm512_cvtepu16_epi32 sl_cvtepu16_epi32
#define _mm512_setzero_si512 sl_setzero_si512
#define _mm512_set1_epi8 sl_set1_epi8
#define _mm512_set1_epi16 sl_set1_epi16
#define _mm512_set1_epi32 sl_set1_epi32
#define _mm512_set_epi32 sl_set_epi32
#define _mm512_set_epi16 sl_set_epi16
#define _mm512_loadu_si512 sl_loadu_si512
#define _mm512_storeu_si512 sl_storeu_si512
#define _mm512_and_si512 sl_and_si512
#define _mm512_or_si512 sl_or_si512
#define _mm512_xor_si512 sl_xor_si512
#define _mm512_add_epi16 sl_add_epi16
#define _mm512_add_epi32 sl_add_epi32
#define _mm512_sub_epi32 sl_sub_epi32
#define _mm512_mullo_epi32 sl_mullo_epi32
#define _mm512_madd_epi16 sl_madd_epi16
#define _mm512_maddubs_epi16 sl_maddubs_epi16
#define _mm512_slli_epi16 sl_slli_epi16
#define _mm512_slli_epi32 sl_slli_epi32
#define _mm512_srli_epi16 sl_srli_epi16
#define _mm512_srli_epi32 sl_srli_epi32
#define _mm512_srl_epi16 sl_srl_epi16
#define _mm512_mask_srli_epi16 sl_mask_srli_epi16
#define _mm512_mask_set1_epi16 sl_mask_set1_epi16
#define _mm512_mask_add_epi32 sl_mask_add_epi32
#define _mm512_mask_mov_epi32 sl_mask_mov_epi32
#define _mm512_mask_blend_epi64 sl_mask_blend_epi64
#define _mm512_maskz_mov_epi8 sl_maskz_mov_epi8
#define _mm512_ternarylogic_epi32(a, b, c, imm) sl_ternarylogic_epi32<(imm)>(a, b, c)
#define _mm512_dpbusd_epi32 sl_dpbusd_epi32
#define _mm512_reduce_add_epi32 sl_reduce_add_epi32
#define _mm512_mask_reduce_add_epi32 sl_mask_reduce_add_epi32
#define _mm512_i32gather_epi32(idx, base, scale) sl_i32gather_epi32<(scale)>(idx, base)
#define _mm512_extracti32x4_epi32(v, c) sl_extracti32x4_epi32<(c)>(v)
#define _mm512_inserti64x4(v, x, c) sl_inserti64x4<(c)>(v, x)
#define _mm512_castsi256_si512 sl_castsi256_si512
#define _mm512_zextsi256_si512 sl_zextsi256_si512
#define _mm512_castsi512_si256 sl_castsi512_si256
#define _mm512_broadcast_i32x4 sl_broadcast_i32x4
#define _mm512_broadcast_i64x4 sl_broadcast_i64x4
#define _mm512_permutexvar_epi16 sl_permutexvar_epi16
#define _mm256_permutexvar_epi16 sl_permutexvar_epi16_256
#define _mm256_mask_storeu_epi16 sl_mask_storeu_epi16_256
#define _mm256_maskz_loadu_epi16 sl_maskz_loadu_epi16_256
