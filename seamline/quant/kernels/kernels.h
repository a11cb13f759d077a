// Plain C++ interface of the AVX-512 kernels (kernels.cpp), so that the ATen side (ops.cpp)
// is compiled without AVX-512 flags and the library loads on any x86-64 CPU.
#pragma once

#include <cstdint>

// The instruction set of a kernel file: its own list of AVX-512 features, or with SEAMLINE_AVX2
// defined (the library built for CPUs without AVX-512) AVX2, FMA and F16C, the AVX-512
// intrinsics then emulated by avx2_512.h (intrinsics.h). Files that only AVX-512 can run
// (amx.cpp, dequant_bf16.cpp) compile to their stubs there.
#define SEAMLINE_PRAGMA(x) _Pragma(#x)
#if SEAMLINE_AVX2
#define SEAMLINE_TARGET(features) SEAMLINE_PRAGMA(GCC target("avx2,fma,f16c,bmi2"))
#else
#define SEAMLINE_TARGET(features) SEAMLINE_PRAGMA(GCC target(features))
#endif

namespace seamline_quant {

enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// The activations quantised the way the kernels read them, per row m (kp = padded columns):
// xq int8 [kp], xs float [kp / 4] (block scale per 4-wide lane), aux [kp / 4]: for types
// with an integer offset, int32 -OFFSET * (lane sum of xq); for types with a min, the float
// lane sum of the rounded x (xs * lane sum of xq). K-quants differ: see prep_row_k.
struct XBuf {
  int8_t* xq;
  float* xs;
  float* aux;
  float* blk;  // [kp / 16]: per 32-wide block the scale, then the sum of the rounded x
  int64_t kp;
};

// Activations laid out for AMX tiles (amx.cpp), per group of 16 rows g and 32-wide block b
// (at = g * blocks + b): tiles[at * 512] the B tile (8 rows x 16 activation rows x 4 bytes),
// scale[at * 16 + n] and sum[at * 16 + n] the block's scale and scale * sum of its int8 values.
struct AmxX {
  int8_t* tiles;
  float* scale;
  float* sum;
};

bool cpu_supported();                 // AVX-512 F/BW/VL/DQ/VNNI (AVX2 build: AVX2, FMA, F16C) present
bool qtype_supported(int qtype);      // one of the GGML types the kernels decode
int64_t padded_cols(int64_t cols);    // cols rounded up to 64
int64_t row_bytes(int qtype, int64_t cols);  // bytes of one row of cols weights; -1 if not whole blocks

// quantise rows [m0, m1) of x (dtype dt, row stride x_stride elements) into buf
void prep_x(int qtype, const void* x, int dt, int64_t x_stride, int64_t cols, int64_t m0, int64_t m1,
            const XBuf& buf);

// out[m, r] = x[m] . w[r] (+ bias[r]) for weight rows [r0, r1) and all m < rows_x;
// w: GGUF blocks with w_stride bytes between rows; out: dtype dt, row stride n_out elements
void gemv_rows(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, const XBuf& buf,
               int64_t rows_x, int64_t r0, int64_t r1, const float* bias, void* out, int dt,
               int64_t n_out);

// weight rows [r0, r1) as bfloat16 bits, out row stride = cols; with native and a CPU that has
// AVX512-BF16, rounded by its instructions (dequant_rows_bf16_native in dequant_bf16.cpp)
void dequant_rows_bf16(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0,
                       int64_t r1, uint16_t* out, bool native);
// weight rows [r0, r1) as float32, bit-identical to gguf-py's dequantiser
void dequant_rows_f32(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0, int64_t r1,
                      float* out);
bool cpu_has_bf16();
void dequant_rows_bf16_native(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, int64_t r0,
                              int64_t r1, uint16_t* out);

// AMX-INT8 present and permitted to this process; the 32-wide types it multiplies
bool amx_supported();
bool amx_qtype(int qtype);
// groups [g0, g1) of 16 rows of the quantised activations (prep_x) into tile layout
void amx_prep(const XBuf& buf, int64_t M, int64_t cols, int64_t g0, int64_t g1, const AmxX& x);
// as gemv_rows, by AMX tiles (cols a multiple of 64; r0 a multiple of 16)
void amx_rows(int qtype, const uint8_t* w, int64_t w_stride, int64_t cols, const AmxX& x, int64_t M, int64_t r0,
              int64_t r1, const float* bias, void* out, int dt, int64_t n_out);

}  // namespace seamline_quant
