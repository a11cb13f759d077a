// GGUF block decoders for AVX-512: each turns 64 weights (a "pair": two 32-wide blocks or
// sub-blocks) into one register of unsigned 8-bit quants plus per-lane float scales and mins.
// A lane is 4 consecutive weights (what one vpdpbusd int32 lane sums), so the weight at
// element e is  (q[e] - OFFSET) * scale[e / 4] + minv[e / 4].
// Included only from kernels.cpp, after its AVX-512 target pragma.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace seamline_quant {

struct Pair {
  __m512i q;      // 64 unsigned quants, element order
  __m512 scale;   // per 4-element lane
  __m512 minv;    // per 4-element lane (zero for types without a min)
};

static inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static inline uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// [a x8 lanes, b x8 lanes]: one value per 32-wide block of the pair
static inline __m512 two(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

// two blocks of 16 packed bytes -> [lo(a), hi(a), lo(c), hi(c)] nibbles (GGUF's 32-block order)
static inline __m512i nib_pair(const uint8_t* a, const uint8_t* c) {
  __m128i va = _mm_loadu_si128((const __m128i*)a), vc = _mm_loadu_si128((const __m128i*)c);
  __m512i v = _mm512_castsi128_si512(va);
  v = _mm512_inserti32x4(v, va, 1);
  v = _mm512_inserti32x4(v, vc, 2);
  v = _mm512_inserti32x4(v, vc, 3);
  v = _mm512_mask_blend_epi64(0xCC, v, _mm512_srli_epi16(v, 4));
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

// 32 packed bytes -> [lo x32, hi x32] (K-quant sub-blocks 2j and 2j+1)
static inline __m512i nib_k(const uint8_t* p) {
  __m256i v = _mm256_loadu_si256((const __m256i*)p);
  __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

// add bit 4 where the 64-bit mask says so (the fifth bit of Q5 types)
static inline __m512i add_hi(__m512i q, uint64_t k) {
  return _mm512_or_si512(q, _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(0x10)));
}

// Types with 32-wide blocks: decode(p) reads the two consecutive blocks at p.
struct DQ4_0 {
  static constexpr int BLOCK = 32, BYTES = 18, OFFSET = 8;
  static constexpr bool MIN = false;
  static inline void decode(const uint8_t* p, Pair& o) {
    o.q = nib_pair(p + 2, p + 20);
    o.scale = two(h2f(p), h2f(p + 18));
  }
};

struct DQ4_1 {
  static constexpr int BLOCK = 32, BYTES = 20, OFFSET = 0;
  static constexpr bool MIN = true;
  static inline void decode(const uint8_t* p, Pair& o) {
    o.q = nib_pair(p + 4, p + 24);
    o.scale = two(h2f(p), h2f(p + 20));
    o.minv = two(h2f(p + 2), h2f(p + 22));
  }
};

struct DQ5_0 {
  static constexpr int BLOCK = 32, BYTES = 22, OFFSET = 16;
  static constexpr bool MIN = false;
  static inline void decode(const uint8_t* p, Pair& o) {
    uint64_t k = ld32(p + 2) | (uint64_t)ld32(p + 24) << 32;
    o.q = add_hi(nib_pair(p + 6, p + 28), k);
    o.scale = two(h2f(p), h2f(p + 22));
  }
};

struct DQ5_1 {
  static constexpr int BLOCK = 32, BYTES = 24, OFFSET = 0;
  static constexpr bool MIN = true;
  static inline void decode(const uint8_t* p, Pair& o) {
    uint64_t k = ld32(p + 4) | (uint64_t)ld32(p + 28) << 32;
    o.q = add_hi(nib_pair(p + 8, p + 32), k);
    o.scale = two(h2f(p), h2f(p + 24));
    o.minv = two(h2f(p + 2), h2f(p + 26));
  }
};

struct DQ8_0 {
  static constexpr int BLOCK = 32, BYTES = 34, OFFSET = 128;
  static constexpr bool MIN = false;
  static inline void decode(const uint8_t* p, Pair& o) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(p + 2));
    __m256i c = _mm256_loadu_si256((const __m256i*)(p + 36));
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
    o.q = _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80));  // signed -> unsigned + 128
    o.scale = two(h2f(p), h2f(p + 34));
  }
};

// K-quant 6-bit scale/min of sub-block j from the 12 packed bytes
static inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// scales and mins of sub-blocks 2j, 2j+1 of a Q4_K/Q5_K super-block
static inline void k_scales(const uint8_t* sb, int j, Pair& o) {
  float d = h2f(sb), dmin = h2f(sb + 2);
  int s0, m0, s1, m1;
  scale_min_k4(2 * j, sb + 4, s0, m0);
  scale_min_k4(2 * j + 1, sb + 4, s1, m1);
  o.scale = two(d * (float)s0, d * (float)s1);
  o.minv = two(-(dmin * (float)m0), -(dmin * (float)m1));
}

// Super-block types: decode(sb, j) reads pair j (0..3) of the 256-wide super-block sb.
struct DQ4_K {
  static constexpr int BLOCK = 256, BYTES = 144, OFFSET = 0;
  static constexpr bool MIN = true;
  static inline void decode(const uint8_t* sb, int j, Pair& o) {
    o.q = nib_k(sb + 16 + 32 * j);
    k_scales(sb, j, o);
  }
};

struct DQ5_K {
  static constexpr int BLOCK = 256, BYTES = 176, OFFSET = 0;
  static constexpr bool MIN = true;
  static inline void decode(const uint8_t* sb, int j, Pair& o) {
    __m256i qh = _mm256_loadu_si256((const __m256i*)(sb + 16));
    uint64_t k0 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * j))));
    uint64_t k1 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * j + 1))));
    o.q = add_hi(nib_k(sb + 48 + 32 * j), k0 | k1 << 32);
    k_scales(sb, j, o);
  }
};

struct DQ6_K {
  static constexpr int BLOCK = 256, BYTES = 210, OFFSET = 32;
  static constexpr bool MIN = false;
  // pair j covers elements 64j..64j+63: ql nibble (j & 1) of ql[64h..], qh bits 4s/4s+2 of qh[32h..]
  static inline void decode(const uint8_t* sb, int j, Pair& o) {
    int h = j >> 1, s = j & 1;
    __m512i ql = _mm512_loadu_si512((const void*)(sb + 64 * h));
    ql = _mm512_and_si512(_mm512_srl_epi16(ql, _mm_cvtsi32_si128(4 * s)), _mm512_set1_epi8(0x0F));
    __m256i qh = _mm256_loadu_si256((const __m256i*)(sb + 128 + 32 * h));
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
    __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * s)), _mm256_set1_epi16((short)(4 * s + 2)), 1);
    z = _mm512_and_si512(_mm512_srlv_epi16(z, cnt), _mm512_set1_epi8(0x03));
    o.q = _mm512_or_si512(ql, _mm512_slli_epi16(z, 4));
    __m128i sc = _mm_cvtepi8_epi32(_mm_cvtsi32_si128((int)ld32(sb + 192 + 4 * j)));
    __m512 s4 = _mm512_castps128_ps512(_mm_mul_ps(_mm_cvtepi32_ps(sc), _mm_set1_ps(h2f(sb + 208))));
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    o.scale = _mm512_permutexvar_ps(idx, s4);
  }
};

}  // namespace seamline_quant
