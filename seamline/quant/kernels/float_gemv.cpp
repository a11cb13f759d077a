// The exact decode path: the GGUF blocks decoded in registers (quants, scales, mins as gguf-py
// reads them) and multiplied with the activations in float32, summed in float32. No activation
// rounding, so a quantized model gives the float answers of its dequantised weights (up to
// float32 rounding and summation order). Registered as torch.ops.seamline_quant.linear_exact
// (decode steps and batched steps: each row's sums are the same however many rows come with it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,avx2,bmi2")
#include "blocks.h"

namespace seamline_quant {
namespace {

// weight row w . activation rows [0, MB) -> res[MB]. Quants are taken lane-wise: lane l of a
// pair holds elements 4l..4l+3 (one per byte), which share the lane's scale and min, so byte k
// of every lane meets xt[k] (the activations of elements 4l+k, transposed once per call) with
// no shuffle: per lane sum_k q * x, times the scale, plus (min - OFFSET * scale) * sum_k x.
template <class D, int MB>
inline void row_dot(const uint8_t* w, int64_t cols, const float* xt, int64_t x_stride, const float* xl,
                    int64_t l_stride, float* res) {
  __m512 acc[MB], rest[MB];
  for (int i = 0; i < MB; ++i) acc[i] = rest[i] = _mm512_setzero_ps();
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for_pairs<D>(w, cols, [&](int64_t p, const Pair& P) {
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(P.q, byte));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(P.q, 8), byte));
    const __m512 q2 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(P.q, 16), byte));
    const __m512 q3 = _mm512_cvtepi32_ps(_mm512_srli_epi32(P.q, 24));
    __m512 c = _mm512_setzero_ps();  // per lane: min - OFFSET * scale
    if constexpr (D::OFFSET != 0) c = _mm512_mul_ps(P.scale, _mm512_set1_ps(-(float)D::OFFSET));
    if constexpr (D::MIN) c = _mm512_add_ps(c, P.minv);
    for (int i = 0; i < MB; ++i) {
      const float* xp = xt + i * x_stride + 64 * p;  // [4][16]: byte k, lane l
      __m512 t = _mm512_mul_ps(q0, _mm512_loadu_ps(xp));
      t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xp + 16), t);
      t = _mm512_fmadd_ps(q2, _mm512_loadu_ps(xp + 32), t);
      t = _mm512_fmadd_ps(q3, _mm512_loadu_ps(xp + 48), t);
      acc[i] = _mm512_fmadd_ps(P.scale, t, acc[i]);
      rest[i] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xl + i * l_stride + 16 * p), rest[i]);
    }
  });
  for (int i = 0; i < MB; ++i) res[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], rest[i]));
}

// out[m, r] (float32, row stride n_out) for weight rows [r0, r1), activation rows [0, rows_x)
template <class D>
void rows_exact(const uint8_t* w, int64_t w_stride, int64_t cols, const float* x, int64_t x_stride, const float* xl,
                int64_t rows_x, int64_t r0, int64_t r1, float* out, int64_t n_out) {
  float res[8];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * w_stride;
    int64_t m = 0;
    for (; m + 8 <= rows_x; m += 8) {  // a batched step: each weight block decoded once per 8 rows
      row_dot<D, 8>(row, cols, x + m * x_stride, x_stride, xl + m * (x_stride / 4), x_stride / 4, res);
      for (int i = 0; i < 8; ++i) out[(m + i) * n_out + r] = res[i];
    }
    for (; m + 4 <= rows_x; m += 4) {
      row_dot<D, 4>(row, cols, x + m * x_stride, x_stride, xl + m * (x_stride / 4), x_stride / 4, res);
      for (int i = 0; i < 4; ++i) out[(m + i) * n_out + r] = res[i];
    }
    for (; m < rows_x; ++m) {
      row_dot<D, 1>(row, cols, x + m * x_stride, x_stride, xl + m * (x_stride / 4), x_stride / 4, res);
      out[m * n_out + r] = res[0];
    }
  }
}

}  // namespace

// activation rows as the kernel reads them, per 64-wide pair p: xt[m][p][k][l] = x[m][64p + 4l + k]
// and xl[m][p][l] = sum_k of those (zeros past cols)
static void lay_out(const float* x, int64_t x_stride, int64_t M, int64_t cols, int64_t padded, float* xt, float* xl) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * x_stride;
    float* t = xt + m * padded;
    float* l = xl + m * (padded / 4);
    for (int64_t e = 0; e < padded; e += 4) {
      float sum = 0.0f;
      for (int64_t k = 0; k < 4; ++k) {
        const float v = e + k < cols ? row[e + k] : 0.0f;
        t[(e / 64) * 64 + k * 16 + (e % 64) / 4] = v;
        sum += v;
      }
      l[e / 4] = sum;
    }
  }
}

// x [M, cols] float32 @ W.T -> [M, N] float32 (+ bias)
at::Tensor linear_exact(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t cols,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(qtype_supported((int)qtype) && row_bytes((int)qtype, cols) == w.size(1),
                    "weight rows of ", w.size(1), " bytes do not hold ", cols, " weights of GGML type ", qtype);
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1,
                    "weight blocks must be a CPU uint8 [rows, row_bytes] tensor with contiguous rows");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.size(1) == cols, "activations must be [M, ", cols, "]");
  const int64_t M = x.size(0), N = w.size(0), padded = padded_cols(cols);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  thread_local std::vector<float> scratch;  // xt then xl, reused across calls
  scratch.resize(M * padded + M * padded / 4);
  float* xp = scratch.data();
  float* lp = xp + M * padded;
  lay_out(xf.data_ptr<float>(), cols, M, cols, padded, xp, lp);
  at::Tensor out = at::empty({M, N}, xf.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / (cols * M));
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
#define SEAMLINE_EXACT(D) rows_exact<D>(wp, w.stride(0), cols, xp, padded, lp, M, r0, r1, op, N)
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
