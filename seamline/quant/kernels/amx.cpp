// AMX int8 tiles for the 32-wide GGUF block types when many activation rows share a matmul
// (batched decode, prefill). Per 16 weight rows and 16 activation rows, each 32-wide block is
// one tile product (tdpbusd: the weights' unsigned quants times the activations' int8 blocks,
// 8192 multiply-adds in one instruction); its int32 result is scaled in float by the weight
// block's scale (and min) and the activation block's scale, as the AVX-512 kernel does with
// vpdpbusd, so both give the same sums up to float rounding order. Blocks go two at a time into
// alternating pairs of C tiles, so that a tile product never waits for the previous pair's
// store; the 16 x 16 results reach the output as vectors (one gather per activation row).
// Compiled for its own target; callers check amx_supported() first (the CPU has AMX-INT8 and
// the kernel lets this process use the tile registers).
#include "kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && !SEAMLINE_AVX2
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,avx2,bmi2,amx-tile,amx-int8")
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "blocks.h"
#include "store16.h"

namespace seamline_quant {

static bool amx_permitted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

bool amx_supported() {
  static const bool ok = cpu_supported() && amx_permitted();
  return ok;
}

bool amx_qtype(int qtype) { return qtype == 2 || qtype == 3 || qtype == 6 || qtype == 7 || qtype == 8; }

void amx_prep(const XBuf& buf, int64_t M, int64_t cols, int64_t g0, int64_t g1, const AmxX& x) {
  const int64_t nb = cols / 32, bs = buf.kp / 16;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = g * nb + b;
      uint32_t* tile = (uint32_t*)(x.tiles + at * 512);  // [8 rows][16 activation rows] of 4 bytes
      for (int n = 0; n < 16; ++n) {
        const int64_t m = 16 * g + n;
        const bool live = m < M;
        for (int k4 = 0; k4 < 8; ++k4) tile[k4 * 16 + n] = live ? ld32((const uint8_t*)buf.xq + m * buf.kp + 32 * b + 4 * k4) : 0;
        x.scale[at * 16 + n] = live ? buf.blk[m * bs + b] : 0.0f;
        x.sum[at * 16 + n] = live ? buf.blk[m * bs + buf.kp / 32 + b] : 0.0f;
      }
    }
  }
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 16 weight rows from `row0` (fewer when `rows` < 16: the rest zero) -> quants [16][cols],
// block scales and mins [blocks][16]
template <class D>
static void unpack16(const uint8_t* w, int64_t w_stride, int64_t cols, int rows, uint8_t* q, float* d, float* mn) {
  const int64_t nb = cols / 32;
  for (int k = 0; k < 16; ++k) {
    const uint8_t* row = w + k * w_stride;
    for (int64_t u = 0; u < nb / 2; ++u)
      _mm512_storeu_si512(q + k * cols + 64 * u, k < rows ? D::quants(row + u * 2 * D::BYTES) : _mm512_setzero_si512());
  }
  // each block's fp16 scale (and min: the next two bytes) of the 16 rows, gathered at once
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)w_stride));
  const __mmask16 live = (__mmask16)((1u << rows) - 1);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, w + b * D::BYTES, 1);
    _mm512_storeu_ps(d + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
    if constexpr (D::MIN) _mm512_storeu_ps(mn + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
  }
}

// Two consecutive blocks of one group: tile products into the C tiles C and C + 1 (A tiles 4/5,
// B tiles 6/7), stored to `c`, then scaled into the float accumulators `acc` (16 weight rows x
// 16 activation rows). Callers alternate C between 0 and 2, so that the next pair's products
// need not wait for this pair's stores.
// the tile intrinsics take their tile numbers as literals
#define AMX_PAIR(C0, C1, qb, cols, xt, c) \
  do {                                      \
    _tile_zero(C0);                         \
    _tile_zero(C1);                         \
    _tile_loadd(4, qb, cols);               \
    _tile_loadd(6, xt, 64);                 \
    _tile_dpbusd(C0, 4, 6);                 \
    _tile_loadd(5, (qb) + 32, cols);        \
    _tile_loadd(7, (xt) + 512, 64);         \
    _tile_dpbusd(C1, 5, 7);                 \
    _tile_stored(C0, c, 64);                \
    _tile_stored(C1, (c) + 256, 64);        \
  } while (0)

template <class D, int C>
static inline void amx_pair(const uint8_t* q, int64_t cols, const AmxX& x, int64_t at, int64_t b, const float* d,
                            const float* mn, int32_t* c, __m512* acc) {
  const int8_t* xt = x.tiles + at * 512;
  if constexpr (C == 0) {
    AMX_PAIR(0, 1, q + 32 * b, cols, xt, c);
  } else {
    AMX_PAIR(2, 3, q + 32 * b, cols, xt, c);
  }
  const __m512 offset = _mm512_set1_ps((float)D::OFFSET);
  for (int j = 0; j < 2; ++j) {
    const __m512 xs = _mm512_loadu_ps(x.scale + (at + j) * 16), sum = _mm512_loadu_ps(x.sum + (at + j) * 16);
    const __m512 shift = _mm512_mul_ps(offset, sum);  // OFFSET * xs * (sum of the block's xq)
    const float* dj = d + (b + j) * 16;
    const float* mj = mn + (b + j) * 16;
    for (int k = 0; k < 16; ++k) {
      const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * j + 16 * k)), xs, shift);
      acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(dj[k]), t, acc[k]);
      if constexpr (D::MIN) acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(mj[k]), sum, acc[k]);
    }
  }
}

// res [16 weight rows][16 activation rows] -> out rows m0.. (live of them), columns r..r + rows
static void store_tile(const float* res, int live, int rows, const float* bias, void* out, int dt, int64_t m0,
                       int64_t r, int64_t n_out) {
  const __mmask16 keep = (__mmask16)((1u << rows) - 1);
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + r) : _mm512_setzero_ps();
  const int64_t bytes = dt == F32 ? 4 : 2;
  for (int n = 0; n < live; ++n)
    store16((char*)out + ((m0 + n) * n_out + r) * bytes, dt, keep,
            _mm512_add_ps(_mm512_i32gather_ps(column, res + n, 4), b));
}

// The next 16 weight rows, fetched into L1 a share at a time while this tile's products run: the
// unpacking reads them in one burst, and the hardware prefetcher, which follows demand reads,
// has nothing to follow during the products, so unfetched they cost a stall per tile (in a
// model's step, its weights cold, about 40% of a 32-row matmul's time here)
class TileFetch {
 public:
  TileFetch(const uint8_t* next, int64_t bytes, int64_t steps)
      : at_((const char*)next), end_((const char*)next + bytes),
        per_step_(64 * ((bytes + 64 * steps - 1) / (64 * steps))) {}
  void step() {
    const char* stop = std::min(at_ + per_step_, end_);
    for (; at_ < stop; at_ += 64) _mm_prefetch(at_, _MM_HINT_T0);
  }

 private:
  const char* at_;
  const char* end_;
  int64_t per_step_;
};

template <class D>
static void amx_t(const uint8_t* w, int64_t w_stride, int64_t cols, const AmxX& x, int64_t M, int64_t r0, int64_t r1,
                  const float* bias, void* out, int dt, int64_t n_out) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // C: 16 weight rows x 16 int32 (activation rows)
  for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 32;  // A: 16 weight rows x one block of quants
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;   // B: a block's activations, 4 bytes x 16 rows
  _tile_loadconfig(&cfg);
  const int64_t nb = cols / 32, groups = (M + 15) / 16;  // nb even: cols is a multiple of 64
  thread_local std::vector<uint8_t> q;
  thread_local std::vector<float> d, mn;
  q.resize(16 * cols), d.resize(16 * nb), mn.resize(16 * nb);
  alignas(64) int32_t c[1024];
  alignas(64) float res[256];
  for (int64_t r = r0; r < r1; r += 16) {
    const int rows = (int)std::min<int64_t>(16, r1 - r);
    unpack16<D>(w + r * w_stride, w_stride, cols, rows, q.data(), d.data(), mn.data());
    TileFetch ahead(w + (r + 16) * w_stride, r + 16 < r1 ? std::min<int64_t>(16, r1 - r - 16) * w_stride : 0,
                    groups * ((nb + 3) / 4));
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc[16];
      for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
      int64_t b = 0;
      for (; b + 4 <= nb; b += 4) {
        ahead.step();
        amx_pair<D, 0>(q.data(), cols, x, g * nb + b, b, d.data(), mn.data(), c, acc);
        amx_pair<D, 2>(q.data(), cols, x, g * nb + b + 2, b + 2, d.data(), mn.data(), c + 512, acc);
      }
      if (b < nb) {
        ahead.step();
        amx_pair<D, 0>(q.data(), cols, x, g * nb + b, b, d.data(), mn.data(), c, acc);
      }
      for (int k = 0; k < 16; ++k) _mm512_store_ps(res + 16 * k, acc[k]);
      store_tile(res, (int)std::min<int64_t>(16, M - 16 * g), rows, bias, out, dt, 16 * g, r, n_out);
    }
  }
  _tile_release();
}

void amx_rows(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, const AmxX& x, int64_t M, int64_t r0,
              int64_t r1, const float* bias, void* out, int dt, int64_t n_out) {
  switch (qtype) {
    case 2: amx_t<DQ4_0>(w, w_stride, cols, x, M, r0, r1, bias, out, dt, n_out); break;
    case 3: amx_t<DQ4_1>(w, w_stride, cols, x, M, r0, r1, bias, out, dt, n_out); break;
    case 6: amx_t<DQ5_0>(w, w_stride, cols, x, M, r0, r1, bias, out, dt, n_out); break;
    case 7: amx_t<DQ5_1>(w, w_stride, cols, x, M, r0, r1, bias, out, dt, n_out); break;
    case 8: amx_t<DQ8_0>(w, w_stride, cols, x, M, r0, r1, bias, out, dt, n_out); break;
    default: break;
  }
}

}  // namespace seamline_quant

#else

namespace seamline_quant {
bool amx_supported() { return false; }
bool amx_qtype(int) { return false; }
void amx_prep(const XBuf&, int64_t, int64_t, int64_t, int64_t, const AmxX&) {}
void amx_rows(int, const uint8_t*, int64_t, int64_t, const AmxX&, int64_t, int64_t, int64_t, const float*, void*, int,
              int64_t) {}
}  // namespace seamline_quant

#endif
