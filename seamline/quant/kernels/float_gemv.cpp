// The exact decode path: each weight dequantised in registers exactly as gguf-py does
// (chunk_f32), multiplied with the activations in float32 and summed in float32. No activation
// rounding, so a quantized model gives the float answers of its dequantised weights (up to
// summation order). Registered as torch.ops.seamline_quant.linear_exact (decode-sized inputs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,avx2,bmi2")
#include "blocks.h"

namespace seamline_quant {
namespace {

// weight row w . activation rows x[0..MB) (float32, zero-padded to whole pairs) -> res[MB]
template <class D, int MB>
inline void row_dot(const uint8_t* w, int64_t cols, const float* x, int64_t x_stride, float* res) {
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for_pairs<D>(w, cols, [&](int64_t p, const Pair& P) {
    const __m512 w0 = chunk_f32<D, 0>(P), w1 = chunk_f32<D, 1>(P);
    const __m512 w2 = chunk_f32<D, 2>(P), w3 = chunk_f32<D, 3>(P);
    for (int i = 0; i < MB; ++i) {
      const float* xp = x + i * x_stride + 64 * p;
      acc[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc[i]);
      acc[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), acc[i]);
      acc[i] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xp + 32), acc[i]);
      acc[i] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xp + 48), acc[i]);
    }
  });
  for (int i = 0; i < MB; ++i) res[i] = _mm512_reduce_add_ps(acc[i]);
}

// out[m, r] (float32, row stride n_out) for weight rows [r0, r1), activation rows [0, rows_x)
template <class D>
void rows_exact(const uint8_t* w, int64_t w_stride, int64_t cols, const float* x, int64_t x_stride, int64_t rows_x,
                int64_t r0, int64_t r1, float* out, int64_t n_out) {
  float res[4];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * w_stride;
    int64_t m = 0;
    for (; m + 4 <= rows_x; m += 4) {
      row_dot<D, 4>(row, cols, x + m * x_stride, x_stride, res);
      for (int i = 0; i < 4; ++i) out[(m + i) * n_out + r] = res[i];
    }
    for (; m < rows_x; ++m) {
      row_dot<D, 1>(row, cols, x + m * x_stride, x_stride, res);
      out[m * n_out + r] = res[0];
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
  // float32, zero-padded to whole 64-wide pairs (an odd last 32-wide block meets zeros)
  at::Tensor xf = at::zeros({M, padded}, x.options().dtype(at::kFloat));
  xf.narrow(1, 0, cols).copy_(x);
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / (cols * M));
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
#define SEAMLINE_EXACT(D) rows_exact<D>(wp, w.stride(0), cols, xp, padded, M, r0, r1, op, N)
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
