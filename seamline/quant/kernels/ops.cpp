// torch ops over the kernels: shape checks, scratch buffers and threading (at::parallel_for,
// so torch.set_num_threads is honoured). Registered as torch.ops.seamline_quant.*.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"

namespace seamline_quant {

static int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    default: TORCH_CHECK(false, "quant kernels take float32, bfloat16 or float16 activations, not ", t);
  }
  return F32;
}

static void check_weight(const at::Tensor& w, int64_t qtype, int64_t cols) {
  TORCH_CHECK_VALUE(qtype_supported((int)qtype), "quant kernels do not decode GGML type ", qtype);
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1,
                    "weight blocks must be a CPU uint8 [rows, row_bytes] tensor with contiguous rows, got ",
                    w.sizes(), " ", w.scalar_type(), " on ", w.device());
  TORCH_CHECK_VALUE(w.size(1) == row_bytes((int)qtype, cols),
                    "weight rows of ", w.size(1), " bytes do not hold ", cols, " weights of GGML type ", qtype);
}

// by AMX tiles: the activations laid out as tiles once, then 16 weight rows per task
static void amx_matmul(const XBuf& buf, int64_t M, const uint8_t* wp, int64_t w_stride, int64_t qtype, int64_t cols,
                       int64_t N, const float* bp, void* op, int dt) {
  const int64_t groups = (M + 15) / 16, nb = cols / 32;
  std::vector<int8_t> tiles(groups * nb * 512);
  std::vector<float> scale(groups * nb * 16), sum(groups * nb * 16);
  const AmxX ax{tiles.data(), scale.data(), sum.data()};
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) { amx_prep(buf, M, cols, g0, g1, ax); });
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
    amx_rows((int)qtype, wp, w_stride, cols, ax, M, 16 * t0, std::min(N, 16 * t1), bp, op, dt, N);
  });
}

// y [M, N] = x [M, cols] @ W.T (+ bias), x quantised to int8 blocks first (decode-sized M, or
// any M by AMX tiles)
static at::Tensor fused(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t cols,
                        const at::Tensor& bias, bool amx) {
  const int dt = dtype_code(x.scalar_type());
  const int64_t M = x.size(0), N = w.size(0), kp = padded_cols(cols);
  // xq, xs, aux, blk: a per-thread buffer reused across calls (up to 4 MB), else a fresh one
  const size_t need = M * kp * 3 + M * kp / 4 + 64;
  thread_local std::vector<uint8_t> reused;
  std::vector<uint8_t> fresh;
  std::vector<uint8_t>& scratch = need <= (size_t{1} << 22) ? reused : fresh;
  if (scratch.size() < need) scratch.resize(need);
  uint8_t* base = (uint8_t*)(((uintptr_t)scratch.data() + 63) & ~(uintptr_t)63);
  XBuf buf{(int8_t*)base, (float*)(base + M * kp), (float*)(base + 2 * M * kp), (float*)(base + 3 * M * kp), kp};
  const void* xp = x.data_ptr();
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / cols), [&](int64_t m0, int64_t m1) {
    prep_x((int)qtype, xp, dt, x.stride(0), cols, m0, m1, buf);
  });
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options());
  void* op = out.data_ptr();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (amx) {
    amx_matmul(buf, M, wp, w.stride(0), qtype, cols, N, bp, op, dt);
    return out;
  }
  // split only matrices of more than ~256K weights: below, waking a thread costs what it saves
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / (cols * M));
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    gemv_rows((int)qtype, wp, w.stride(0), cols, buf, M, r0, r1, bp, op, dt, N);
  });
  return out;
}

at::Tensor dequant_bf16(const at::Tensor& w, int64_t qtype, int64_t cols, bool native);
at::Tensor dequant_f32(const at::Tensor& w, int64_t qtype, int64_t cols);

// many rows (prefill): W dequantised to bfloat16 in row tiles of ~8 MB, torch's bf16 GEMM
// (oneDNN; AMX where the CPU has it) per tile; activations and output rounded to bf16. The
// AVX2 build takes float32 tiles (linear_tiled) instead.
at::Tensor linear_tiled(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t cols,
                        const std::optional<at::Tensor>& bias);

static at::Tensor tiled(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t cols) {
#if SEAMLINE_AVX2  // without AVX512-BF16 torch's bfloat16 GEMM is 3-7x slower than float32 tiles
  return linear_tiled(x, w, qtype, cols, std::nullopt);
#endif
  const at::Tensor xb = x.to(at::kBFloat16);
  const int64_t N = w.size(0), tile = std::max<int64_t>(64, (int64_t{1} << 22) / cols);
  if (N <= tile) return at::linear(xb, dequant_bf16(w, qtype, cols, true));
  at::Tensor out = at::empty({x.size(0), N}, xb.options());
  for (int64_t start = 0; start < N; start += tile) {
    const int64_t n = std::min(tile, N - start);
    out.narrow(1, start, n).copy_(at::linear(xb, dequant_bf16(w.narrow(0, start, n), qtype, cols, true)));
  }
  return out;
}

// x [M, cols] float32 @ W.T (+ bias) -> [M, N] float32, W dequantised to float32 (as gguf-py
// decodes it) in row tiles of ~4 MB, each multiplied by torch's float32 GEMM: the exact path's
// prefill, which never holds the whole matrix in float
at::Tensor linear_tiled(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t cols,
                        const std::optional<at::Tensor>& bias) {
  check_weight(w, qtype, cols);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.size(1) == cols, "activations must be [M, ", cols, "]");
  const at::Tensor xf = x.to(at::kFloat);
  const int64_t N = w.size(0), tile = std::max<int64_t>(16, (int64_t{1} << 20) / cols);
  at::Tensor out = at::empty({x.size(0), N}, xf.options());
  for (int64_t start = 0; start < N; start += tile) {
    const int64_t n = std::min(tile, N - start);
    out.narrow(1, start, n).copy_(at::linear(xf, dequant_f32(w.narrow(0, start, n), qtype, cols)));
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out;
}

// x [..., cols] @ W.T (+ bias) -> [..., N] in x's dtype; int8 activation blocks up to decode_rows
// rows (and from amx_from rows by AMX tiles), else dequantised bf16 tiles
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t cols,
                  const std::optional<at::Tensor>& bias, int64_t decode_rows, int64_t amx_from) {
  check_weight(w, qtype, cols);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == cols,
                    "activations must be a CPU [..., ", cols, "] tensor, got ", x.sizes());
  at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, cols});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t N = w.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->numel() == N, "bias must have ", N, " elements");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out;
  // AMX from amx_from rows (0: never), where the CPU has it and the type is a 32-wide one
  const bool amx = amx_from > 0 && x2.size(0) >= amx_from && cols % 64 == 0 && amx_qtype((int)qtype) &&
                   amx_supported();
  if (x2.size(0) <= decode_rows || amx) {
    out = fused(x2, w, qtype, cols, b, amx);
  } else {
    out = tiled(x2, w, qtype, cols).to(x.scalar_type());
    if (b.defined()) out.add_(b);
  }
  if (x.dim() == 2) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

// W as bfloat16 [rows, cols]
at::Tensor dequant_bf16(const at::Tensor& w, int64_t qtype, int64_t cols, bool native) {
  check_weight(w, qtype, cols);
  const int64_t N = w.size(0);
  at::Tensor out = at::empty({N, cols}, w.options().dtype(at::kBFloat16));
  uint16_t* op = (uint16_t*)out.data_ptr();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / cols), [&](int64_t r0, int64_t r1) {
    dequant_rows_bf16((int)qtype, wp, w.stride(0), cols, r0, r1, op, native);
  });
  return out;
}

// W as float32 [rows, cols], bit-identical to gguf-py
at::Tensor dequant_f32(const at::Tensor& w, int64_t qtype, int64_t cols) {
  check_weight(w, qtype, cols);
  const int64_t N = w.size(0);
  at::Tensor out = at::empty({N, cols}, w.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / cols), [&](int64_t r0, int64_t r1) {
    dequant_rows_f32((int)qtype, wp, w.stride(0), cols, r0, r1, op);
  });
  return out;
}

bool kernels_usable() { return cpu_supported(); }

bool decodes(int64_t qtype) { return qtype_supported((int)qtype); }

}  // namespace seamline_quant

TORCH_LIBRARY(seamline_quant, m) {
  m.def("linear(Tensor x, Tensor w, int qtype, int cols, Tensor? bias, int decode_rows, int amx_from=0) -> Tensor");
  // native: AVX512-BF16 rounding where the CPU has it (False: the integer rounding, for tests)
  m.def("dequant_bf16(Tensor w, int qtype, int cols, bool native=True) -> Tensor");
  m.def("dequant_f32(Tensor w, int qtype, int cols) -> Tensor");
  m.def("linear_tiled(Tensor x, Tensor w, int qtype, int cols, Tensor? bias) -> Tensor");
  m.def("cpu_supported() -> bool", &seamline_quant::kernels_usable);
  m.def("amx_supported() -> bool", &seamline_quant::amx_supported);
  m.def("decodes(int qtype) -> bool", &seamline_quant::decodes);
}

TORCH_LIBRARY_IMPL(seamline_quant, CPU, m) {
  m.impl("linear", &seamline_quant::linear);
  m.impl("dequant_bf16", &seamline_quant::dequant_bf16);
  m.impl("dequant_f32", &seamline_quant::dequant_f32);
  m.impl("linear_tiled", &seamline_quant::linear_tiled);
}
