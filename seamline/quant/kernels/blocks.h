// GGUF block decoders for AVX-512: each turns 64 weights (a "pair": two 32-wide blocks or two
// sub-blocks) into one register of unsigned 8-bit quants plus per-lane float scales and mins.
// A lane is 4 consecutive weights (what one vpdpbusd int32 lane sums), so the weight at
// element e is  (q[e] - OFFSET) * scale[e / 4] + minv[e / 4].
// A "unit" is what a type's header covers: one pair for 32-wide types, a 256-wide super-block
// (4 pairs) for K-quants; Head decodes a unit's shared scales once.
// Included only from kernels.cpp, after its AVX-512 target pragma.
#pragma once

#include "intrinsics.h"
#include <cstdint>
#include <cstring>

namespace seamline_quant {
namespace {  // internal linkage: each kernel file compiles these for its own target

struct Pair {
  __m512i q;      // 64 unsigned quants, element order
  __m512 scale;   // per 4-element lane
  __m512 minv;    // per 4-element lane (unused by types without a min)
};

// one output value as float32, float16 or bfloat16 (round to nearest even)
static inline void store1(void* out, int dt, int64_t i, float v) {
  if (dt == F32) {
    ((float*)out)[i] = v;
  } else if (dt == F16) {
    ((uint16_t*)out)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
  } else {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    ((uint16_t*)out)[i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
}

static inline uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// fp16 fields at 16-bit word offsets A (first block) and B (second) of a unit -> [A x8, B x8]
template <int A, int B>
static inline __m512 halves(const uint8_t* p) {
#if SEAMLINE_AVX2  // no cross-lane word permute there: two scalar loads
  return sl_halves(p + 2 * A, p + 2 * B);
#endif
  const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       B, B, B, B, B, B, B, B, A, A, A, A, A, A, A, A);
  if constexpr (B < 16) {  // within the unit's first 32 bytes
    __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_cvtph_ps(_mm256_permutexvar_epi16(_mm512_castsi512_si256(idx), raw));
  } else {
    __m512i raw = _mm512_loadu_si512((const void*)p);
    return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, raw)));
  }
}

// two blocks of 16 packed bytes -> [lo(a), hi(a), lo(c), hi(c)] nibbles (GGUF's 32-block order)
static inline __m512i nib_pair(const uint8_t* a, const uint8_t* c) {
  __m512i va = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)a));
  __m512i vc = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)c));
  __m512i v = _mm512_mask_blend_epi64(0xF0, va, vc);
  v = _mm512_mask_srli_epi16(v, 0xFF00FF00u, v, 4);
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

// 32 packed bytes -> [lo x32, hi x32] (K-quant sub-blocks 2j and 2j+1)
static inline __m512i nib_k(const uint8_t* p) {
  __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
  v = _mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4);
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

// add bit 4 where the 64-bit mask says so (the fifth bit of Q5 types)
static inline __m512i add_hi(__m512i q, uint64_t k) {
  return _mm512_or_si512(q, _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(0x10)));
}

struct NoHead {
  explicit NoHead(const uint8_t*) {}
};

// 32-wide block types: a unit is two consecutive blocks; every block starts with its fp16
// scale d, and the types with a min keep it right after (the grouped path gathers both)
struct DQ4_0 {
  static constexpr int BLOCK = 32, BYTES = 18, OFFSET = 8, PAIRS = 1;
  static constexpr bool MIN = false;
  using Head = NoHead;
  static inline void decode(const uint8_t* p, const Head&, int, Pair& o) {
    o.q = quants(p);
    o.scale = halves<0, 9>(p);
  }
  static inline __m512i quants(const uint8_t* p) { return nib_pair(p + 2, p + 20); }
};

struct DQ4_1 {
  static constexpr int BLOCK = 32, BYTES = 20, OFFSET = 0, PAIRS = 1;
  static constexpr bool MIN = true;
  using Head = NoHead;
  static inline void decode(const uint8_t* p, const Head&, int, Pair& o) {
    o.q = quants(p);
    o.scale = halves<0, 10>(p);
    o.minv = halves<1, 11>(p);
  }
  static inline __m512i quants(const uint8_t* p) { return nib_pair(p + 4, p + 24); }
};

struct DQ5_0 {
  static constexpr int BLOCK = 32, BYTES = 22, OFFSET = 16, PAIRS = 1;
  static constexpr bool MIN = false;
  using Head = NoHead;
  static inline void decode(const uint8_t* p, const Head&, int, Pair& o) {
    o.q = quants(p);
    o.scale = halves<0, 11>(p);
  }
  static inline __m512i quants(const uint8_t* p) {
    return add_hi(nib_pair(p + 6, p + 28), ld32(p + 2) | (uint64_t)ld32(p + 24) << 32);
  }
};

struct DQ5_1 {
  static constexpr int BLOCK = 32, BYTES = 24, OFFSET = 0, PAIRS = 1;
  static constexpr bool MIN = true;
  using Head = NoHead;
  static inline void decode(const uint8_t* p, const Head&, int, Pair& o) {
    o.q = quants(p);
    o.scale = halves<0, 12>(p);
    o.minv = halves<1, 13>(p);
  }
  static inline __m512i quants(const uint8_t* p) {
    return add_hi(nib_pair(p + 8, p + 32), ld32(p + 4) | (uint64_t)ld32(p + 28) << 32);
  }
};

struct DQ8_0 {
  static constexpr int BLOCK = 32, BYTES = 34, OFFSET = 128, PAIRS = 1;
  static constexpr bool MIN = false;
  using Head = NoHead;
  static inline void decode(const uint8_t* p, const Head&, int, Pair& o) {
    o.q = quants(p);
    o.scale = halves<0, 17>(p);
  }
  static inline __m512i quants(const uint8_t* p) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(p + 2));
    __m256i c = _mm256_loadu_si256((const __m256i*)(p + 36));
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
    return _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80));  // signed -> unsigned + 128
  }
};

// Q4_K/Q5_K 12 bytes of 6-bit scales and mins -> u8 [sc0..sc7, m0..m7] (gguf-py's get_scale_min)
static inline __m128i scale_min_k4(const uint8_t* packed) {
  // 32-bit lanes L0 = bytes 0..3, L1 = 4..7, L2 = 8..11 (16 bytes read: packed is inside a super-block)
  const __m128i v = _mm_loadu_si128((const __m128i*)packed);
  const __m128i x = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // [L0, L2, L1, L2]
  const __m128i y = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // [L0, L0, L1, L1]
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(x, _mm_set_epi32(4, 0, 0, 0)),
                                   _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(y, 2), _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
  return _mm_or_si128(lo, hi);  // [sc0..3, sc4..7, m0..3, m4..7]
}

// float header (dequantisation): lanes 0..7 d * sc[j], lanes 8..15 -(dmin * m[j])
struct KHead {
  __m512 v;
  explicit KHead(const uint8_t* sb) {
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scale_min_k4(sb + 4)));
    __m512 dd = _mm512_cvtph_ps(_mm256_permutexvar_epi16(_mm256_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                                         _mm256_castsi128_si256(_mm_cvtsi32_si128((int)ld32(sb)))));
    const __m512 prod = _mm512_mul_ps(dd, f);
    v = _mm512_mask_sub_ps(prod, 0xFF00, _mm512_setzero_ps(), prod);
  }
  inline void pair(int j, Pair& o) const {
    const __m512i s = _mm512_set1_epi32(2 * j), one = _mm512_set1_epi32(1), eight = _mm512_set1_epi32(8);
    __m512i idx = _mm512_mask_add_epi32(s, 0xFF00, s, one);  // [2j x8, 2j+1 x8]
    o.scale = _mm512_permutexvar_ps(idx, v);
    o.minv = _mm512_permutexvar_ps(_mm512_add_epi32(idx, eight), v);
  }
};

// integer header (fused matmul): 6-bit scales as int16 per pair, mins per 16 elements
struct KIntHead {
  __m512i w;      // words 0..7: sc[j]; 8..15: m[j]
  __m256i mins;   // [m0, m0, m1, m1, ..., m7, m7]: one per 16 elements
  __m512 d, neg_dmin;
  explicit KIntHead(const uint8_t* sb) {
    const __m256i w16 = _mm256_cvtepu8_epi16(scale_min_k4(sb + 4));
    w = _mm512_castsi256_si512(w16);
    mins = _mm256_permutexvar_epi16(_mm256_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), w16);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)ld32(sb)));  // [d, dmin, 0, 0]
    d = _mm512_broadcastss_ps(dd);
    neg_dmin = _mm512_broadcastss_ps(_mm_sub_ps(_mm_setzero_ps(), _mm_movehdup_ps(dd)));
  }
  inline __m512i scales(int j) const {  // [sc_2j x16 words, sc_2j+1 x16 words]
#if SEAMLINE_AVX2
    return sl_word_pair(w, j);
#endif
    const __m512i base = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 1);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(base, _mm512_set1_epi16((short)(2 * j))), w);
  }
  // acc += d*dx * sum(ai) - dmin*dx * sum_j m_j * (sum of x quants in sub-block j)
  inline void finish(__m512i ai, __m256i bsum16, float dx, __m512& acc) const {
    const __m512 vdx = _mm512_set1_ps(dx);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai), _mm512_mul_ps(d, vdx), acc);
    const __m256i md = _mm256_madd_epi16(mins, bsum16);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(md)), _mm512_mul_ps(neg_dmin, vdx), acc);
  }
};

struct DQ4_K {
  static constexpr int BLOCK = 256, BYTES = 144, OFFSET = 0, PAIRS = 4;
  static constexpr bool MIN = true;
  using Head = KHead;
  using IHead = KIntHead;
  static inline __m512i quants(const uint8_t* sb, int j) { return nib_k(sb + 16 + 32 * j); }
  static inline void decode(const uint8_t* sb, const Head& h, int j, Pair& o) {
    o.q = quants(sb, j);
    h.pair(j, o);
  }
};

struct DQ5_K {
  static constexpr int BLOCK = 256, BYTES = 176, OFFSET = 0, PAIRS = 4;
  static constexpr bool MIN = true;
  using Head = KHead;
  using IHead = KIntHead;
  static inline void decode(const uint8_t* sb, const Head& h, int j, Pair& o) {
    o.q = quants(sb, j);
    h.pair(j, o);
  }
  static inline __m512i quants(const uint8_t* sb, int j) {
    // bit 2j of qh[l] is the fifth bit of sub-block 2j's element l; bit 2j+1 of sub-block 2j+1's
    __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(sb + 16)));
    qh = _mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * j));
    qh = _mm512_mask_srli_epi16(qh, 0xFFFF0000u, qh, 1);
    return _mm512_ternarylogic_epi32(nib_k(sb + 48 + 32 * j), _mm512_slli_epi16(qh, 4), _mm512_set1_epi8(0x10), 0xF8);
  }
};

// Q6_K super-block header: the 16 sub-block scales d * sc (16 elements each) as floats
struct Q6Head {
  __m512 v;
  explicit Q6Head(const uint8_t* sb) {
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sb + 192))));
    uint16_t h;
    std::memcpy(&h, sb + 208, 2);
    v = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(h)), sc);
  }
};

// integer header (fused matmul): the 16 int8 scales as int16; quants carry an offset of 32
struct Q6IntHead {
  __m512i w;  // words 0..15: sc[g]
  float d;
  explicit Q6IntHead(const uint8_t* sb) {
    w = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(sb + 192))));
    uint16_t h;
    std::memcpy(&h, sb + 208, 2);
    d = _cvtsh_ss(h);
  }
  inline __m512i scales(int j) const {  // [sc_4j x8, sc_4j+1 x8, sc_4j+2 x8, sc_4j+3 x8] words
#if SEAMLINE_AVX2
    return sl_spread_words(w, 2 * j, 2 * j + 1);
#endif
    const __m512i base = _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                            15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(base, _mm512_set1_epi16((short)(4 * j))), w);
  }
  // acc += d*dx * (sum(ai) - 32 * sum_g sc_g * (sum of x quants in group g))
  inline void finish(__m512i ai, __m256i bsum16, float dx, __m512& acc) const {
    const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(_mm512_castsi512_si256(w), bsum16), 5);
    ai = _mm512_sub_epi32(ai, _mm512_zextsi256_si512(corr));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai), _mm512_set1_ps(d * dx), acc);
  }
};

struct DQ6_K {
  static constexpr int BLOCK = 256, BYTES = 210, OFFSET = 32, PAIRS = 4;
  static constexpr bool MIN = false;
  using Head = Q6Head;
  using IHead = Q6IntHead;
  static inline void decode(const uint8_t* sb, const Head& hd, int j, Pair& o) {
    o.q = quants(sb, j);
    const __m512i base = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
    o.scale = _mm512_permutexvar_ps(_mm512_add_epi32(base, _mm512_set1_epi32(4 * j)), hd.v);
  }
  // pair j = elements 64j..64j+63: nibble s = j & 1 of ql[64h..], qh bits 4s (first 32) / 4s+2 (last 32)
  static inline __m512i quants(const uint8_t* sb, int j) {
    const int h = j >> 1, s = j & 1;
    __m512i ql = _mm512_loadu_si512((const void*)(sb + 64 * h));
    ql = _mm512_srl_epi16(ql, _mm_cvtsi32_si128(4 * s));
    __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(sb + 128 + 32 * h)));
    qh = _mm512_srl_epi16(qh, _mm_cvtsi32_si128(4 * s));
    qh = _mm512_slli_epi16(_mm512_mask_srli_epi16(qh, 0xFFFF0000u, qh, 2), 4);
    // 0x0F ? ql : qh bitwise, then the 6 bits: (ql & 0x0F) | (qh & 0x30)
    return _mm512_and_si512(_mm512_ternarylogic_epi32(ql, qh, _mm512_set1_epi8(0x0F), 0xE4), _mm512_set1_epi8(0x3F));
  }
};

// hands every pair p of a row, decoded, to f(p, P); an odd last 32-wide block gets a zero partner
template <class D, class F>
inline void for_pairs(const uint8_t* row, int64_t cols, F&& f) {
  constexpr int64_t unit_bytes = D::PAIRS == 1 ? 2 * D::BYTES : D::BYTES;
  const int64_t units = cols / (64 * D::PAIRS);
  Pair P;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* up = row + u * unit_bytes;
    const typename D::Head head(up);
    for (int j = 0; j < D::PAIRS; ++j) {
      D::decode(up, head, j, P);
      f(u * D::PAIRS + j, P);
    }
  }
  if (D::PAIRS == 1 && cols % 64) {
    uint8_t tmp[2 * D::BYTES] = {0};
    std::memcpy(tmp, row + units * unit_bytes, D::BYTES);
    const typename D::Head head(tmp);
    D::decode(tmp, head, 0, P);
    f(units, P);
  }
}

// weights of chunk C (elements 16C..16C+15, lanes 4C..4C+3) of a pair as floats, with
// gguf-py's rounding steps: (q - OFFSET) * scale (+ min)
template <class D, int C>
inline __m512 chunk_f32(const Pair& P) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(P.q, C));
  const __m512i idx = _mm512_set_epi32(4 * C + 3, 4 * C + 3, 4 * C + 3, 4 * C + 3, 4 * C + 2, 4 * C + 2, 4 * C + 2,
                                       4 * C + 2, 4 * C + 1, 4 * C + 1, 4 * C + 1, 4 * C + 1, 4 * C, 4 * C, 4 * C, 4 * C);
  __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(D::OFFSET)));
  f = _mm512_mul_ps(f, _mm512_permutexvar_ps(idx, P.scale));
  if constexpr (D::MIN) f = _mm512_add_ps(f, _mm512_permutexvar_ps(idx, P.minv));
  return f;
}

}  // namespace
}  // namespace seamline_quant

#define SEAMLINE_DISPATCH(qtype, CALL) \
  switch (qtype) {                     \
    case 2: CALL(DQ4_0); break;        \
    case 3: CALL(DQ4_1); break;        \
    case 6: CALL(DQ5_0); break;        \
    case 7: CALL(DQ5_1); break;        \
    case 8: CALL(DQ8_0); break;        \
    case 12: CALL(DQ4_K); break;       \
    case 13: CALL(DQ5_K); break;       \
    case 14: CALL(DQ6_K); break;       \
    default: break;                    \
  }
