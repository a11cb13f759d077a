// Fused ops for the small steps of a layer, where at one token torch's dispatch (and its slow
// bfloat16 rms_norm: ~30 us for 576 values here), not the arithmetic, sets the speed:
//   decode_attention: RoPE on the new query and key heads, the key and value written into the
//     sequence's cache, attention of each query head over the cached positions [0, pos]
//     (~35 eager ops a layer);
//   rms_norm, add_rms_norm (the residual add and the next norm), silu_mul (SwiGLU's gate).
// Everything is computed in float32 and rounded once to the activations' dtype.
// Registered as torch.ops.seamline_quant.*.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
SEAMLINE_TARGET("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")
#include "intrinsics.h"

#include "store16.h"

namespace seamline_quant {
namespace {

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

// up to 16 elements of a row (mask: which) as float
inline __m512 load(const void* p, int dt, __mmask16 m) {
  if (dt == F32) return _mm512_maskz_loadu_ps(m, p);
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if (dt == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch rounds
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;  // NaN
  return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline void store(void* p, int64_t i, int dt, float f) {
  if (dt == F32) ((float*)p)[i] = f;
  else if (dt == BF16) ((uint16_t*)p)[i] = to_bf16(f);
  else ((at::Half*)p)[i] = at::Half(f);
}

inline float element(const void* p, int64_t i, int dt) {
  if (dt == F32) return ((const float*)p)[i];
  if (dt == BF16) return at::BFloat16(((const uint16_t*)p)[i], at::BFloat16::from_bits());
  return ((const at::Half*)p)[i];
}

// head [D] of x rotated in the half-split layout (x * cos + rotate_half(x) * sin), as float
void rope_head(const void* x, int64_t offset, int dt, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rotated = d < half ? -element(x, offset + d + half, dt) : element(x, offset + d - half, dt);
    out[d] = element(x, offset + d, dt) * cos[d] + rotated * sin[d];
  }
}

inline float dot(const float* q, const void* k, int dt, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = tail_mask(D - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), load((const char*)k + d * (dt == F32 ? 4 : 2), dt, m), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// exp(x) = 2^n * 2^f, |f| <= 1/2: 2^f = e^(f ln 2) by its Taylor series to degree 7 (relative
// error < 1e-8 before float rounding), 2^n by scalef; x clamped so that inf and -inf stay finite
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(100.f)), _mm512_set1_ps(-100.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// A row's cache is read once a step, from memory: a step's caches are far larger than the CPU's
// (32 rows x 30 layers of the embedded model 160 positions deep: 118 MB), and a head's keys are a
// few KB, too short a stream for the hardware prefetcher to reach speed. So the keys are fetched
// AHEAD_ROWS positions ahead of the scores, the values into L2 beside them for after the softmax.
// Measured here on one core (those 118 MB): 26 -> 22 us a row and layer; the embedded model's
// step of 32 rows 74.5 -> 70.1 ms, of 64 rows 126.6 -> 114.6 ms. 16 or 32 ahead were no faster.
constexpr int64_t AHEAD_ROWS = 8;

// row s + AHEAD_ROWS of a cache, every cache line of it, into L1 (T0) or L2 (T1)
template <auto HINT>
inline void fetch(const char* rows, int64_t s, int64_t n, int64_t row) {
  if (s + AHEAD_ROWS < n)
    for (int64_t b = 0; b < row; b += 64) _mm_prefetch(rows + (s + AHEAD_ROWS) * row + b, HINT);
}

inline void ahead(const char* K, const char* V, int64_t s, int64_t n, int64_t row) {
  fetch<_MM_HINT_T0>(K, s, n, row);
  fetch<_MM_HINT_T1>(V, s, n, row);
}

// out [D] = softmax(scale * q . K[s]) . V[s] over s in [0, n); K, V rows of D elements.
// The exponentials 16 at a time; for D a multiple of 16 up to 128 the weighted sum of V stays
// in registers and is divided by the total once.
void attend(const float* q, const void* K, const void* V, int dt, int64_t n, int64_t D, float scale, float* scores,
            float* out) {
  const int64_t row = D * (dt == F32 ? 4 : 2);
  float top = -INFINITY;
  for (int64_t s = 0; s < n; ++s) {
    ahead((const char*)K, (const char*)V, s, n, row);
    scores[s] = scale * dot(q, (const char*)K + s * row, dt, D);
    top = std::max(top, scores[s]);
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; s += 16) {
    const __mmask16 m = tail_mask(n - s);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + s), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(scores + s, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  const float inv = 1.f / _mm512_reduce_add_ps(sum);
  if (D % 16 == 0 && D <= 128) {
    __m512 acc[8];
    const int64_t chunks = D / 16;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; ++s) {
      const __m512 p = _mm512_set1_ps(scores[s]);
      const char* v = (const char*)V + s * row;
      for (int64_t c = 0; c < chunks; ++c)
        acc[c] = _mm512_fmadd_ps(p, load(v + 16 * c * (dt == F32 ? 4 : 2), dt, 0xFFFF), acc[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
    return;
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t s = 0; s < n; ++s) {
    const __m512 p = _mm512_set1_ps(scores[s] * inv);
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = tail_mask(D - d);
      const __m512 v = load((const char*)V + s * row + d * (dt == F32 ? 4 : 2), dt, m);
      _mm512_mask_storeu_ps(out + d, m, _mm512_fmadd_ps(p, v, _mm512_maskz_loadu_ps(m, out + d)));
    }
  }
}

int dtype_of(at::ScalarType t) {
  if (t == at::kFloat) return F32;
  if (t == at::kBFloat16) return BF16;
  TORCH_CHECK_VALUE(t == at::kHalf, "decode_attention takes float32, bfloat16 or float16, not ", t);
  return F16;
}

void check(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
           const at::Tensor& v_cache, int64_t pos, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK_VALUE(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == kv_heads,
                    "caches must both be [kv_heads, capacity, head_dim], got ", k_cache.sizes(), " and ",
                    v_cache.sizes());
  const int64_t D = k_cache.size(2);
  TORCH_CHECK_VALUE(D % 2 == 0 && pos >= 0 && pos < k_cache.size(1), "position ", pos, " is outside the cache of ",
                    k_cache.size(1), " (head_dim ", D, ")");
  TORCH_CHECK_VALUE(qkv.is_cpu() && qkv.is_contiguous() && qkv.numel() == (heads + 2 * kv_heads) * D,
                    "qkv must be one contiguous row of (heads + 2 * kv_heads) * head_dim, got ", qkv.sizes());
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type() &&
                        v_cache.scalar_type() == qkv.scalar_type(),
                    "caches must be contiguous and of the activations' dtype");
  TORCH_CHECK_VALUE(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) > pos && cos.size(1) == D &&
                        cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == sin.scalar_type(),
                    "cos and sin must be contiguous [positions > pos, head_dim] tables, got ", cos.sizes());
}

}  // namespace

namespace {

// One sequence's row: RoPE on its query and key heads, its key and value into its cache at pos,
// then attention of query heads [h0, h1) over positions [0, pos] into result [heads * D] (float)
// G query heads sharing one KV head (GQA), D = 16 * CH: each cached key and value row is loaded
// (and converted) once for all G heads, and the weighted sums of V stay in registers.
template <int CH, int G>
void attend_group_t(const float* q, const void* K, const void* V, int dt, int64_t n, float scale, float* scores,
                    float* out) {
  const int64_t elt = dt == F32 ? 4 : 2, row = 16 * CH * elt;
  __m512 qv[G][CH];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < CH; ++c) qv[j][c] = _mm512_loadu_ps(q + (16 * CH) * j + 16 * c);
  float top[G];
  for (int j = 0; j < G; ++j) top[j] = -INFINITY;
  for (int64_t s = 0; s < n; ++s) {
    ahead((const char*)K, (const char*)V, s, n, row);
    __m512 kr[CH];
    for (int c = 0; c < CH; ++c) kr[c] = load((const char*)K + s * row + 16 * c * elt, dt, 0xFFFF);
    for (int j = 0; j < G; ++j) {
      __m512 acc = _mm512_mul_ps(qv[j][0], kr[0]);
      for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(qv[j][c], kr[c], acc);
      const float score = scale * _mm512_reduce_add_ps(acc);
      scores[j * n + s] = score;
      top[j] = std::max(top[j], score);
    }
  }
  float inv[G];
  for (int j = 0; j < G; ++j) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s += 16) {
      const __mmask16 m = tail_mask(n - s);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j * n + s), _mm512_set1_ps(top[j])));
      _mm512_mask_storeu_ps(scores + j * n + s, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    inv[j] = 1.f / _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][CH];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < CH; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    fetch<_MM_HINT_T0>((const char*)V, s, n, row);
    __m512 vr[CH];
    for (int c = 0; c < CH; ++c) vr[c] = load((const char*)V + s * row + 16 * c * elt, dt, 0xFFFF);
    for (int j = 0; j < G; ++j) {
      const __m512 p = _mm512_set1_ps(scores[j * n + s]);
      for (int c = 0; c < CH; ++c) acc[j][c] = _mm512_fmadd_ps(p, vr[c], acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + (16 * CH) * j + 16 * c, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv[j])));
}

// the grouped kernel where one is built for (D, group); false: take the one-head path
bool attend_group(const float* q, const void* K, const void* V, int dt, int64_t n, int64_t D, float scale,
                  int64_t group, float* scores, float* out) {
#define SEAMLINE_GROUP(CH, G) \
  if (D == 16 * CH && group == G) return attend_group_t<CH, G>(q, K, V, dt, n, scale, scores, out), true;
  SEAMLINE_GROUP(4, 2) SEAMLINE_GROUP(4, 3) SEAMLINE_GROUP(4, 4) SEAMLINE_GROUP(8, 2) SEAMLINE_GROUP(8, 4)
#undef SEAMLINE_GROUP
  return false;
}

struct RowJob {
  const void* x;  // the row of qkv
  void* kc;
  void* vc;
  int64_t capacity, pos;
  int64_t first;  // the first position it attends to (a sliding window's; else 0)
};

// the first key a query at pos sees: within a sliding window of ``window`` keys (0: every key)
inline int64_t first_key(int64_t pos, int64_t window) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }

void rotate_and_store(const RowJob& job, const at::Tensor& cos, const at::Tensor& sin, int dt, int64_t heads,
                      int64_t kv_heads, int64_t D, float* q) {
  std::vector<float> c(D), s(D), k(D);
  for (int64_t d = 0; d < D; ++d) {
    c[d] = element(cos.data_ptr(), job.pos * D + d, dtype_of(cos.scalar_type()));
    s[d] = element(sin.data_ptr(), job.pos * D + d, dtype_of(sin.scalar_type()));
  }
  for (int64_t h = 0; h < heads; ++h) rope_head(job.x, h * D, dt, c.data(), s.data(), D, q + h * D);
  for (int64_t g = 0; g < kv_heads; ++g) {  // the new key (rotated) and value into the cache
    rope_head(job.x, (heads + g) * D, dt, c.data(), s.data(), D, k.data());
    const int64_t at_pos = (g * job.capacity + job.pos) * D;
    for (int64_t d = 0; d < D; ++d) {
      store(job.kc, at_pos + d, dt, k[d]);
      store(job.vc, at_pos + d, dt, element(job.x, (heads + kv_heads + g) * D + d, dt));
    }
  }
}

void attend_heads(const RowJob& job, const float* q, int dt, int64_t h0, int64_t h1, int64_t group, int64_t D,
                  float* result) {
  const int64_t n = job.pos + 1 - job.first, elt = dt == F32 ? 4 : 2;
  const float scale = 1.f / std::sqrt((float)D);
  std::vector<float> scores(n * group);
  for (int64_t h = h0; h < h1;) {
    const int64_t g = h / group, at = (g * job.capacity + job.first) * D * elt;
    const char *K = (const char*)job.kc + at, *V = (const char*)job.vc + at;
    if (h % group == 0 && h + group <= h1 && attend_group(q + h * D, K, V, dt, n, D, scale, group, scores.data(), result + h * D)) {
      h += group;  // the query heads that share this KV head, over one pass of its cache
      continue;
    }
    attend(q + h * D, K, V, dt, n, D, scale, scores.data(), result + h * D);
    ++h;
  }
}

// one more row of a batch: its caches and position, against the first row's shapes
void check_cache(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t pos,
                 int64_t kv_heads, int64_t D, int64_t positions) {
  TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == kv_heads &&
                        k_cache.size(2) == D,
                    "caches must both be [kv_heads, capacity, head_dim], got ", k_cache.sizes(), " and ",
                    v_cache.sizes());
  TORCH_CHECK_VALUE(pos >= 0 && pos < k_cache.size(1) && pos < positions, "position ", pos,
                    " is outside the cache of ", k_cache.size(1), " or the tables of ", positions);
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == qkv.scalar_type() &&
                        v_cache.scalar_type() == qkv.scalar_type(),
                    "caches must be contiguous and of the activations' dtype");
}

}  // namespace

// qkv [1, (H + 2 Hkv) D]; cos, sin [positions, D] tables; caches [Hkv, capacity, D], written at pos;
// attention over the positions (pos - window, pos] (window 0: [0, pos])
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, int64_t pos, int64_t heads, int64_t kv_heads, int64_t window) {
  check(qkv, cos, sin, k_cache, v_cache, pos, heads, kv_heads);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0, got ", window);
  const int dt = dtype_of(qkv.scalar_type());
  const int64_t D = k_cache.size(2), first = first_key(pos, window), n = pos + 1 - first;
  const RowJob job{qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.size(1), pos, first};
  std::vector<float> q(heads * D), result(heads * D);
  rotate_and_store(job, cos, sin, dt, heads, kv_heads, D, q.data());
  // one thread below ~64K multiply-adds: waking another costs more than it saves
  at::parallel_for(0, heads, std::max<int64_t>(1, 65536 / (n * D)), [&](int64_t h0, int64_t h1) {
    attend_heads(job, q.data(), dt, h0, h1, heads / kv_heads, D, result.data());
  });
  at::Tensor out = at::empty({1, heads * D}, qkv.options());
  void* op = out.data_ptr();
  for (int64_t i = 0; i < heads * D; ++i) store(op, i, dt, result[i]);
  return out;
}

// B one-token rows at once: qkv [B, (H + 2 Hkv) D], each row with its caches and position (one
// call instead of B). Rows may share a cache at consecutive positions (a speculative window):
// every row's key and value are stored before any row attends, so each row reads the rows
// before it, and computes as a one-row step at its position would.
at::Tensor decode_attention_batch(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef positions,
                                  int64_t heads, int64_t kv_heads, int64_t window) {
  const int64_t B = qkv.size(0);
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0, got ", window);
  TORCH_CHECK_VALUE(qkv.dim() == 2 && (int64_t)k_caches.size() == B && (int64_t)v_caches.size() == B &&
                        (int64_t)positions.size() == B,
                    "decode_attention_batch needs qkv [B, width] and B caches and positions, got ", qkv.sizes(), ", ",
                    k_caches.size(), ", ", v_caches.size(), ", ", positions.size());
  check(qkv.narrow(0, 0, 1), cos, sin, k_caches[0], v_caches[0], positions[0], heads, kv_heads);
  for (int64_t b = 1; b < B; ++b)  // the rows share qkv's checks: only each cache and position
    check_cache(qkv, k_caches[b], v_caches[b], positions[b], kv_heads, k_caches[0].size(2), cos.size(0));
  const int dt = dtype_of(qkv.scalar_type());
  const int64_t D = k_caches[0].size(2), width = qkv.size(1) * (dt == F32 ? 4 : 2);
  auto job = [&](int64_t b) {
    return RowJob{(const char*)qkv.data_ptr() + b * width, k_caches[b].data_ptr(), v_caches[b].data_ptr(),
                  k_caches[b].size(1), positions[b], first_key(positions[b], window)};
  };
  std::vector<float> q(B * heads * D);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rotate_and_store(job(b), cos, sin, dt, heads, kv_heads, D, &q[b * heads * D]);
  });
  at::Tensor out = at::empty({B, heads * D}, qkv.options());
  void* op = out.data_ptr();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> result(heads * D);
    for (int64_t b = b0; b < b1; ++b) {
      attend_heads(job(b), &q[b * heads * D], dt, 0, heads, heads / kv_heads, D, result.data());
      for (int64_t i = 0; i < heads * D; ++i) store(op, b * heads * D + i, dt, result[i]);
    }
  });
  return out;
}

namespace {

inline int64_t size_of(int dt) { return dt == F32 ? 4 : 2; }
inline const char* at_(const void* p, int64_t i, int dt) { return (const char*)p + i * size_of(dt); }


// out[i] = x[i] / rms(x) * w[i] over one row of n
void norm_row(const void* x, const void* w, int wt, int64_t n, float eps, void* out, int dt) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    const __m512 v = load(at_(x, d, dt), dt, tail_mask(n - d));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / n + eps));
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 m = tail_mask(n - d);
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(load(at_(x, d, dt), dt, m), r), load(at_(w, d, wt), wt, m));
    store16((char*)out + d * size_of(dt), dt, m, v);
  }
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.is_cpu() && x.is_contiguous() && x.dim() >= 1 && weight.is_contiguous() &&
                        weight.numel() == x.size(-1),
                    "rms_norm needs contiguous x [..., n] and a weight of n values, got ", x.sizes(), " and ",
                    weight.sizes());
}

// run fn(row) over the rows of [rows, n], one thread for small work
template <class Fn>
void each_row(int64_t rows, int64_t n, const Fn& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  const int dt = dtype_of(x.scalar_type()), wt = dtype_of(weight.scalar_type());
  const int64_t n = x.size(-1);
  at::Tensor out = at::empty_like(x);
  const void *xp = x.data_ptr(), *wp = weight.data_ptr();
  void* op = out.data_ptr();
  each_row(x.numel() / n, n, [&](int64_t r) {
    norm_row(at_(xp, r * n, dt), wp, wt, n, (float)eps, (char*)op + r * n * size_of(dt), dt);
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual add and the next layer norm; the sum is rounded
// to the dtype before it is normed, as the two eager ops would
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK_VALUE(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == x.scalar_type(),
                    "add_rms_norm needs x and delta of one shape and dtype, got ", x.sizes(), " and ", delta.sizes());
  const int dt = dtype_of(x.scalar_type()), wt = dtype_of(weight.scalar_type());
  const int64_t n = x.size(-1);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const void *xp = x.data_ptr(), *dp = delta.data_ptr(), *wp = weight.data_ptr();
  char *sp = (char*)sum.data_ptr(), *op = (char*)out.data_ptr();
  each_row(x.numel() / n, n, [&](int64_t r) {
    const int64_t row = r * n;
    for (int64_t d = 0; d < n; d += 16) {
      const __mmask16 m = tail_mask(n - d);
      const __m512 v = _mm512_add_ps(load(at_(xp, row + d, dt), dt, m), load(at_(dp, row + d, dt), dt, m));
      store16(sp + (row + d) * size_of(dt), dt, m, v);
    }
    norm_row(sp + row * size_of(dt), wp, wt, n, (float)eps, op + row * size_of(dt), dt);
  });
  return {sum, out};
}

// gate_up [..., 2R] -> silu(gate) * up [..., R]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.is_cpu() && gate_up.is_contiguous() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
                    "silu_mul needs a contiguous [..., 2 * rows] tensor, got ", gate_up.sizes());
  const int dt = dtype_of(gate_up.scalar_type());
  const int64_t R = gate_up.size(-1) / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = R;
  at::Tensor out = at::empty(shape, gate_up.options());
  const void* ip = gate_up.data_ptr();
  char* op = (char*)out.data_ptr();
  each_row(gate_up.numel() / (2 * R), R, [&](int64_t r) {
    for (int64_t d = 0; d < R; d += 16) {
      const __mmask16 m = tail_mask(R - d);
      const __m512 g = load(at_(ip, 2 * R * r + d, dt), dt, m), u = load(at_(ip, 2 * R * r + R + d, dt), dt, m);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      store16(op + (R * r + d) * size_of(dt), dt, m, _mm512_mul_ps(silu, u));
    }
  });
  return out;
}

}  // namespace seamline_quant

#else

namespace seamline_quant {
at::Tensor decode_attention_batch(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                                  at::TensorList, at::IntArrayRef, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "decode_attention_batch needs x86-64");
}
at::Tensor decode_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, int64_t,
                            int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "decode_attention needs x86-64");
}
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { TORCH_CHECK(false, "rms_norm needs x86-64"); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "add_rms_norm needs x86-64");
}
at::Tensor silu_mul(const at::Tensor&) { TORCH_CHECK(false, "silu_mul needs x86-64"); }
}  // namespace seamline_quant

#endif

TORCH_LIBRARY_FRAGMENT(seamline_quant, m) {
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, "
      "int heads, int kv_heads, int window=0) -> Tensor");
  m.def(
      "decode_attention_batch(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "int[] positions, int heads, int kv_heads, int window=0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(seamline_quant, CPU, m) {
  m.impl("decode_attention", &seamline_quant::decode_attention);
  m.impl("decode_attention_batch", &seamline_quant::decode_attention_batch);
  m.impl("rms_norm", &seamline_quant::rms_norm);
  m.impl("add_rms_norm", &seamline_quant::add_rms_norm);
  m.impl("silu_mul", &seamline_quant::silu_mul);
}
