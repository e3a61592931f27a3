// y[M, N] = x[M, K] @ W[N, K]^T for GGUF block-quantized W (Q4_0, Q4_1, Q8_0), fp32 x and y.
//
// W stays in the file's format, one row of blocks per output feature: blocks [N, K/32 * B] uint8
// with B = 18 (Q4_0: fp16 d, 16 bytes of nibbles), 20 (Q4_1: fp16 d, fp16 m, 16 bytes) or 34
// (Q8_0: fp16 d, 32 int8). In a 4-bit block byte j holds weight j in its low nibble and weight
// j+16 in its high nibble. A decode or verify step reads each block once: per output row, each
// block is dequantized into 4 fp32 registers and multiplied (FMA) with every x row of the pass.
//
// The dequantized value is the one gguf-py (and so transformers) computes, bit for bit:
//   Q4_0  d * (q - 8)      Q4_1  (d * q) + m  (two roundings, no FMA)      Q8_0  d * q
// so y equals F.linear(x, dequantized W) within fp32 summation order. The file is compiled with
// -ffp-contract=off, which keeps the compiler from fusing d * q + m into one FMA.
//
// Rows of x run in passes of up to 4 (4 weight registers + 2 accumulators per row + x loads fit
// the 16 ymm registers); a pass re-reads the row's blocks from L1. Output rows are split over
// torch's intra-op threads (at::parallel_for). AVX2 + FMA + F16C (every AVX2 CPU has F16C); an
// AVX-512 variant of the same loop is used where the CPU has AVX-512F/BW (picked at run time).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

constexpr int64_t QK = 32;  // weights per block

inline int64_t block_bytes(int64_t t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---- AVX2: one block -> 4 x 8 fp32 ------------------------------------------------------------

template <int64_t T>
inline void dequant8x4(const uint8_t* b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_to_float(b));
  if constexpr (T == Q8_0) {
    for (int j = 0; j < 4; ++j) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
  } else {
    const uint8_t* qs = b + (T == Q4_1 ? 4 : 2);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);                     // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // weights 16..31
    __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
    if constexpr (T == Q4_0) {
      const __m256 eight = _mm256_set1_ps(8.0f);
      for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, _mm256_sub_ps(q[j], eight));  // q - 8 is exact
    } else {
      const __m256 m = _mm256_set1_ps(half_to_float(b + 2));
      for (int j = 0; j < 4; ++j) w[j] = _mm256_add_ps(_mm256_mul_ps(d, q[j]), m);
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m, n] for rows n0..n1 and MP rows of x (x [MP, K], y row stride ldy)
template <int64_t T, int MP>
void rows_avx2(const float* x, int64_t K, const uint8_t* blocks, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t nb = K / QK, B = block_bytes(T), row_bytes = nb * B;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    __m256 a0[MP], a1[MP];
    for (int m = 0; m < MP; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      dequant8x4<T>(row + b * B, w);
      const float* xb = x + b * QK;
      for (int m = 0; m < MP; ++m) {
        const float* xm = xb + m * K;
        a0[m] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xm), a0[m]);
        a1[m] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), a1[m]);
        a0[m] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), a0[m]);
        a1[m] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), a1[m]);
      }
    }
    for (int m = 0; m < MP; ++m) y[m * ldy + n] = hsum(_mm256_add_ps(a0[m], a1[m]));
  }
}

// ---- AVX-512: one block -> 2 x 16 fp32 (same values) ------------------------------------------

#define SPECSPLIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

template <int64_t T>
SPECSPLIT_AVX512 inline void dequant16x2(const uint8_t* b, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(half_to_float(b));
  if constexpr (T == Q8_0) {
    for (int j = 0; j < 2; ++j) {
      const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * j));
      w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)));
    }
  } else {
    const uint8_t* qs = b + (T == Q4_1 ? 4 : 2);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512 q[2] = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask))),
                   _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)))};
    if constexpr (T == Q4_0) {
      const __m512 eight = _mm512_set1_ps(8.0f);
      for (int j = 0; j < 2; ++j) w[j] = _mm512_mul_ps(d, _mm512_sub_ps(q[j], eight));
    } else {
      const __m512 m = _mm512_set1_ps(half_to_float(b + 2));
      for (int j = 0; j < 2; ++j) w[j] = _mm512_add_ps(_mm512_mul_ps(d, q[j]), m);
    }
  }
}

template <int64_t T, int MP>
SPECSPLIT_AVX512 void rows_avx512(const float* x, int64_t K, const uint8_t* blocks, int64_t n0, int64_t n1, float* y,
                                  int64_t ldy) {
  const int64_t nb = K / QK, B = block_bytes(T), row_bytes = nb * B;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    __m512 a0[MP], a1[MP];
    for (int m = 0; m < MP; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w[2];
      dequant16x2<T>(row + b * B, w);
      const float* xb = x + b * QK;
      for (int m = 0; m < MP; ++m) {
        a0[m] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + m * K), a0[m]);
        a1[m] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + m * K + 16), a1[m]);
      }
    }
    for (int m = 0; m < MP; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

bool use_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

constexpr int MAX_PASS = 4;  // x rows per pass over a weight row

template <int64_t T, int MP>
void pass(const float* x, int64_t K, const uint8_t* blocks, int64_t N, float* y, bool avx512) {
  // grain: at least 64 output rows per task, so one thread is a plain loop
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (avx512)
      rows_avx512<T, MP>(x, K, blocks, n0, n1, y, N);
    else
      rows_avx2<T, MP>(x, K, blocks, n0, n1, y, N);
  });
}

template <int64_t T>
void run(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t N, float* y, bool avx512) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_PASS) {
    const float* xs = x + m0 * K;
    float* ys = y + m0 * N;
    switch (std::min<int64_t>(MAX_PASS, M - m0)) {
      case 1: pass<T, 1>(xs, K, blocks, N, ys, avx512); break;
      case 2: pass<T, 2>(xs, K, blocks, N, ys, avx512); break;
      case 3: pass<T, 3>(xs, K, blocks, N, ys, avx512); break;
      default: pass<T, 4>(xs, K, blocks, N, ys, avx512); break;
    }
  }
}

// one row of blocks -> K fp32 (scalar, the same arithmetic as the vector paths)
template <int64_t T>
void dequant_row(const uint8_t* row, int64_t K, float* out) {
  const int64_t B = block_bytes(T);
  for (int64_t b = 0; b < K / QK; ++b) {
    const uint8_t* p = row + b * B;
    const float d = half_to_float(p);
    float* o = out + b * QK;
    if constexpr (T == Q8_0) {
      for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(static_cast<int8_t>(p[2 + j]));
    } else if constexpr (T == Q4_0) {
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>((p[2 + j] & 0x0F) - 8);
        o[j + 16] = d * static_cast<float>((p[2 + j] >> 4) - 8);
      }
    } else {
      const float m = half_to_float(p + 2);
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(p[4 + j] & 0x0F) + m;
        o[j + 16] = d * static_cast<float>(p[4 + j] >> 4) + m;
      }
    }
  }
}

void check_blocks(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(block_bytes(qtype) > 0, "quant_linear: type ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(K % QK == 0, "quant_linear: in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == K / QK * block_bytes(qtype),
              "quant_linear: blocks must be contiguous uint8 [N, K/32 * block bytes]");
}

}  // namespace

// x [M, K] fp32, blocks [N, K/32 * B] uint8 -> y [M, N] fp32 (+ bias)
// allow_avx512 = false runs the AVX2 loop on any CPU (tests compare both)
torch::Tensor quant_linear(const torch::Tensor& x_in, const torch::Tensor& blocks, int64_t qtype,
                           const c10::optional<torch::Tensor>& bias, bool allow_avx512) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "quant_linear: x must be fp32 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = blocks.size(0);
  check_blocks(blocks, qtype, K);
  const torch::Tensor x = x_in.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const bool avx512 = allow_avx512 && use_avx512();
  if (M > 0) {
    switch (qtype) {
      case Q4_0: run<Q4_0>(xp, M, K, bp, N, yp, avx512); break;
      case Q4_1: run<Q4_1>(xp, M, K, bp, N, yp, avx512); break;
      default: run<Q8_0>(xp, M, K, bp, N, yp, avx512); break;
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// blocks [N, K/32 * B] uint8 -> W [N, K] fp32 (the values quant_linear multiplies with)
torch::Tensor quant_dequantize(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  check_blocks(blocks, qtype, K);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  auto w = torch::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      switch (qtype) {
        case Q4_0: dequant_row<Q4_0>(bp + n * row_bytes, K, wp + n * K); break;
        case Q4_1: dequant_row<Q4_1>(bp + n * row_bytes, K, wp + n * K); break;
        default: dequant_row<Q8_0>(bp + n * row_bytes, K, wp + n * K); break;
      }
    }
  });
  return w;
}

bool quant_uses_avx512() { return use_avx512(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ W.T (+ bias), W in GGUF Q4_0/Q4_1/Q8_0 blocks, fp32 x");
  m.def("quant_dequantize", &quant_dequantize, "GGUF Q4_0/Q4_1/Q8_0 blocks [N, K/32*B] -> fp32 [N, K]");
  m.def("quant_uses_avx512", &quant_uses_avx512, "whether the AVX-512 loop runs on this CPU");
}
