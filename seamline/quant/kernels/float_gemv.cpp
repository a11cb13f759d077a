// The exact path: a few weight rows at a time decoded to float32 as gguf-py decodes them, into a
// buffer that stays in L1 while every activation row is multiplied with them in float32. No
// activation rounding, so a quantized model gives the float answers of its dequantised weights
// (up to float32 summation order, which is the same for a row alone and in a batch). Registered
// as torch.ops.seamline_quant.linear_exact (decode and batched steps; prefill takes linear_tiled).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
SEAMLINE_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,avx2,bmi2")
#include "blocks.h"

namespace seamline_quant {
namespace {

constexpr int NB = 4;  // weight rows decoded together: their floats stay in L1 for every activation row

// weight rows [0, nb) of w as float32, gguf-py's values, in wbuf rows of ``padded`` (zero past cols)
template <class D>
void decode_rows(const uint8_t* w, int64_t w_stride, int64_t cols, int64_t padded, int nb, float* wbuf) {
  for (int i = 0; i < nb; ++i) {
    float* dst = wbuf + i * padded;
    for_pairs<D>(w + i * w_stride, cols, [&](int64_t p, const Pair& P) {
      _mm512_storeu_ps(dst + 64 * p, chunk_f32<D, 0>(P));
      _mm512_storeu_ps(dst + 64 * p + 16, chunk_f32<D, 1>(P));
      _mm512_storeu_ps(dst + 64 * p + 32, chunk_f32<D, 2>(P));
      _mm512_storeu_ps(dst + 64 * p + 48, chunk_f32<D, 3>(P));
    });
    for (int64_t e = (cols / 64) * 64 + (D::PAIRS == 1 && cols % 64 ? 64 : 0); e < padded; ++e) dst[e] = 0.0f;
  }
  for (int i = nb; i < NB; ++i) std::fill(wbuf + i * padded, wbuf + (i + 1) * padded, 0.0f);
}

// res[m][r] = x[m] . wbuf[r] for MB activation rows and NB weight rows. Every (m, r) sums its
// 16 lanes in column order and then across lanes, however many rows come with it: a row's
// result is the same in a batch as alone.
template <int MB>
inline void dots(const float* x, int64_t padded, const float* wbuf, float res[MB][NB]) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t e = 0; e < padded; e += 16) {
    __m512 wv[NB];
    for (int r = 0; r < NB; ++r) wv[r] = _mm512_loadu_ps(wbuf + r * padded + e);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * padded + e);
      for (int r = 0; r < NB; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

// out[m, r] (float32, row stride n_out) for weight rows [r0, r1) and activation rows [0, M)
template <class D>
void rows_exact(const uint8_t* w, int64_t w_stride, int64_t cols, const float* x, int64_t padded, int64_t M,
                int64_t r0, int64_t r1, float* out, int64_t n_out) {
  thread_local std::vector<float> wbuf;
  wbuf.resize(NB * padded);
  for (int64_t r = r0; r < r1; r += NB) {
    const int nb = (int)std::min<int64_t>(NB, r1 - r);
    decode_rows<D>(w + r * w_stride, w_stride, cols, padded, nb, wbuf.data());
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      float res[4][NB];
      dots<4>(x + m * padded, padded, wbuf.data(), res);
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < nb; ++j) out[(m + i) * n_out + r + j] = res[i][j];
    }
    for (; m < M; ++m) {
      float res[1][NB];
      dots<1>(x + m * padded, padded, wbuf.data(), res);
      for (int j = 0; j < nb; ++j) out[m * n_out + r + j] = res[0][j];
    }
  }
}

}  // namespace

// x [M, cols] float32 @ W.T -> [M, N] float32 (+ bias)
at::Tensor linear_exact(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t cols,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(qtype_supported((int)qtype) && row_bytes((int)qtype, cols) == w.size(1),
                    "weight rows of ", w.size(1), " bytes do not hold ", cols, " weights of GGML type ", qtype);
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1,
                    "weight blocks must be a CPU uint8 [rows, row_bytes] tensor with contiguous rows");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.size(1) == cols, "activations must be [M, ", cols, "]");
  const int64_t M = x.size(0), N = w.size(0), padded = padded_cols(cols);
  // activations zero-padded to whole pairs (the decoded weights past cols are zero too)
  const at::Tensor xp = at::constant_pad_nd(x.to(at::kFloat), {0, padded - cols}).contiguous();
  const float* xd = xp.data_ptr<float>();
  at::Tensor out = at::empty({M, N}, xp.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t groups = (N + NB - 1) / NB;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (cols * M));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const int64_t r0 = g0 * NB, r1 = std::min(N, g1 * NB);
#define SEAMLINE_EXACT(D) rows_exact<D>(wp, w.stride(0), cols, xd, padded, M, r0, r1, op, N)
    SEAMLINE_DISPATCH(qtype, SEAMLINE_EXACT)
  });
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out;
}

}  // namespace seamline_quant

TORCH_LIBRARY_FRAGMENT(seamline_quant, m) {
  m.def("linear_exact(Tensor x, Tensor w, int qtype, int cols, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(seamline_quant, CPU, m) { m.impl("linear_exact", &seamline_quant::linear_exact); }

#endif
