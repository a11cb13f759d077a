// AVX-512 kernels over GGUF blocks, read as they lie in the file. As llama.cpp does, the
// activations are first rounded to int8: per 32-wide block with a float scale for the 32-wide
// types (whose pairs of blocks are multiplied with vpdpbusd, block scales applied in float),
// per 256 for K-quants (integer dot per super-block, see dot_super). Prefill instead
// dequantises to bfloat16 (dequant_rows_bf16) for torch's GEMM.
// Only this file is compiled for AVX-512; callers check cpu_supported() first.
#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
SEAMLINE_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,avx2,bmi2")
#include "blocks.h"

namespace seamline_quant {

bool cpu_supported() {
  __builtin_cpu_init();
#if SEAMLINE_AVX2
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi2");
#else
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#endif
}

int64_t padded_cols(int64_t cols) { return (cols + 63) / 64 * 64; }

// 16 activations as float from f32 / bf16 / f16 storage
static inline __m512 load16(const void* x, int dt, int64_t i) {
  if (dt == F32) return _mm512_loadu_ps((const float*)x + i);
  __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
  if (dt == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One activation row: int8 blocks of 32 with one float scale each, lane sums in aux.
static void prep_row(const void* x, int dt, int64_t cols, int offset, bool min, int8_t* xq,
                     float* xs, float* aux, float* blk, int64_t kp) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < cols / 32; ++b) {
    __m512 v0 = load16(x, dt, 32 * b), v1 = load16(x, dt, 32 * b + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i*)(xq + 32 * b), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i*)(xq + 32 * b + 16), _mm512_cvtepi32_epi8(i1));
    _mm256_storeu_ps(xs + 8 * b, _mm256_set1_ps(d));
  }
  for (int64_t i = cols; i < kp; ++i) xq[i] = 0;  // a padded half pair multiplies as zero
  for (int64_t i = cols / 4; i < kp / 4; ++i) xs[i] = aux[i] = 0.0f;
  // lane sums of the quants: -offset * sum joins the integer dot; for a min, the sum of the
  // rounded x (not of x), so that the rounding errors of the q and min terms cancel
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t p = 0; p < kp / 64; ++p) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(xq + 64 * p));
    if (offset) _mm512_storeu_si512(aux + 16 * p, _mm512_mullo_epi32(s, _mm512_set1_epi32(-offset)));
    if (min) _mm512_storeu_ps(aux + 16 * p, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(xs + 16 * p)));
    for (int h = 0; h < 2; ++h) {  // per block: its scale and the sum of its rounded x
      blk[2 * p + h] = xs[16 * p + 8 * h];
      blk[kp / 32 + 2 * p + h] = xs[16 * p + 8 * h] * (float)_mm512_mask_reduce_add_epi32(h ? 0xFF00 : 0x00FF, s);
    }
  }
}

// One activation row for K-quants (llama.cpp's Q8_K): int8 blocks of 256 with one float scale
// each (xs[s]), and int16 sums of each 16 quants (aux as int16 [cols / 16]).
static void prep_row_k(const void* x, int dt, int64_t cols, int8_t* xq, float* xs, int16_t* bsum) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t s = 0; s < cols / 256; ++s) {
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, load16(x, dt, 256 * s + 16 * i)));
    const float m = _mm512_reduce_max_ps(amax), id = m > 0.0f ? 127.0f / m : 0.0f;
    xs[s] = m / 127.0f;
    for (int i = 0; i < 16; ++i) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, dt, 256 * s + 16 * i), _mm512_set1_ps(id)));
      _mm_storeu_si128((__m128i*)(xq + 256 * s + 16 * i), _mm512_cvtepi32_epi8(q));
      bsum[16 * s + i] = (int16_t)_mm512_reduce_add_epi32(q);
    }
  }
}

template <class D, int MB>
static inline void step(const Pair& P, const XBuf& x, int64_t m0, int64_t p, __m512* acc) {
  for (int j = 0; j < MB; ++j) {
    const int64_t m = m0 + j, lane = m * (x.kp / 4) + 16 * p;
    __m512i xq = _mm512_loadu_si512(x.xq + m * x.kp + 64 * p);
    __m512i init = D::OFFSET ? _mm512_loadu_si512(x.aux + lane) : _mm512_setzero_si512();
    __m512i dot = _mm512_dpbusd_epi32(init, P.q, xq);
    __m512 scale = _mm512_mul_ps(P.scale, _mm512_loadu_ps(x.xs + lane));
    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[j]);
    if constexpr (D::MIN) acc[j] = _mm512_fmadd_ps(P.minv, _mm512_loadu_ps(x.aux + lane), acc[j]);
  }
}

// Types with a min: groups of 16 blocks (8 pairs) of RB rows, their fp16 scales and mins gathered
// once per group, scales folded with the activation block scales, the min terms one multiply-add
// per group (measured +15..26% for Q4_1 / Q5_1; no gain for the others, which skip it).
// Returns the pairs done; the rest go pair by pair.
template <class D, int RB, int MB>
static inline int64_t dot_groups(const uint8_t* const* rows, int64_t cols, const XBuf& x, int64_t m0,
                                 __m512 (*acc)[MB], int64_t ahead) {
  const int64_t groups = D::MIN ? cols / 512 : 0, bs = x.kp / 16;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i offs = _mm512_mullo_epi32(iota, _mm512_set1_epi32(D::BYTES));
  const __m512i pair01 = _mm512_srli_epi32(iota, 3);  // [0 x8, 1 x8]
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < RB; ++r) {
      const uint8_t* base = rows[r] + g * 16 * D::BYTES;
      const __m512i dm = _mm512_i32gather_epi32(offs, (const void*)base, 1);  // d | m << 16
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      __m512 dx[MB];
      for (int i = 0; i < MB; ++i) dx[i] = _mm512_mul_ps(d, _mm512_loadu_ps(x.blk + (m0 + i) * bs + 16 * g));
      if constexpr (D::MIN) {
        const __m512 mn = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
        for (int i = 0; i < MB; ++i)
          acc[r][i] = _mm512_fmadd_ps(mn, _mm512_loadu_ps(x.blk + (m0 + i) * bs + x.kp / 32 + 16 * g), acc[r][i]);
      }
      for (int j = 0; j < 8; ++j) {
        const int64_t p = 8 * g + j;
        _mm_prefetch((const char*)(base + 2 * j * D::BYTES + ahead), _MM_HINT_T0);
        const __m512i q = D::quants(base + 2 * j * D::BYTES);
        const __m512i idx = _mm512_add_epi32(pair01, _mm512_set1_epi32(2 * j));
        for (int i = 0; i < MB; ++i) {
          const int64_t m = m0 + i;
          const __m512i xq = _mm512_loadu_si512(x.xq + m * x.kp + 64 * p);
          const __m512i init = D::OFFSET ? _mm512_loadu_si512(x.aux + m * (x.kp / 4) + 16 * p) : _mm512_setzero_si512();
          const __m512i dot = _mm512_dpbusd_epi32(init, q, xq);
          acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, dx[i]), acc[r][i]);
        }
      }
    }
  }
  return groups * 8;
}

// RB weight rows against MB activation rows [m0, m0 + MB): res[r * MB + i] = x[m0 + i] . row r.
// Several weight rows per pass share the activation loads (decode: M = 1).
template <class D, int RB, int MB>
static void dot_pairs(const uint8_t* const* rows, int64_t cols, const XBuf& x, int64_t m0, float* res, int64_t ahead) {
  __m512 acc[RB][MB];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t units = cols / 64;
  const NoHead none(nullptr);
  Pair P;
  for (int64_t u = dot_groups<D, RB, MB>(rows, cols, x, m0, acc, ahead); u < units; ++u) {
    for (int r = 0; r < RB; ++r) {
      _mm_prefetch((const char*)(rows[r] + u * 2 * D::BYTES + ahead), _MM_HINT_T0);
      D::decode(rows[r] + u * 2 * D::BYTES, none, 0, P);
      step<D, MB>(P, x, m0, u, acc[r]);
    }
  }
  if (cols % 64) {  // an odd last block: decode it with a zero partner
    for (int r = 0; r < RB; ++r) {
      uint8_t tmp[2 * D::BYTES] = {0};
      std::memcpy(tmp, rows[r] + units * 2 * D::BYTES, D::BYTES);
      D::decode(tmp, none, 0, P);
      step<D, MB>(P, x, m0, units, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < MB; ++i) res[r * MB + i] = _mm512_reduce_add_ps(acc[r][i]);
}

// K-quants: integer dot per super-block (maddubs, then madd with the 6/8-bit sub-block scales),
// one float multiply-add per super-block, as llama.cpp's q*_K x Q8_K dot products do
template <class D, int RB, int MB>
static void dot_super(const uint8_t* const* rows, int64_t cols, const XBuf& x, int64_t m0, float* res, int64_t ahead) {
  __m512 acc[RB][MB];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t s = 0; s < cols / 256; ++s) {
    for (int r = 0; r < RB; ++r) {
      const uint8_t* sb = rows[r] + s * D::BYTES;
      for (int c = 0; c < D::BYTES; c += 64) _mm_prefetch((const char*)(sb + ahead + c), _MM_HINT_T0);
      const typename D::IHead h(sb);
      __m512i ai[MB];
      for (int i = 0; i < MB; ++i) ai[i] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i q = D::quants(sb, j), sc = h.scales(j);
        for (int i = 0; i < MB; ++i) {
          const __m512i xq = _mm512_loadu_si512(x.xq + (m0 + i) * x.kp + 256 * s + 64 * j);
          ai[i] = _mm512_add_epi32(ai[i], _mm512_madd_epi16(_mm512_maddubs_epi16(q, xq), sc));
        }
      }
      for (int i = 0; i < MB; ++i) {
        const int64_t m = m0 + i;
        const __m256i bsum = _mm256_loadu_si256((const __m256i*)((const int16_t*)(x.aux + m * (x.kp / 4)) + 16 * s));
        h.finish(ai[i], bsum, x.xs[m * (x.kp / 4) + s], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < MB; ++i) res[r * MB + i] = _mm512_reduce_add_ps(acc[r][i]);
}

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192  // read weights this far ahead (whole rows): faster than the hardware prefetcher alone
#endif

// weight rows [r, r + RB) x activation rows [m0, m0 + MB) -> out (+ bias)
template <class D, int RB, int MB>
static inline void tile(const uint8_t* w, int64_t w_stride, int64_t cols, const XBuf& x, int64_t m0, int64_t r,
                        const float* bias, void* out, int dt, int64_t n_out) {
  const uint8_t* rows[RB];
  for (int k = 0; k < RB; ++k) rows[k] = w + (r + k) * w_stride;
  float res[RB * MB];
  const int64_t ahead = (PREFETCH_BYTES + w_stride - 1) / w_stride * w_stride;
  if constexpr (D::PAIRS == 4) {
    dot_super<D, RB, MB>(rows, cols, x, m0, res, ahead);
  } else {
    dot_pairs<D, RB, MB>(rows, cols, x, m0, res, ahead);
  }
  for (int k = 0; k < RB; ++k) {
    const float b = bias ? bias[r + k] : 0.0f;
    for (int i = 0; i < MB; ++i) store1(out, dt, (m0 + i) * n_out + r + k, res[k * MB + i] + b);
  }
}

template <class D>
static void gemv_t(const uint8_t* w, int64_t w_stride, int64_t cols, const XBuf& x, int64_t rows_x,
                   int64_t r0, int64_t r1, const float* bias, void* out, int dt, int64_t n_out) {
  int64_t r = r0;
  if (rows_x == 1) {  // decode: two weight rows per pass (four measured no faster)
    for (; r + 2 <= r1; r += 2) tile<D, 2, 1>(w, w_stride, cols, x, 0, r, bias, out, dt, n_out);
  }
  for (; r < r1; ++r) {  // a weight row decoded once for up to 8 activation rows (a window's)
    int64_t m = 0;
    for (; m + 8 <= rows_x; m += 8) tile<D, 1, 8>(w, w_stride, cols, x, m, r, bias, out, dt, n_out);
    switch (rows_x - m) {
      case 7: tile<D, 1, 7>(w, w_stride, cols, x, m, r, bias, out, dt, n_out); break;
      case 6: tile<D, 1, 6>(w, w_stride, cols, x, m, r, bias, out, dt, n_out); break;
      case 5: tile<D, 1, 5>(w, w_stride, cols, x, m, r, bias, out, dt, n_out); break;
      case 4: tile<D, 1, 4>(w, w_stride, cols, x, m, r, bias, out, dt, n_out); break;
      case 3: tile<D, 1, 3>(w, w_stride, cols, x, m, r, bias, out, dt, n_out); break;
      case 2: tile<D, 1, 2>(w, w_stride, cols, x, m, r, bias, out, dt, n_out); break;
      case 1: tile<D, 1, 1>(w, w_stride, cols, x, m, r, bias, out, dt, n_out); break;
      default: break;
    }
  }
}

// chunk C of a pair rounded to bfloat16 (nearest even) by integer arithmetic
template <class D, int C>
static inline void chunk_bf16(const Pair& P, uint16_t* dst) {
  __m512i u = _mm512_castps_si512(chunk_f32<D, C>(P));
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256((__m256i*)(dst + 16 * C), _mm512_cvtepi32_epi16(u));
}

template <class D>
static inline void pair_bf16(const Pair& P, uint16_t* dst, bool full) {
  chunk_bf16<D, 0>(P, dst);
  chunk_bf16<D, 1>(P, dst);
  if (!full) return;  // the odd last block of a row
  chunk_bf16<D, 2>(P, dst);
  chunk_bf16<D, 3>(P, dst);
}

template <class D>
static void dequant_t(const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0, int64_t r1, uint16_t* out) {
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* dst = out + r * cols;
    for_pairs<D>(w + r * w_stride, cols, [&](int64_t p, const Pair& P) {
      pair_bf16<D>(P, dst + 64 * p, 64 * p + 64 <= cols);
    });
  }
}

bool qtype_supported(int qtype) {
  bool ok = false;
#define SEAMLINE_OK(D) ok = true
  SEAMLINE_DISPATCH(qtype, SEAMLINE_OK)
  return ok;
}

int64_t row_bytes(int qtype, int64_t cols) {
  int64_t bytes = -1;
#define SEAMLINE_BYTES(D) bytes = cols % D::BLOCK ? -1 : cols / D::BLOCK * D::BYTES
  SEAMLINE_DISPATCH(qtype, SEAMLINE_BYTES)
  return bytes;
}

void prep_x(int qtype, const void* x, int dt, int64_t x_stride, int64_t cols, int64_t m0, int64_t m1,
            const XBuf& buf) {
  const int elem = dt == F32 ? 4 : 2;
  for (int64_t m = m0; m < m1; ++m) {
    const void* xr = (const char*)x + m * x_stride * elem;
    int8_t* xq = buf.xq + m * buf.kp;
    float* xs = buf.xs + m * (buf.kp / 4);
    float* aux = buf.aux + m * (buf.kp / 4);
    float* blk = buf.blk + m * (buf.kp / 16);
#define SEAMLINE_PREP(D)                                         \
  if (D::PAIRS == 4) prep_row_k(xr, dt, cols, xq, xs, (int16_t*)aux); \
  else prep_row(xr, dt, cols, D::OFFSET, D::MIN, xq, xs, aux, blk, buf.kp)
    SEAMLINE_DISPATCH(qtype, SEAMLINE_PREP)
  }
}

void gemv_rows(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, const XBuf& buf, int64_t rows_x,
               int64_t r0, int64_t r1, const float* bias, void* out, int dt, int64_t n_out) {
#define SEAMLINE_GEMV(D) gemv_t<D>(w, w_stride, cols, buf, rows_x, r0, r1, bias, out, dt, n_out)
  SEAMLINE_DISPATCH(qtype, SEAMLINE_GEMV)
}

template <class D>
static void dequant_f32_t(const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    float* dst = out + r * cols;
    for_pairs<D>(w + r * w_stride, cols, [&](int64_t p, const Pair& P) {
      _mm512_storeu_ps(dst + 64 * p, chunk_f32<D, 0>(P));
      _mm512_storeu_ps(dst + 64 * p + 16, chunk_f32<D, 1>(P));
      if (64 * p + 64 > cols) return;  // the odd last block of a row
      _mm512_storeu_ps(dst + 64 * p + 32, chunk_f32<D, 2>(P));
      _mm512_storeu_ps(dst + 64 * p + 48, chunk_f32<D, 3>(P));
    });
  }
}

void dequant_rows_f32(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0, int64_t r1,
                      float* out) {
#define SEAMLINE_DEQ_F32(D) dequant_f32_t<D>(w, w_stride, cols, r0, r1, out)
  SEAMLINE_DISPATCH(qtype, SEAMLINE_DEQ_F32)
}

void dequant_rows_bf16(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0, int64_t r1,
                       uint16_t* out, bool native) {
  static const bool has_bf16 = cpu_has_bf16();
  if (native && has_bf16) return dequant_rows_bf16_native(qtype, w, w_stride, cols, r0, r1, out);
#define SEAMLINE_DEQ(D) dequant_t<D>(w, w_stride, cols, r0, r1, out)
  SEAMLINE_DISPATCH(qtype, SEAMLINE_DEQ)
}

}  // namespace seamline_quant

#else  // not x86-64: no kernels; Python takes the torch path

namespace seamline_quant {
bool cpu_supported() { return false; }
bool qtype_supported(int) { return false; }
int64_t row_bytes(int, int64_t) { return -1; }
int64_t padded_cols(int64_t cols) { return (cols + 63) / 64 * 64; }
void prep_x(int, const void*, int, int64_t, int64_t, int64_t, int64_t, const XBuf&) {}
void gemv_rows(int, const uint8_t*, int64_t, int64_t, const XBuf&, int64_t, int64_t, int64_t, const float*, void*,
               int, int64_t) {}
void dequant_rows_bf16(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*, bool) {}
void dequant_rows_f32(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*) {}
}  // namespace seamline_quant

#endif
