// y[M, N] = x[M, K] @ W[N, K]^T for GGUF block-quantized W (Q4_0, Q4_1, Q8_0), fp32 x and y.
//
// W keeps the file's bytes, one row of blocks per output feature, B bytes per 32 weights: 18
// (Q4_0: fp16 d, 16 bytes of nibbles), 20 (Q4_1: fp16 d, fp16 m, 16 bytes) or 34 (Q8_0: fp16 d,
// 32 int8). In a 4-bit block byte j holds weight j in its low nibble and weight j+16 in its high
// nibble. The same bytes are regrouped per row ("split rows", kernels/quant_linear.py does it at
// load): first the quants of the row's blocks, then their fp16 scales side by side, so a row's
// scales convert to fp32 with a few vector instructions instead of two scalar conversions per
// block (measured: ~30% of the loop). blocks [N, K/32 * B] uint8.
// A decode or verify step reads each block once: per output row, each block is dequantized into
// fp32 registers and multiplied (FMA) with every x row of the pass.
//
// The dequantized value is the one gguf-py (and so transformers) computes, bit for bit:
//   Q4_0  d * (q - 8)      Q4_1  (d * q) + m  (two roundings)      Q8_0  d * q
// so y equals F.linear(x, dequantized W) within fp32 summation order. The file is compiled with
// -ffp-contract=off, so the compiler fuses nothing; where a loop writes an FMA for d * q + m, d * q
// is exact and the one rounding is the same (dequant8x4).
//
// Rows of x run in passes of up to 4 (AVX2) or 8 (AVX-512) with two accumulators per row in
// registers; a further pass re-reads the row's blocks from L1. Output rows are split over
// torch's intra-op threads (at::parallel_for). AVX2 + FMA + F16C (every AVX2 CPU has F16C); an
// AVX-512 variant of the same loop is used where the CPU has AVX-512F/BW (picked at run time).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

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

inline int64_t quant_bytes(int64_t t) { return t == Q8_0 ? 32 : 16; }  // per block, before the scales
inline int64_t scale_halves(int64_t t) { return t == Q4_1 ? 2 : 1; }  // fp16 scales per block: d (, m)

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A split row's fp16 scales [nb * NS] -> fp32 (8 at a time with F16C)
template <int64_t T>
inline void row_scales(const uint8_t* row, int64_t nb, float* out) {
  const uint8_t* h = row + nb * quant_bytes(T);
  const int64_t n = nb * scale_halves(T);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i))));
  for (; i < n; ++i) out[i] = half_to_float(h + 2 * i);
}

// Software prefetch. A decode step streams ~96 MB of blocks through these loops once each, and the
// hardware prefetcher alone left them waiting on memory: all 121 linears of SmolLM2-135M Q4_1 at one
// x row took 19-20 ms in model order, 12.8 ms when each weight was re-run hot (Intel Xeon with AMX, 1
// thread). Each row loop asks for the bytes PREFETCH_BYTES past the row it starts, about 3-6 rows
// ahead; measured, interleaved (median of 9, three rounds): 0 B 18.2-20.5 ms, 512 B 13.5-18.1, 1 KB
// 12.6-14.1, 2 KB 11.3-13.4, 4 KB 12.6-13.9; the AVX2 loop 21 -> 14 ms at one row, 28 -> 22 ms at
// four. A prefetch past the end of the buffer is a hint the CPU drops, never a fault.
constexpr int64_t PREFETCH_BYTES = 2048;

inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + o), _MM_HINT_T0);
}

// ---- AVX2: one block -> 4 x 8 fp32 ------------------------------------------------------------

// qs: the block's quants; dv, mv: its scales.
// The 4-bit types (thirtieth session; kernels.md, "The AVX2 dequantizer"): Q4_1's (d * q) + m is
// one FMA with the same bits, since d * q is exact in fp32 (an fp16 d has at most 11 significant
// bits, q < 16 has 4), so the FMA rounds d * q + m once, as the two operations do, zero's sign
// included. The nibbles reach their 32-bit lanes by in-lane byte shuffles instead of vpmovzxbd,
// which crosses lanes. Both together: all 120 linears of SmolLM2-135M Q4_1 at one x row 10.4 ->
// 7.8 ms on the AMD EPYC Zen 4's AVX2 loop, the same outputs bit for bit.
template <int64_t T>
inline void dequant8x4(const uint8_t* qs, float dv, float mv, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(dv);
  if constexpr (T == Q8_0) {
    for (int j = 0; j < 4; ++j) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j));
      w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
  } else {
    // the 16 bytes in both 128-bit lanes; vpshufb spreads bytes 0..7 (then 8..15) one to a 32-bit
    // lane, zero-extended: & 0x0F is the low nibble (weights 0..7, then 8..15), >> 4 the high one
    // (weights 16..23, then 24..31)
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m256i spread0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                             4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i spread1 = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                             12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    const __m256i b0 = _mm256_shuffle_epi8(raw, spread0), b1 = _mm256_shuffle_epi8(raw, spread1);
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i q[4] = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask), _mm256_srli_epi32(b0, 4),
                    _mm256_srli_epi32(b1, 4)};
    if constexpr (T == Q4_0) {
      const __m256i eight = _mm256_set1_epi32(8);
      for (int j = 0; j < 4; ++j)  // q - 8 exact in int32, then d * (q - 8) as before (its zero's sign too)
        w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], eight)));
    } else {  // (d * q) + m, one rounding either way (above)
      const __m256 m = _mm256_set1_ps(mv);
      for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[j]), m);
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
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T), QB = quant_bytes(T), NS = scale_halves(T);
  std::vector<float> sc(nb * NS);  // the row's scales in fp32: d (, m) per block
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    prefetch_ahead(row, row_bytes);
    row_scales<T>(row, nb, sc.data());
    // NA accumulators per x row: 4 independent FMA chains while registers allow (one FMA per
    // chain per block), else 2 (16 ymm registers)
    constexpr int NA = MP <= 2 ? 4 : 2;
    __m256 a[MP][NA];
    for (int m = 0; m < MP; ++m)
      for (int j = 0; j < NA; ++j) a[m][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      dequant8x4<T>(row + b * QB, sc[b * NS], sc[b * NS + NS - 1], w);
      const float* xb = x + b * QK;
      for (int m = 0; m < MP; ++m) {
        const float* xm = xb + m * K;
        for (int j = 0; j < 4; ++j) a[m][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xm + 8 * j), a[m][j % NA]);
      }
    }
    for (int m = 0; m < MP; ++m) {
      __m256 s = a[m][0];
      for (int j = 1; j < NA; ++j) s = _mm256_add_ps(s, a[m][j]);
      y[m * ldy + n] = hsum(s);
    }
  }
}

// ---- AVX-512: one block -> 2 x 16 fp32 (same values) ------------------------------------------

#define SPECSPLIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

// One block -> 2 x 16 fp32, given its scales. A 4-bit block has 16 distinct values:
// table[q] = the dequantized value of q (one mul, one add: the same roundings as the per-weight
// formula), and vpermps picks each weight's entry by its nibble (it reads only the low 4 bits of
// each 32-bit index, so the low nibble needs no mask).
template <int64_t T>
SPECSPLIT_AVX512 inline __m512 dequant_table(float dv, float mv) {  // 4-bit: table[q], q = 0..15
  const __m512 d = _mm512_set1_ps(dv);
  if constexpr (T == Q4_0)
    return _mm512_mul_ps(d, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
  return _mm512_add_ps(_mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                       _mm512_set1_ps(mv));
}

template <int64_t T>
SPECSPLIT_AVX512 inline void dequant16x2(const uint8_t* qs, float dv, float mv, __m512 w[2]) {
  if constexpr (T == Q8_0) {
    const __m512 d = _mm512_set1_ps(dv);
    for (int j = 0; j < 2; ++j) {
      const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * j));
      w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)));
    }
  } else {
    const __m512 table = dequant_table<T>(dv, mv);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w[0] = _mm512_permutexvar_ps(q, table);                        // weights 0..15: low nibbles
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);  // weights 16..31: high nibbles
  }
}

template <int64_t T, int MP>
SPECSPLIT_AVX512 void rows_avx512(const float* x, int64_t K, const uint8_t* blocks, int64_t n0, int64_t n1, float* y,
                                  int64_t ldy) {
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T), QB = quant_bytes(T), NS = scale_halves(T);
  std::vector<float> sc(nb * NS);  // the row's scales in fp32: d (, m) per block
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    prefetch_ahead(row, row_bytes);
    row_scales<T>(row, nb, sc.data());
    __m512 a0[MP], a1[MP];
    for (int m = 0; m < MP; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    int64_t b = 0;
    if constexpr (MP == 1) {  // one x row: two blocks per iteration, 4 independent FMA chains
      __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
      for (; b + 2 <= nb; b += 2) {
        __m512 w[2], v[2];
        dequant16x2<T>(row + b * QB, sc[b * NS], sc[b * NS + NS - 1], w);
        dequant16x2<T>(row + (b + 1) * QB, sc[(b + 1) * NS], sc[(b + 1) * NS + NS - 1], v);
        const float* xb = x + b * QK;
        a0[0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), a0[0]);
        a1[0] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), a1[0]);
        c0 = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(xb + 32), c0);
        c1 = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xb + 48), c1);
      }
      a0[0] = _mm512_add_ps(a0[0], c0);
      a1[0] = _mm512_add_ps(a1[0], c1);
    }
    for (; b < nb; ++b) {
      __m512 w[2];
      dequant16x2<T>(row + b * QB, sc[b * NS], sc[b * NS + NS - 1], w);
      const float* xb = x + b * QK;
      for (int m = 0; m < MP; ++m) {
        a0[m] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb + m * K), a0[m]);
        a1[m] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + m * K + 16), a1[m]);
      }
    }
    for (int m = 0; m < MP; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

// Two output rows at a time for 4+ x rows: each x load feeds both rows' FMAs, halving the loads
// that bound the single-row loop there (one accumulator per output row and x row: the FMAs of a
// block, 4 per x row, already outnumber an FMA's latency).
template <int64_t T, int MP>
SPECSPLIT_AVX512 void row_pairs_avx512(const float* x, int64_t K, const uint8_t* blocks, int64_t n0, int64_t n1,
                                       float* y, int64_t ldy) {
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T), QB = quant_bytes(T), NS = scale_halves(T);
  std::vector<float> sc(2 * nb * NS);  // the two rows' scales in fp32
  float* s0 = sc.data();
  float* s1 = s0 + nb * NS;
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* r0 = blocks + n * row_bytes;
    const uint8_t* r1 = r0 + row_bytes;
    prefetch_ahead(r0, 2 * row_bytes);
    row_scales<T>(r0, nb, s0);
    row_scales<T>(r1, nb, s1);
    __m512 a0[MP], a1[MP];
    for (int m = 0; m < MP; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w[2], v[2];
      dequant16x2<T>(r0 + b * QB, s0[b * NS], s0[b * NS + NS - 1], w);
      dequant16x2<T>(r1 + b * QB, s1[b * NS], s1[b * NS + NS - 1], v);
      const float* xb = x + b * QK;
      for (int m = 0; m < MP; ++m) {
        const __m512 xlo = _mm512_loadu_ps(xb + m * K), xhi = _mm512_loadu_ps(xb + m * K + 16);
        a0[m] = _mm512_fmadd_ps(w[1], xhi, _mm512_fmadd_ps(w[0], xlo, a0[m]));
        a1[m] = _mm512_fmadd_ps(v[1], xhi, _mm512_fmadd_ps(v[0], xlo, a1[m]));
      }
    }
    for (int m = 0; m < MP; ++m) {
      y[m * ldy + n] = _mm512_reduce_add_ps(a0[m]);
      y[m * ldy + n + 1] = _mm512_reduce_add_ps(a1[m]);
    }
  }
  if (n < n1) rows_avx512<T, MP>(x, K, blocks, n, n1, y, ldy);
}

bool use_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

// x rows per pass over a weight row: AVX2 has 16 ymm registers (4 weights + 2 x 4 accumulators),
// AVX-512 32 zmm (2 weights + the table + 2 x 8 accumulators)
constexpr int MAX_PASS_AVX2 = 4, MAX_PASS_AVX512 = 8;

template <int64_t T, int MP>
void pass(const float* x, int64_t K, const uint8_t* blocks, int64_t N, float* y, bool avx512) {
  // grain: at least 64 output rows per task, so one thread is a plain loop
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (avx512) {
      if constexpr (MP < 4)  // measured: pairs pay from 4 x rows on, cost ~15% at 2-3
        rows_avx512<T, MP>(x, K, blocks, n0, n1, y, N);
      else
        row_pairs_avx512<T, MP>(x, K, blocks, n0, n1, y, N);
    } else if constexpr (MP <= MAX_PASS_AVX2) {
      rows_avx2<T, MP>(x, K, blocks, n0, n1, y, N);
    }
  });
}

template <int64_t T>
void run(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t N, float* y, bool avx512) {
  const int64_t max_pass = avx512 ? MAX_PASS_AVX512 : MAX_PASS_AVX2;
  for (int64_t m0 = 0; m0 < M; m0 += max_pass) {
    const float* xs = x + m0 * K;
    float* ys = y + m0 * N;
    switch (std::min<int64_t>(max_pass, M - m0)) {
      case 1: pass<T, 1>(xs, K, blocks, N, ys, avx512); break;
      case 2: pass<T, 2>(xs, K, blocks, N, ys, avx512); break;
      case 3: pass<T, 3>(xs, K, blocks, N, ys, avx512); break;
      case 4: pass<T, 4>(xs, K, blocks, N, ys, avx512); break;
      case 5: pass<T, 5>(xs, K, blocks, N, ys, avx512); break;
      case 6: pass<T, 6>(xs, K, blocks, N, ys, avx512); break;
      case 7: pass<T, 7>(xs, K, blocks, N, ys, avx512); break;
      default: pass<T, 8>(xs, K, blocks, N, ys, avx512); break;
    }
  }
}

// ---- The greedy token of a Q8_0 head without every logit (AVX-512 VNNI, or AVX2) --------------
//
// A greedy step with nothing else asked of it (no logprobs, penalties, grammar, sampling) needs
// only argmax_n y[m, n] of y = x @ W^T. The exact y of SmolLM2's 49152-row head costs 1.8 ms at
// one x row and 2.3 ms at two here (an int8 -> fp32 conversion per weight); this finds the same
// ids from a bound computed at the speed of reading the weights once:
//
//   1. x's blocks are quantized to int8, s = max|x_b| / 127, xq = round(x / s): |x - s xq| <= s/2
//      (plus fp32 rounding of x / s, a few ulps of 127 s). Per output row n and x row m,
//        a[m, n] = sum_b d_nb s_mb sum_j q_nbj xq_mbj   (the int8 dot products exact: VPDPBUSD,
//                                                         or VPMADDUBSW + VPMADDWD without VNNI)
//        e[m, n] = C_n / 2 sum_b |d_nb| s_mb            (C_n = max_b sum_j |q_nbj|)
//      so |y - a| <= e in exact arithmetic. BOUND_SLACK (5%) covers the rounding: of the computed
//      y (K + 2 ulps of sum |w x| <= 254 e: 0.9% of e at K = 576), of a (~0.01%) and of xq.
//      The weights are read from a copy made for this (GreedyGroups below: 16 output rows
//      interleaved 4 bytes at a time, so one VPDPBUSD takes 4 weights of 16 rows and the scales
//      and bounds stay per row in vector lanes, with no horizontal sums).
//   2. Every row whose a + e reaches lo = max_n (a - e) may hold the maximum (the true maximum's
//      row always does); those rows' y are computed from the split rows by the very loop
//      quant_linear runs (for up to 3 x rows each output row's bits do not depend on the other
//      rows), and the first maximum among them, in row order, is the id torch's max(dim=-1)
//      gives on the whole y.
// Measured on SmolLM2's head over held-out chat positions: 10 candidate rows per x row in the
// median, 54 at the 90th percentile, 223 at most. Where it cannot answer (x not finite or nearly
// subnormal, a bound not finite, more than GREEDY_MAX_CANDIDATES rows) it returns nothing and the
// caller computes y.
// Without AVX-512 VNNI (an AVX2-only CPU, or SPECSPLIT_QUANT_AVX512=0) the bound pass runs the
// AVX2 int8 loop's dot products (greedy_bounds_avx2); the exact rows then run the loop
// quant_linear runs there (rows_avx2, or rows_avx512 on an AVX-512 CPU without VNNI).
constexpr int GREEDY_MAX_ROWS = 3;  // rows_avx512's passes (4+ rows pair output rows: bits shift)
// a head in the tiles layout: within the AMX loop's one pass (AMX_KPIECES_TOKENS), whose rows' bits
// do not depend on how many rows it holds
constexpr int GREEDY_MAX_ROWS_TILES = 5;
constexpr int64_t GREEDY_MAX_CANDIDATES = 4096;
constexpr float BOUND_SLACK = 1.05f;

// GreedyGroups: per group of 16 output rows (the last one padded with zero rows), per block b:
//   512 bytes: chunk c (0..7) = 16 rows x 4 bytes, byte (c, r, t) = q[16g + r][32b + 4c + t] + 128
//   32 bytes:  the 16 rows' d (fp16)
constexpr int64_t GROUP_ROWS = 16, GROUP_BLOCK_BYTES = 512 + 32;

// the group's block bytes PREFETCH_BYTES ahead (the copy is read once, in order)
inline void prefetch_group_block(const uint8_t* bp) {
  for (int64_t o = 0; o < GROUP_BLOCK_BYTES; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(bp + PREFETCH_BYTES + o), _MM_HINT_T0);
}

#define SPECSPLIT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

bool use_vnni() {
  static const bool yes = use_avx512() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// x's rows as int8 blocks, with what the group loop broadcasts per block
struct QuantX {
  std::vector<int8_t> q;      // [M][K]
  std::vector<int32_t> corr;  // [M][nb]: -128 * the block's sum of xq (W's quants go in as q + 128)
  std::vector<float> scale;   // [M][nb]: the block's s
  std::vector<uint8_t> ok;    // [M]: false where the row could not be quantized (quantize_row)
};

// One x row's blocks as int8: xq = round(x / s) (to nearest even, as nearbyint), s = max|x_b| / 127
// (an all-zero block: xq = 0, s = 0, exact). false where a value is not finite, or a block's
// largest is nearly subnormal (127 / it overflows) unless tiny_as_zero (then that block counts as
// zeros: int8_linear's approximation may drop < 1e-30 per weight; greedy's bound may not).
// AVX2, for both the VNNI and the AVX2 loops (the same xq and s on every CPU).
bool quantize_row(const float* x, int64_t K, int8_t* q, int32_t* corr, float* scale, bool tiny_as_zero) {
  const int64_t nb = K / QK;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4], bad = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 z = _mm256_sub_ps(v[i], v[i]);  // NaN where v is NaN or +-inf
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
    }
    if (_mm256_movemask_ps(bad)) return false;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
    if (amax < 1e-30f && !(amax == 0.f || tiny_as_zero)) return false;
    if (amax < 1e-30f) {  // zero (exact), or tiny and allowed to count as zero
      std::memset(q + b * QK, 0, QK);
      corr[b] = 0;
      scale[b] = 0.f;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(127.f / amax);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    alignas(32) int32_t qi[QK];
    for (int i = 0; i < 4; ++i)
      _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * i),
                         _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)))));
    int32_t sum = 0;
    for (int j = 0; j < QK; ++j) {
      q[b * QK + j] = static_cast<int8_t>(qi[j]);
      sum += qi[j];
    }
    corr[b] = -128 * sum;
    scale[b] = amax / 127.f;
  }
  return true;
}

// x's rows as int8 (quantize_row); ok[m] = false: row m could not be (the caller decides what
// that row gives: greedy no answer, int8_linear NaN)
void quantize_x(const float* x, int64_t M, int64_t K, QuantX& r, bool tiny_as_zero) {
  const int64_t nb = K / QK;
  r.q.resize(M * K);
  r.corr.resize(M * nb);
  r.scale.resize(M * nb);
  r.ok.resize(M);
  for (int64_t m = 0; m < M; ++m)
    r.ok[m] = quantize_row(x + m * K, K, r.q.data() + m * K, r.corr.data() + m * nb, r.scale.data() + m * nb,
                          tiny_as_zero);
}

// a, e [M, N] (row stride N) for groups g0..g1; cmax [N]
template <int MP>
SPECSPLIT_VNNI void greedy_bounds(const QuantX& xq, int64_t K, const uint8_t* groups, const float* cmax, int64_t g0,
                                  int64_t g1, float* a, float* e, int64_t N) {
  const int64_t nb = K / QK, group_bytes = nb * GROUP_BLOCK_BYTES;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = groups + g * group_bytes;
    __m512 acc[MP], err[MP];
    for (int m = 0; m < MP; ++m) acc[m] = err[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bp = gp + b * GROUP_BLOCK_BYTES;
      prefetch_group_block(bp);
      __m512i w[8];
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(bp + 64 * c);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 512)));
      const __m512 dabs = _mm512_abs_ps(d);
      for (int m = 0; m < MP; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(xq.q.data() + m * K + b * QK);
        __m512i dot = _mm512_set1_epi32(xq.corr[m * nb + b]);
        for (int c = 0; c < 8; ++c) dot = _mm512_dpbusd_epi32(dot, w[c], _mm512_set1_epi32(x4[c]));
        const __m512 s = _mm512_set1_ps(xq.scale[m * nb + b]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, s), acc[m]);
        err[m] = _mm512_fmadd_ps(dabs, s, err[m]);
      }
    }
    const int64_t n = g * GROUP_ROWS, rows = std::min<int64_t>(GROUP_ROWS, N - n);
    const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1u);
    const __m512 c = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, cmax + n), _mm512_set1_ps(0.5f * BOUND_SLACK));
    for (int m = 0; m < MP; ++m) {
      _mm512_mask_storeu_ps(a + m * N + n, keep, acc[m]);
      _mm512_mask_storeu_ps(e + m * N + n, keep, _mm512_mul_ps(err[m], c));
    }
  }
}

// ---- x @ W^T with x rounded to int8 too (AVX-512 VNNI, or AVX2): a drafter's linears ---------
//
// A drafter's numbers only choose which tokens are proposed (the target verifies every one, so
// they never decide what is kept), so its Q8_0 linears may round x as well: y[m, n] = a[m, n] of
// the greedy bound above (llama.cpp's Q8_0 x Q8_0 dot product: |y_exact - a| <= e there), read from
// the same 16-row copy. One VPDPBUSD multiplies 64 weight-activation pairs exactly, where the fp32
// loop spends a conversion and an FMA per 16 weights; the drafter's step then reads its weights at
// about memory speed. Rows of x go 4 at a time over each group of 16 output rows (the group's
// bytes, 18-48 blocks x 544, stay in L1 for the next pass).
// Without VNNI the AVX2 loop (int8_group_avx2) gets the same integer dot products from VPMADDUBSW
// (|q| times x with q's sign, pairs summed in 16 bits: at most 2 x 128 x 127, no saturation) and
// VPMADDWD, and does the same float operations per output row, so its y is the VNNI loop's, bit
// for bit.
template <int MP>
SPECSPLIT_VNNI inline void int8_group(const QuantX& xq, int64_t m0, int64_t K, const uint8_t* gp, int64_t n,
                                      int64_t rows, float* y, int64_t N) {
  const int64_t nb = K / QK;
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1u);
  __m512 acc[MP];
  for (int m = 0; m < MP; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * GROUP_BLOCK_BYTES;
    if (m0 == 0) prefetch_group_block(bp);
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(bp + 64 * c);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 512)));
    for (int m = 0; m < MP; ++m) {
      const int64_t r = m0 + m;
      const int32_t* x4 = reinterpret_cast<const int32_t*>(xq.q.data() + r * K + b * QK);
      __m512i dot = _mm512_set1_epi32(xq.corr[r * nb + b]);
      for (int c = 0; c < 8; ++c) dot = _mm512_dpbusd_epi32(dot, w[c], _mm512_set1_epi32(x4[c]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(xq.scale[r * nb + b])), acc[m]);
    }
  }
  for (int m = 0; m < MP; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n, keep, acc[m]);
}

// One block's integer dot products for rows m0.. of x and the group's 16 output rows, the AVX2 way:
// dot[m][0] rows 0-7, dot[m][1] rows 8-15; bp: the group's block
template <int MP>
inline void block_dots_avx2(const QuantX& xq, int64_t m0, int64_t K, int64_t b, const uint8_t* bp, __m256i dot[MP][2]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MP; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    __m256i w[2], a[2];  // q (signed: the stored q + 128 with its top bit flipped) and |q|
    for (int h = 0; h < 2; ++h) {
      w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 64 * c + 32 * h)), flip);
      a[h] = _mm256_sign_epi8(w[h], w[h]);  // -128 stays 0x80: 128 as the unsigned operand
    }
    for (int m = 0; m < MP; ++m) {
      const int32_t* x4 = reinterpret_cast<const int32_t*>(xq.q.data() + (m0 + m) * K + b * QK);
      const __m256i xb = _mm256_set1_epi32(x4[c]);
      for (int h = 0; h < 2; ++h)
        dot[m][h] = _mm256_add_epi32(dot[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(a[h], _mm256_sign_epi8(xb, w[h])), ones));
    }
  }
}

// the 16 rows' fp16 d of a group's block, as fp32 (rows 0-7, 8-15)
inline void block_scales_avx2(const uint8_t* bp, __m256 d[2]) {
  d[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 512)));
  d[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 528)));
}

// 16 lanes (rows 0-7, 8-15) -> out[0 .. rows)
inline void store_rows_avx2(const __m256 v[2], int64_t rows, float* out) {
  alignas(32) float tmp[GROUP_ROWS];
  _mm256_store_ps(tmp, v[0]);
  _mm256_store_ps(tmp + 8, v[1]);
  std::memcpy(out, tmp, rows * sizeof(float));
}

template <int MP>
inline void int8_group_avx2(const QuantX& xq, int64_t m0, int64_t K, const uint8_t* gp, int64_t n, int64_t rows,
                            float* y, int64_t N) {
  const int64_t nb = K / QK;
  __m256 acc[MP][2];  // output rows 0-7 and 8-15 of the group
  for (int m = 0; m < MP; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * GROUP_BLOCK_BYTES;
    if (m0 == 0) prefetch_group_block(bp);
    __m256i dot[MP][2];
    block_dots_avx2<MP>(xq, m0, K, b, bp, dot);
    __m256 d[2];
    block_scales_avx2(bp, d);
    for (int m = 0; m < MP; ++m) {
      const __m256 sv = _mm256_set1_ps(xq.scale[(m0 + m) * nb + b]);
      for (int h = 0; h < 2; ++h)
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][h]), _mm256_mul_ps(d[h], sv), acc[m][h]);
    }
  }
  for (int m = 0; m < MP; ++m) store_rows_avx2(acc[m], rows, y + (m0 + m) * N + n);
}

// greedy_bounds without VNNI: the same a and e per output row, the dot products from
// block_dots_avx2 (the integers are the same; the float operations per row are the same too)
template <int MP>
void greedy_bounds_avx2(const QuantX& xq, int64_t K, const uint8_t* groups, const float* cmax, int64_t g0, int64_t g1,
                        float* a, float* e, int64_t N) {
  const int64_t nb = K / QK, group_bytes = nb * GROUP_BLOCK_BYTES;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = groups + g * group_bytes;
    __m256 acc[MP][2], err[MP][2];
    for (int m = 0; m < MP; ++m) acc[m][0] = acc[m][1] = err[m][0] = err[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bp = gp + b * GROUP_BLOCK_BYTES;
      prefetch_group_block(bp);
      __m256i dot[MP][2];
      block_dots_avx2<MP>(xq, 0, K, b, bp, dot);
      __m256 d[2];
      block_scales_avx2(bp, d);
      for (int m = 0; m < MP; ++m) {
        const __m256 s = _mm256_set1_ps(xq.scale[m * nb + b]);
        for (int h = 0; h < 2; ++h) {
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][h]), _mm256_mul_ps(d[h], s), acc[m][h]);
          err[m][h] = _mm256_fmadd_ps(_mm256_and_ps(d[h], absmask), s, err[m][h]);
        }
      }
    }
    const int64_t n = g * GROUP_ROWS, rows = std::min<int64_t>(GROUP_ROWS, N - n);
    alignas(32) float cm[GROUP_ROWS] = {};
    std::memcpy(cm, cmax + n, rows * sizeof(float));
    const __m256 half = _mm256_set1_ps(0.5f * BOUND_SLACK);
    const __m256 c[2] = {_mm256_mul_ps(_mm256_load_ps(cm), half), _mm256_mul_ps(_mm256_load_ps(cm + 8), half)};
    for (int m = 0; m < MP; ++m) {
      const __m256 ev[2] = {_mm256_mul_ps(err[m][0], c[0]), _mm256_mul_ps(err[m][1], c[1])};
      store_rows_avx2(acc[m], rows, a + m * N + n);
      store_rows_avx2(ev, rows, e + m * N + n);
    }
  }
}

// One pass of rows m0.. of x over a group: the VNNI loop or the AVX2 one (the same arguments)
template <bool VNNI, int MP>
__attribute__((always_inline)) inline void int8_pass(const QuantX& xq, int64_t m0, int64_t K, const uint8_t* gp,
                                                     int64_t n, int64_t rows, float* y, int64_t N) {
  if constexpr (VNNI)
    int8_group<MP>(xq, m0, K, gp, n, rows, y, N);
  else
    int8_group_avx2<MP>(xq, m0, K, gp, n, rows, y, N);
}

// The groups g0..g1, x rows in passes of up to 4. Inlined into the two functions below, so the
// VNNI one is built for AVX-512 and the AVX2 one (which an AVX2-only CPU runs) is not.
template <bool VNNI>
__attribute__((always_inline)) inline void int8_groups(const QuantX& xq, int64_t M, int64_t K, const uint8_t* groups,
                                                       int64_t g0, int64_t g1, float* y, int64_t N) {
  const int64_t group_bytes = K / QK * GROUP_BLOCK_BYTES;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = groups + g * group_bytes;
    const int64_t n = g * GROUP_ROWS, rows = std::min<int64_t>(GROUP_ROWS, N - n);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: int8_pass<VNNI, 1>(xq, m0, K, gp, n, rows, y, N); break;
        case 2: int8_pass<VNNI, 2>(xq, m0, K, gp, n, rows, y, N); break;
        case 3: int8_pass<VNNI, 3>(xq, m0, K, gp, n, rows, y, N); break;
        default: int8_pass<VNNI, 4>(xq, m0, K, gp, n, rows, y, N); break;
      }
    }
  }
}

SPECSPLIT_VNNI void int8_groups_vnni(const QuantX& xq, int64_t M, int64_t K, const uint8_t* groups, int64_t g0, int64_t g1,
                                     float* y, int64_t N) {
  int8_groups<true>(xq, M, K, groups, g0, g1, y, N);
}

void int8_groups_avx2(const QuantX& xq, int64_t M, int64_t K, const uint8_t* groups, int64_t g0, int64_t g1, float* y,
                      int64_t N) {
  int8_groups<false>(xq, M, K, groups, g0, g1, y, N);
}

// y [M, N] for x [M, K] (M any) and the 16-row copy of a Q8_0 W [N, K]; a row of x that is not
// finite gives NaN
void int8_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* groups, int64_t N, float* y, bool vnni) {
  QuantX xq;
  quantize_x(x, M, K, xq, true);
  at::parallel_for(0, (N + GROUP_ROWS - 1) / GROUP_ROWS, 4, [&](int64_t g0, int64_t g1) {
    if (vnni)
      int8_groups_vnni(xq, M, K, groups, g0, g1, y, N);
    else
      int8_groups_avx2(xq, M, K, groups, g0, g1, y, N);
  });
  for (int64_t m = 0; m < M; ++m)
    if (!xq.ok[m]) std::fill(y + m * N, y + (m + 1) * N, std::numeric_limits<float>::quiet_NaN());
}

// max_n (a - e) of one x row; false where an a or e is not finite (AVX2, for both loops)
bool lower_bound(const float* a, const float* e, int64_t N, float* lo) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), bad = _mm256_setzero_ps();
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const __m256 av = _mm256_loadu_ps(a + n), ev = _mm256_loadu_ps(e + n);
    const __m256 za = _mm256_sub_ps(av, av), ze = _mm256_sub_ps(ev, ev);  // NaN where NaN or +-inf
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(za, za, _CMP_UNORD_Q), _mm256_cmp_ps(ze, ze, _CMP_UNORD_Q)));
    best = _mm256_max_ps(best, _mm256_sub_ps(av, ev));
  }
  if (_mm256_movemask_ps(bad)) return false;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float out = *std::max_element(lanes, lanes + 8);
  for (; n < N; ++n) {
    if (!std::isfinite(a[n]) || !std::isfinite(e[n])) return false;
    out = std::max(out, a[n] - e[n]);
  }
  *lo = out;
  return true;
}

// the rows n where a[m, n] + e[m, n] >= lo[m] for some m, in order (AVX2, for both loops)
template <int MP>
void candidates(const float* a, const float* e, const float* lo, int64_t N, std::vector<int64_t>& rows) {
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    __m256 hit = _mm256_setzero_ps();
    for (int m = 0; m < MP; ++m)
      hit = _mm256_or_ps(hit, _mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(a + m * N + n), _mm256_loadu_ps(e + m * N + n)),
                                            _mm256_set1_ps(lo[m]), _CMP_GE_OQ));
    for (unsigned bits = _mm256_movemask_ps(hit); bits; bits &= bits - 1) rows.push_back(n + __builtin_ctz(bits));
  }
  for (; n < N; ++n) {
    bool maybe = false;
    for (int m = 0; m < MP; ++m) maybe |= a[m * N + n] + e[m * N + n] >= lo[m];
    if (maybe) rows.push_back(n);
  }
}

// The greedy ids of MP rows of x: the bound pass (VNNI, or the AVX2 loop where vnni is false),
// the candidate rows, their exact y by `exact(rows, y)` (y [MP, rows.size()]: the loop quant_linear
// itself runs on the weights' layout here, so y has its bits), the first maximum. Empty where it
// cannot answer.
template <int MP, typename Exact>
torch::Tensor greedy_rows(const float* x, int64_t K, const uint8_t* groups, const float* cmax, int64_t N, bool vnni,
                          Exact exact) {
  const auto none = torch::empty({0}, torch::kLong);
  QuantX xq;
  quantize_x(x, MP, K, xq, false);
  for (int m = 0; m < MP; ++m)
    if (!xq.ok[m]) return none;
  // a, e [MP, N]: every entry written below. Kept per thread between calls: at SmolLM2's 49,152
  // rows each is 192 KB a row, which malloc maps fresh and the kernel zeroes page by page on every
  // call (seen in perf as clear_page, ~1.6% of a decode step on the AMX Xeon).
  thread_local std::vector<float> a_buf, e_buf;
  a_buf.resize(std::max<size_t>(a_buf.size(), MP * N));
  e_buf.resize(std::max<size_t>(e_buf.size(), MP * N));
  float* a = a_buf.data();
  float* e = e_buf.data();
  at::parallel_for(0, (N + GROUP_ROWS - 1) / GROUP_ROWS, 4, [&](int64_t g0, int64_t g1) {
    if (vnni)
      greedy_bounds<MP>(xq, K, groups, cmax, g0, g1, a, e, N);
    else
      greedy_bounds_avx2<MP>(xq, K, groups, cmax, g0, g1, a, e, N);
  });
  float lo[MP];
  for (int m = 0; m < MP; ++m)
    if (!lower_bound(a + m * N, e + m * N, N, lo + m)) return none;
  std::vector<int64_t> rows;  // the candidates, in row order
  candidates<MP>(a, e, lo, N, rows);
  if (static_cast<int64_t>(rows.size()) > GREEDY_MAX_CANDIDATES) return none;
  const int64_t C = rows.size();
  std::vector<float> y(MP * C);
  exact(rows, y.data());
  auto ids = torch::empty({MP}, torch::kLong);
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int m = 0; m < MP; ++m) {  // torch's max(dim=-1): the first maximum, a NaN counted as one
    int64_t best = 0;
    for (int64_t c = 1; c < C; ++c) {
      const float v = y[m * C + c], b = y[m * C + best];
      if (!std::isnan(b) && (std::isnan(v) || v > b)) best = c;
    }
    ip[m] = rows[best];
  }
  return ids;
}

// greedy_rows' exact rows from split rows: the candidates' rows gathered, quant_linear's loop over
// them (exact_avx512: the one quant_linear runs here; for up to 3 x rows each output row's bits do
// not depend on the other rows)
template <int MP>
torch::Tensor greedy_split_rows(const float* x, int64_t K, const uint8_t* blocks, const uint8_t* groups,
                                const float* cmax, int64_t N, bool vnni, bool exact_avx512) {
  return greedy_rows<MP>(x, K, groups, cmax, N, vnni, [&](const std::vector<int64_t>& rows, float* y) {
    const int64_t row_bytes = K / QK * block_bytes(Q8_0), C = rows.size();
    std::vector<uint8_t> picked(C * row_bytes);
    for (int64_t c = 0; c < C; ++c) std::memcpy(picked.data() + c * row_bytes, blocks + rows[c] * row_bytes, row_bytes);
    run<Q8_0>(x, MP, K, picked.data(), C, y, exact_avx512);
  });
}

// one row of blocks -> K fp32 (scalar, the same arithmetic as the vector paths; tests compare)
template <int64_t T>
void dequant_row(const uint8_t* row, int64_t K, float* out) {
  const int64_t nb = K / QK, QB = quant_bytes(T), NS = scale_halves(T);
  const uint8_t* scales = row + nb * QB;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * QB;
    const float d = half_to_float(scales + 2 * NS * b);
    float* o = out + b * QK;
    if constexpr (T == Q8_0) {
      for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(static_cast<int8_t>(p[j]));
    } else if constexpr (T == Q4_0) {
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>((p[j] & 0x0F) - 8);
        o[j + 16] = d * static_cast<float>((p[j] >> 4) - 8);
      }
    } else {
      const float m = half_to_float(scales + 2 * NS * b + 2);
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(p[j] & 0x0F) + m;
        o[j + 16] = d * static_cast<float>(p[j] >> 4) + m;
      }
    }
  }
}

// one split row -> K fp32 with the AVX2 dequantizer (the same values as dequant_row)
template <int64_t T>
void dequant_row_avx2(const uint8_t* row, int64_t K, float* out, float* sc) {
  const int64_t nb = K / QK, QB = quant_bytes(T), NS = scale_halves(T);
  row_scales<T>(row, nb, sc);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    dequant8x4<T>(row + b * QB, sc[b * NS], sc[b * NS + NS - 1], w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * QK + 8 * j, w[j]);
  }
}


// ---- AMX: quantized weights as bf16 tiles, fp32 x as three bf16 pieces ------------------------
//
// Where the CPU has AMX-BF16 (Intel Sapphire Rapids and later), Q4_0 / Q4_1 / Q8_0 weights are kept in a
// tile layout (kernels/quant_linear.py `to_amx`, at load) and multiplied on the tile unit:
//   * x [T, K] fp32 is split into three bf16 pieces per value, hi + mid + lo == x exactly (each
//     piece carries 8 of the 24 significant bits), one tile row per (token, piece).
//   * a block's 4-bit quant q (0..15) goes in as the bf16 of 16 + q, whose bits are 0x4180 | q << 3
//     (16 + q < 32: exponent 4, q in the mantissa's top 4 bits), so a shift and one bit-select turn
//     a 16-bit word of 4 nibbles into 4 tile entries, with no table lookup (the lookup it replaced,
//     vpermw after a widening, was half of the loop's time at one token). Q8_0 converts its int8.
//   * the tile unit multiplies bf16 pairs exactly and adds in fp32, so per block and output row
//     S' = sum_k x_k w'_k comes out with fp32 rounding only (w' = 16 + q, or Q8_0's q).
//   * y = sum_blocks d * S' + c * sum_k x_k: the dequantized weight d*q + m (Q4_1) = d*(16 + q) +
//     (m - 16 d), so c = m - 16 d (one rounding), and d*(q - 8) (Q4_0) = d*(16 + q) - 24 d, so
//     c = -24 d (exact); Q8_0 has no c. The same function as the dense fp32 path within fp32
//     rounding: measured against a float64 product, 2-6e-8 of sum |x||w| (the AVX-512 loop 1.5-3e-8);
//     the offset's larger S' roughly doubles the rounding of the 4-bit types (tests: within 1e-6).
// Two arrangements of the pieces, with the same bits on this Xeon (equal for 1 to 16 tokens of Q4_1
// and Q8_0; the manual does not promise that C += hi.w; C += mid.w; C += lo.w rounds as (hi.w +
// mid.w) + lo.w does, so the tests hold it: a 45-row call's rows against single rows):
//   * rows (amx_groups): the pieces are tile rows, 3 per token, so one pass holds 5 tokens; a pass
//     stores 3 product rows per token and adds them.
//   * along K (amx_groups_kpieces): three tiles hold the hi, mid and lo pieces of up to 16 tokens,
//     one row per token, and three products accumulate into one tile (the same weights tile each
//     time), so one pass holds 16 tokens and stores one row per token.
// Measured on the Xeon (one thread, the default target's weights streamed in model order, the two
// arrangements alternating in one process, medians of 21-25), along K against rows: the 4-bit
// layers' linears 1.07-1.11x at 1 row, 1.04-1.10x at 2, 0.97-1.02x at 3 to 5; past 5 rows, where
// rows took a second pass over all the weights, 14.7 -> 10.6 ms at 8 rows and 25.1 -> 14.2 at 16;
// the Q8_0 head (its conversion costs more) 0.96-0.97x at 1 row, 0.90-0.92x at 3 to 5, 0.70x at
// 8, 0.67x at 16. So the 4-bit types keep rows up to AMX_TOKENS tokens and every other call goes
// along K, in passes of AMX_KPIECES_TOKENS.
//
// Tile layout per group of 16 output rows g and block b (GB bytes, the file's bytes regrouped);
// tile row i, entry j = the quant of output row 16g + j/2 at k = 32b + 2i + j%2 (the bf16 pair
// layout the tile unit reads for its second operand):
//   4-bit: 256 bytes of nibbles, chunk c (0..3) of 64 bytes = 32 16-bit words, word j holding entry
//     j of tile rows c, c + 4, c + 8, c + 12 in its nibbles 0..3 (bits 0-3, 4-7, 8-11, 12-15);
//     Q8_0: 512 bytes, tile row i = bytes 32i..32i+31
//   then 32 bytes: the 16 rows' fp16 d; Q4_1 then 32 bytes: their fp16 m.
// blocks [N/16, K/32 * GB] uint8 (GB = 16 * the file's block bytes: 288 Q4_0, 320 Q4_1, 544 Q8_0).
// Q8_0's quants are exact in bf16 too (|q| <= 128); converting them costs about twice a nibble's.
inline int64_t amx_group_bytes(int64_t t) { return 16 * block_bytes(t); }  // 288, 320, 544
inline int64_t amx_quant_bytes(int64_t t) { return t == Q8_0 ? 512 : 256; }  // then the fp16 d (, m)

#if defined(__GNUC__) && (__GNUC__ >= 11 || (defined(__clang_major__) && __clang_major__ >= 12))
#define SPECSPLIT_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define SPECSPLIT_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

constexpr int AMX_TOKENS = 5;  // tokens per pass in rows: 3 pieces each fill 15 of a tile's 16 rows
constexpr int AMX_KPIECES_TOKENS = 16;  // tokens per pass along K: a tile's 16 rows
// Bytes ahead of the pair of blocks a loop iteration starts (measured on the Xeon, gate_up 3072 x
// 576 at one token: 1 KB 112 us, 2 KB 96, 4 KB 85, 8 KB 86).
constexpr int64_t AMX_PREFETCH = 4096;


// AMX needs the CPU flags and, on Linux, the kernel's permission for this process to use the tile
// data (asked once; refused on kernels before 5.16)
bool amx_ready() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16") || !use_avx512())
      return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x [T, K] fp32 -> pieces [K/32][3T][32] bf16 and sums [T][K/32] (sum of x over each block, fp32,
// for Q4_1's m). In rows (along_k false) a block's rows 3t, 3t+1, 3t+2 are the hi, mid, lo of
// token t; along K, rows pT + t (the hi of every token, then the mid, then the lo).
template <bool along_k>
SPECSPLIT_AMX void amx_split_x(const float* x, int64_t T, int64_t K, uint16_t* pieces, float* sums) {
  const int64_t nb = K / QK;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      __m512 s = _mm512_setzero_ps();
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_loadu_ps(x + t * K + b * QK + 16 * h);
        s = _mm512_add_ps(s, v);
        for (int p = 0; p < 3; ++p) {  // v - piece is exact: the piece is v rounded to 8 bits
          const __m256i piece = (__m256i)_mm512_cvtneps_pbh(v);
          const int64_t row = b * 3 * T + (along_k ? p * T + t : 3 * t + p);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pieces + row * QK + 16 * h), piece);
          v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(piece), 16)));
        }
      }
      sums[t * nb + b] = _mm512_reduce_add_ps(s);
    }
}

// one (group, block) of quants -> the 16 x 32 bf16 tile rows. 4-bit: bf16(16 + q) = 0x4180 | q << 3,
// four tile rows per 64-byte chunk (a shift and a bit-select each); Q8_0: int8 -> fp32 -> bf16
// (exact: |q| <= 128 fits bf16's 8 significant bits)
template <int64_t T>
SPECSPLIT_AMX inline void amx_convert(const uint8_t* nib, uint16_t* tile) {
  if constexpr (T == Q8_0) {
    for (int i = 0; i < 16; ++i) {
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + 32 * i))));
      const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + 32 * i + 16))));
      _mm512_store_si512(tile + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // a: entries 0..15, b: 16..31
    }
    return;
  }
  const __m512i mask = _mm512_set1_epi16(0x78), exponent = _mm512_set1_epi16(0x4180);
  constexpr int SELECT = 0xEA;  // ternary logic: (shifted & mask) | exponent
  for (int c = 0; c < 4; ++c) {
    const __m512i w = _mm512_loadu_si512(nib + 64 * c);
    _mm512_store_si512(tile + 32 * c, _mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 3), mask, exponent, SELECT));
    _mm512_store_si512(tile + 32 * (c + 4), _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 1), mask, exponent, SELECT));
    _mm512_store_si512(tile + 32 * (c + 8), _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 5), mask, exponent, SELECT));
    _mm512_store_si512(tile + 32 * (c + 12), _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 9), mask, exponent, SELECT));
  }
}

// acc[t] (the group's 16 outputs of token t) += d * (token t's rows of the block's product: hi +
// mid + lo in rows, P = 3; the one row along K, P = 1) + c * the block's sum of x (4-bit: c = m -
// 16 d for Q4_1, -24 d for Q4_0; see above); scales: the block's fp16 d (then m)
template <int64_t T, int TT, int P = 3>
SPECSPLIT_AMX inline void amx_scale(const float* prod, const uint8_t* scales, const float* sums, int64_t nb, int64_t b,
                                    __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
  __m512 c = _mm512_setzero_ps();  // Q8_0: no c
  if constexpr (T == Q4_1)
    c = _mm512_fnmadd_ps(_mm512_set1_ps(16.f), d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32))));
  else if constexpr (T == Q4_0)
    c = _mm512_mul_ps(_mm512_set1_ps(-24.f), d);
  for (int t = 0; t < TT; ++t) {
    const float* r = prod + P * t * 16;
    __m512 s = _mm512_load_ps(r);
    if constexpr (P == 3) s = _mm512_add_ps(_mm512_add_ps(s, _mm512_load_ps(r + 16)), _mm512_load_ps(r + 32));
    acc[t] = _mm512_fmadd_ps(d, s, acc[t]);
    if constexpr (T != Q8_0) acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(sums[t * nb + b]), acc[t]);
  }
}

// the tile configuration amx_groups<T, TT> runs under (along_k: amx_groups_kpieces<T, TT>'s: the
// weights in tiles 3 and 4, the other tiles one row per token)
template <int TT, bool along_k = false>
SPECSPLIT_AMX void amx_configure() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    const bool weights = along_k ? (i == 3 || i == 4) : (i == 2 || i == 3);
    cfg.rows[i] = weights ? 16 : along_k ? TT : 3 * TT;
    cfg.colsb[i] = 64;
  }
  // GCC does not see ldtilecfg read cfg and drops the stores above without this (seen: an all-zero
  // configuration, then SIGILL at the first tile load)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// y[t, 16g .. 16g+15] for groups g0..g1 and TT tokens. Tiles: 0, 1 the pieces of the pair's two
// blocks, 2, 3 their weights, 4..7 the products (pairs alternate between 4, 5 and 6, 7). The tile
// unit does not rename its registers and does not forward stores, so the loop is skewed: the
// weights of pair p+1 are converted before pair p is issued, pair p-1's products are stored after
// it, and pair p-2's are scaled (measured at one token, gate_up: 104 us unskewed, 85 skewed).
template <int64_t T, int TT>
SPECSPLIT_AMX void amx_groups(const uint16_t* pieces, const float* sums, int64_t K, const uint8_t* blocks, int64_t g0,
                              int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = K / QK, np = nb / 2, GB = amx_group_bytes(T), QB = amx_quant_bytes(T);
  constexpr int R = 3 * TT;
  amx_configure<TT>();
  alignas(64) uint16_t wt[4][16 * 32];  // converted weights, two pairs
  alignas(64) float prod[6][16 * 16];   // stored products, three pairs
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = blocks + g * nb * GB;
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
#define SPECSPLIT_ISSUE(BI, AT, BT, CT, BUF)     \
  _tile_loadd(BT, wt[BUF], 64);                  \
  _tile_loadd(AT, pieces + (BI) * R * QK, 64);   \
  _tile_zero(CT);                                \
  _tile_dpbf16ps(CT, AT, BT);
#define SPECSPLIT_SCALE(BI, BUF) amx_scale<T, TT>(prod[BUF], gp + (BI) * GB + QB, sums, nb, BI, acc);
    amx_convert<T>(gp, wt[0]);
    amx_convert<T>(gp + GB, wt[1]);
    for (int64_t p = 0; p < np; ++p) {
      const int64_t b = 2 * p;
      if (p + 1 < np) {
        amx_convert<T>(gp + (b + 2) * GB, wt[2 * ((p + 1) % 2)]);
        amx_convert<T>(gp + (b + 3) * GB, wt[2 * ((p + 1) % 2) + 1]);
      }
      for (int64_t o = 0; o < 2 * GB; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(gp + b * GB + AMX_PREFETCH + o), _MM_HINT_T0);
      const int q = static_cast<int>((p + 2) % 3) * 2;  // pair p-1's slots in prod
      if (p % 2 == 0) {
        SPECSPLIT_ISSUE(b, 0, 2, 4, 0)
        SPECSPLIT_ISSUE(b + 1, 1, 3, 5, 1)
        if (p > 0) {
          _tile_stored(6, prod[q], 64);
          _tile_stored(7, prod[q + 1], 64);
        }
      } else {
        SPECSPLIT_ISSUE(b, 0, 2, 6, 2)
        SPECSPLIT_ISSUE(b + 1, 1, 3, 7, 3)
        _tile_stored(4, prod[q], 64);
        _tile_stored(5, prod[q + 1], 64);
      }
      if (p > 1) {
        const int r = static_cast<int>((p + 1) % 3) * 2;  // pair p-2's slots
        SPECSPLIT_SCALE(b - 4, r)
        SPECSPLIT_SCALE(b - 3, r + 1)
      }
    }
    const int q = static_cast<int>((np + 2) % 3) * 2;  // the last pair: store it, scale the last two
    if ((np - 1) % 2 == 0) {
      _tile_stored(4, prod[q], 64);
      _tile_stored(5, prod[q + 1], 64);
    } else {
      _tile_stored(6, prod[q], 64);
      _tile_stored(7, prod[q + 1], 64);
    }
    if (np > 1) {
      const int r = static_cast<int>((np + 1) % 3) * 2;
      SPECSPLIT_SCALE(2 * np - 4, r)
      SPECSPLIT_SCALE(2 * np - 3, r + 1)
    }
    SPECSPLIT_SCALE(2 * np - 2, q)
    SPECSPLIT_SCALE(2 * np - 1, q + 1)
#undef SPECSPLIT_ISSUE
#undef SPECSPLIT_SCALE
    for (int t = 0; t < TT; ++t) _mm512_storeu_ps(y + t * ldy + 16 * g, acc[t]);
  }
  _tile_release();  // other code on this thread (oneDNN) loads its own configuration
}

// y[t, 16g .. 16g+15] for groups g0..g1 and TT <= 16 tokens, the pieces along K (amx_split_x<true>).
// Per block: its weights into tile 3 or 4 (alternating), the hi, mid and lo pieces into 0, 1, 2, and
// three products into one tile, 5 or 6 (alternating). Skewed as amx_groups: block b+1's weights
// are converted before block b is issued, block b-1's products are stored after it and block b-2's
// scaled.
template <int64_t T, int TT>
SPECSPLIT_AMX void amx_groups_kpieces(const uint16_t* pieces, const float* sums, int64_t K, const uint8_t* blocks,
                                      int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t nb = K / QK, GB = amx_group_bytes(T), QB = amx_quant_bytes(T);
  amx_configure<TT, true>();
  alignas(64) uint16_t wt[3][16 * 32];  // converted weights, three blocks
  alignas(64) float prod[3][16 * 16];   // stored products, three blocks
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = blocks + g * nb * GB;
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
#define SPECSPLIT_ISSUE(B, BT, CT)                          \
  _tile_loadd(BT, wt[(B) % 3], 64);                         \
  _tile_loadd(0, pieces + ((B) * 3 + 0) * TT * QK, 64);     \
  _tile_loadd(1, pieces + ((B) * 3 + 1) * TT * QK, 64);     \
  _tile_loadd(2, pieces + ((B) * 3 + 2) * TT * QK, 64);     \
  _tile_zero(CT);                                           \
  _tile_dpbf16ps(CT, 0, BT);                                \
  _tile_dpbf16ps(CT, 1, BT);                                \
  _tile_dpbf16ps(CT, 2, BT);
#define SPECSPLIT_SCALE(B) amx_scale<T, TT, 1>(prod[(B) % 3], gp + (B) * GB + QB, sums, nb, B, acc);
    amx_convert<T>(gp, wt[0]);
    for (int64_t b = 0; b < nb; ++b) {
      if (b + 1 < nb) amx_convert<T>(gp + (b + 1) * GB, wt[(b + 1) % 3]);
      for (int64_t o = 0; o < GB; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(gp + b * GB + AMX_PREFETCH + o), _MM_HINT_T0);
      if (b % 2 == 0) {
        SPECSPLIT_ISSUE(b, 3, 5)
        if (b > 0) _tile_stored(6, prod[(b - 1) % 3], 64);
      } else {
        SPECSPLIT_ISSUE(b, 4, 6)
        _tile_stored(5, prod[(b - 1) % 3], 64);
      }
      if (b > 1) SPECSPLIT_SCALE(b - 2)
    }
    if ((nb - 1) % 2 == 0)  // the last block: store it, scale the last two
      _tile_stored(5, prod[(nb - 1) % 3], 64);
    else
      _tile_stored(6, prod[(nb - 1) % 3], 64);
    if (nb > 1) SPECSPLIT_SCALE(nb - 2)
    SPECSPLIT_SCALE(nb - 1)
#undef SPECSPLIT_ISSUE
#undef SPECSPLIT_SCALE
    for (int t = 0; t < TT; ++t) _mm512_storeu_ps(y + t * ldy + 16 * g, acc[t]);
  }
  _tile_release();
}

// one pass over the weights for TT tokens, the pieces along K
template <int64_t T, int TT>
void amx_pass_kpieces(const float* x, int64_t K, const uint8_t* blocks, int64_t N, float* y) {
  const int64_t nb = K / QK;
  std::vector<uint16_t> pieces(nb * 3 * TT * QK);
  std::vector<float> sums(TT * nb);
  amx_split_x<true>(x, TT, K, pieces.data(), sums.data());
  // grain: 4 groups (64 output rows) per task, as the other loops
  at::parallel_for(0, N / 16, 4, [&](int64_t g0, int64_t g1) {
    amx_groups_kpieces<T, TT>(pieces.data(), sums.data(), K, blocks, g0, g1, y, N);
  });
}

// y [M, N] = x [M, K] @ W^T, W in the tile layout: rows for a 4-bit type's calls of up to
// AMX_TOKENS tokens, else along K in passes of up to 16 tokens (see the top of this section)
template <int64_t T>
void amx_run(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t N, float* y) {
  const int64_t nb = K / QK;
  if (T != Q8_0 && M <= AMX_TOKENS) {
    std::vector<uint16_t> pieces(nb * 3 * M * QK);
    std::vector<float> sums(M * nb);
    amx_split_x<false>(x, M, K, pieces.data(), sums.data());
    at::parallel_for(0, N / 16, 4, [&](int64_t g0, int64_t g1) {
      switch (M) {
        case 1: amx_groups<T, 1>(pieces.data(), sums.data(), K, blocks, g0, g1, y, N); break;
        case 2: amx_groups<T, 2>(pieces.data(), sums.data(), K, blocks, g0, g1, y, N); break;
        case 3: amx_groups<T, 3>(pieces.data(), sums.data(), K, blocks, g0, g1, y, N); break;
        case 4: amx_groups<T, 4>(pieces.data(), sums.data(), K, blocks, g0, g1, y, N); break;
        default: amx_groups<T, 5>(pieces.data(), sums.data(), K, blocks, g0, g1, y, N); break;
      }
    });
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += AMX_KPIECES_TOKENS) {
    const float* xs = x + m0 * K;
    float* ys = y + m0 * N;
    switch (std::min<int64_t>(AMX_KPIECES_TOKENS, M - m0)) {
#define SPECSPLIT_PASS(n) case n: amx_pass_kpieces<T, n>(xs, K, blocks, N, ys); break;
      SPECSPLIT_PASS(1) SPECSPLIT_PASS(2) SPECSPLIT_PASS(3) SPECSPLIT_PASS(4) SPECSPLIT_PASS(5) SPECSPLIT_PASS(6)
      SPECSPLIT_PASS(7) SPECSPLIT_PASS(8) SPECSPLIT_PASS(9) SPECSPLIT_PASS(10) SPECSPLIT_PASS(11) SPECSPLIT_PASS(12)
      SPECSPLIT_PASS(13) SPECSPLIT_PASS(14) SPECSPLIT_PASS(15)
      default: amx_pass_kpieces<T, 16>(xs, K, blocks, N, ys); break;
#undef SPECSPLIT_PASS
    }
  }
}
#else
bool amx_ready() { return false; }
#endif

// the quant of output row n at k in the tile layout (see above), for the dequantizer
inline int amx_quant(const uint8_t* nib, int64_t n, int64_t k) {
  const int64_t i = k / 2, j = 2 * n + k % 2, a = i / 4;  // tile row i = 4a + c: nibble a of word j, chunk c
  const uint8_t byte = nib[64 * (i % 4) + 2 * j + a / 2];
  return a % 2 ? byte >> 4 : byte & 0x0F;
}

void check_amx_blocks(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(block_bytes(qtype) > 0, "quant_linear (tiles): type ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(K % (2 * QK) == 0, "quant_linear (tiles): in_features ", K, " is not a multiple of 64");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == K / QK * 16 * block_bytes(qtype),
              "quant_linear (tiles): blocks must be contiguous uint8 [N/16, K/32 * 16 * block bytes]");
}

void check_blocks(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(block_bytes(qtype) > 0, "quant_linear: type ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(K % QK == 0, "quant_linear: in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == K / QK * block_bytes(qtype),
              "quant_linear: blocks must be contiguous uint8 [N, K/32 * block bytes], split rows");
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

void check_groups(const torch::Tensor& groups, int64_t N, int64_t K) {
  TORCH_CHECK(groups.dim() == 2 && groups.scalar_type() == at::kByte && groups.is_contiguous() &&
                  groups.size(0) == (N + GROUP_ROWS - 1) / GROUP_ROWS && groups.size(1) == K / QK * GROUP_BLOCK_BYTES,
              "groups must be quant_greedy_pack's uint8 [ceil(N/16), K/32 * 544]");
}

// greedy's copy of an N x K head: quant_greedy_pack's groups and cmax (`what`: the caller, for the message)
void check_greedy_copy(const torch::Tensor& groups, const torch::Tensor& cmax, int64_t N, int64_t K, const char* what) {
  check_groups(groups, N, K);
  TORCH_CHECK(cmax.dim() == 1 && cmax.size(0) == N && cmax.scalar_type() == at::kFloat && cmax.is_contiguous(),
              what, ": cmax must be contiguous fp32 [N]");
}

// argmax_n of quant_linear(x, blocks) for each x row, the ids torch.max(dim=-1) gives: x [M, K]
// fp32 (M <= 3), Q8_0 split rows [N, K/32 * 34], their copy quant_greedy_pack(blocks) and its
// cmax [N]. Returns int64 [M], or an empty tensor where this path cannot answer (another type,
// more rows, see greedy_rows): the caller then computes y. allow_avx512 = false runs the AVX2
// loops on any CPU (tests compare both). bound_vnni = false runs the bound pass on the AVX2 int8
// loop where VNNI exists too (the same integers, so the same ids; the exact rows stay on the loop
// quant_linear runs): faster on an AMD Zen 4 when the copy comes from memory
// (kernels/quant_linear.py's bound_loop).
torch::Tensor quant_greedy(const torch::Tensor& x_in, const torch::Tensor& blocks, int64_t qtype,
                           const torch::Tensor& groups, const torch::Tensor& cmax, bool allow_avx512,
                           bool bound_vnni) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "quant_greedy: x must be fp32 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = blocks.size(0);
  check_blocks(blocks, qtype, K);
  check_greedy_copy(groups, cmax, N, K, "quant_greedy");
  if (qtype != Q8_0 || M < 1 || M > GREEDY_MAX_ROWS || N < 1) return torch::empty({0}, torch::kLong);
  const bool vnni = allow_avx512 && bound_vnni && use_vnni(), exact_avx512 = allow_avx512 && use_avx512();
  const torch::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* gp = groups.data_ptr<uint8_t>();
  const float* cp = cmax.data_ptr<float>();
  switch (M) {
    case 1: return greedy_split_rows<1>(xp, K, bp, gp, cp, N, vnni, exact_avx512);
    case 2: return greedy_split_rows<2>(xp, K, bp, gp, cp, N, vnni, exact_avx512);
    default: return greedy_split_rows<3>(xp, K, bp, gp, cp, N, vnni, exact_avx512);
  }
}

// y = x @ W.T (+ bias) with x rounded to int8 per block: x [M, K] fp32, W's 16-row copy
// quant_greedy_pack(blocks) [ceil(N/16), K/32 * 544] (see int8_group). The VNNI loop where the CPU
// has it and allow_avx512, else the AVX2 one: the same y.
torch::Tensor quant_int8_linear(const torch::Tensor& x_in, const torch::Tensor& groups, int64_t N,
                                const c10::optional<torch::Tensor>& bias, bool allow_avx512) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) % QK == 0,
              "quant_int8_linear: x must be fp32 [M, K], K a multiple of 32");
  TORCH_CHECK(N >= 1, "quant_int8_linear: N must be positive");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  check_groups(groups, N, K);
  const torch::Tensor x = x_in.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M > 0)
    int8_linear_rows(x.data_ptr<float>(), M, K, groups.data_ptr<uint8_t>(), N, y.data_ptr<float>(), allow_avx512 && use_vnni());
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

bool quant_uses_vnni() { return use_vnni(); }

// Q8_0 split rows [N, K/32 * 34] -> (groups [ceil(N/16), K/32 * 544] uint8: quant_greedy's copy,
// cmax [N] fp32: each row's largest sum of |q| over one block)
std::tuple<torch::Tensor, torch::Tensor> quant_greedy_pack(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  check_blocks(blocks, qtype, K);
  TORCH_CHECK(qtype == Q8_0, "quant_greedy_pack: Q8_0 only");
  const int64_t N = blocks.size(0), nb = K / QK, row_bytes = blocks.size(1), G = (N + GROUP_ROWS - 1) / GROUP_ROWS;
  auto groups = torch::zeros({G, nb * GROUP_BLOCK_BYTES}, blocks.options());
  auto cmax = torch::empty({N}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  uint8_t* gp = groups.data_ptr<uint8_t>();
  float* cp = cmax.data_ptr<float>();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r = 0; r < GROUP_ROWS; ++r) {
        const int64_t n = g * GROUP_ROWS + r;
        int best = 0;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* out = gp + g * nb * GROUP_BLOCK_BYTES + b * GROUP_BLOCK_BYTES;
          const uint8_t* q = bp + n * row_bytes + b * QK;
          int sum = 0;
          for (int k = 0; k < QK; ++k) {  // padding rows: q = 0 (stored 128), d = 0
            const int v = n < N ? static_cast<int8_t>(q[k]) : 0;
            out[64 * (k / 4) + 4 * r + k % 4] = static_cast<uint8_t>(v + 128);
            sum += std::abs(v);
          }
          if (n < N) std::memcpy(out + 512 + 2 * r, bp + n * row_bytes + nb * QK + 2 * b, 2);
          best = std::max(best, sum);
        }
        if (n < N) cp[n] = static_cast<float>(best);
      }
    }
  });
  return {groups, cmax};
}

// blocks [N, K/32 * B] uint8 -> W [N, K] fp32 (the values quant_linear multiplies with)
// one split row -> K fp32 (sc: scratch for its scales, K/32 * 2 floats)
void dequant_split_row(const uint8_t* row, int64_t qtype, int64_t K, float* out, float* sc) {
  switch (qtype) {
    case Q4_0: dequant_row_avx2<Q4_0>(row, K, out, sc); break;
    case Q4_1: dequant_row_avx2<Q4_1>(row, K, out, sc); break;
    default: dequant_row_avx2<Q8_0>(row, K, out, sc); break;
  }
}

torch::Tensor quant_dequantize(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  check_blocks(blocks, qtype, K);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  auto w = torch::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    std::vector<float> sc(K / QK * 2);
    for (int64_t n = n0; n < n1; ++n) {
      prefetch_ahead(bp + n * row_bytes, row_bytes);  // prefill's dense copies: 70-74 -> 67-70 ms for all 121
      dequant_split_row(bp + n * row_bytes, qtype, K, wp + n * K, sc.data());
    }
  });
  return w;
}

// rows `ids` [R] int64 of split rows -> [R, K] fp32: an embedding lookup in one call (gathering the
// rows in torch first, then dequantizing them, made ~10 small calls; 55 us a lookup in a served step)
torch::Tensor quant_dequantize_rows(const torch::Tensor& blocks, int64_t qtype, int64_t K, const torch::Tensor& ids_in) {
  check_blocks(blocks, qtype, K);
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "quant_dequantize_rows: ids must be int64 [R]");
  const torch::Tensor ids = ids_in.contiguous();
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1), R = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "quant_dequantize_rows: row ", ip[r], " out of ", N);
  auto w = torch::empty({R, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, R, 256, [&](int64_t r0, int64_t r1) {
    std::vector<float> sc(K / QK * 2);
    for (int64_t r = r0; r < r1; ++r) dequant_split_row(bp + ip[r] * row_bytes, qtype, K, wp + r * K, sc.data());
  });
  return w;
}

// the scalar dequantizer, for tests: equal to quant_dequantize bit for bit
torch::Tensor quant_dequantize_scalar(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  check_blocks(blocks, qtype, K);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  auto w = torch::empty({N, K}, blocks.options().dtype(at::kFloat));
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = blocks.data_ptr<uint8_t>() + n * row_bytes;
    float* out = w.data_ptr<float>() + n * K;
    switch (qtype) {
      case Q4_0: dequant_row<Q4_0>(row, K, out); break;
      case Q4_1: dequant_row<Q4_1>(row, K, out); break;
      default: dequant_row<Q8_0>(row, K, out); break;
    }
  }
  return w;
}


// x [M, K] fp32, blocks in the tile layout [N/16, K/32 * GB] -> y [M, N] fp32 (+ bias), on AMX
torch::Tensor quant_linear_amx(const torch::Tensor& x_in, const torch::Tensor& blocks, int64_t qtype,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "quant_linear (tiles): x must be fp32 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = blocks.size(0) * 16;
  check_amx_blocks(blocks, qtype, K);
  TORCH_CHECK(amx_ready(), "quant_linear (tiles): this CPU or kernel has no AMX-BF16");
  const torch::Tensor x = x_in.contiguous();
  auto y = torch::empty({M, N}, x.options());
#ifdef SPECSPLIT_HAVE_AMX
  if (M > 0) {
    switch (qtype) {
      case Q4_0: amx_run<Q4_0>(x.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), N, y.data_ptr<float>()); break;
      case Q4_1: amx_run<Q4_1>(x.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), N, y.data_ptr<float>()); break;
      default: amx_run<Q8_0>(x.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), N, y.data_ptr<float>()); break;
    }
  }
#endif
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// quant_greedy for a Q8_0 head in the tile layout (blocks [N/16, K/32 * 544]): the same bound pass
// over the same copy (quant_greedy_pack of its rows), then the candidates' groups of 16 rows,
// gathered, through the AMX loop quant_linear_amx runs on the whole head: each group's outputs
// depend on that group's bytes and x alone, so the candidates' y have the logits' bits.
torch::Tensor quant_greedy_amx(const torch::Tensor& x_in, const torch::Tensor& blocks, int64_t qtype,
                               const torch::Tensor& groups, const torch::Tensor& cmax) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "quant_greedy (tiles): x must be fp32 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = blocks.size(0) * 16;
  check_amx_blocks(blocks, qtype, K);
  TORCH_CHECK(amx_ready(), "quant_greedy (tiles): this CPU or kernel has no AMX-BF16");
  check_greedy_copy(groups, cmax, N, K, "quant_greedy (tiles)");
  if (qtype != Q8_0 || M < 1 || M > GREEDY_MAX_ROWS_TILES || N < 1) return torch::empty({0}, torch::kLong);
#ifdef SPECSPLIT_HAVE_AMX
  static_assert(GREEDY_MAX_ROWS_TILES <= AMX_KPIECES_TOKENS, "the candidates' rows in one pass of the AMX loop");
  const torch::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const int64_t group_bytes = blocks.size(1);
  auto exact = [&](const std::vector<int64_t>& rows, float* y) {
    std::vector<int64_t> picked_groups;  // the candidates' groups, in order (rows are in order)
    for (int64_t r : rows)
      if (picked_groups.empty() || picked_groups.back() != r / 16) picked_groups.push_back(r / 16);
    const int64_t P = picked_groups.size(), C = rows.size();
    std::vector<uint8_t> picked(P * group_bytes);
    for (int64_t i = 0; i < P; ++i)
      std::memcpy(picked.data() + i * group_bytes, bp + picked_groups[i] * group_bytes, group_bytes);
    std::vector<float> yg(M * P * 16);
    amx_run<Q8_0>(xp, M, K, picked.data(), P * 16, yg.data());
    for (int64_t c = 0, i = 0; c < C; ++c) {
      while (picked_groups[i] != rows[c] / 16) ++i;
      for (int64_t m = 0; m < M; ++m) y[m * C + c] = yg[m * P * 16 + i * 16 + rows[c] % 16];
    }
  };
  const uint8_t* gp = groups.data_ptr<uint8_t>();
  const float* cp = cmax.data_ptr<float>();
  const bool vnni = use_vnni();
  switch (M) {
    case 1: return greedy_rows<1>(xp, K, gp, cp, N, vnni, exact);
    case 2: return greedy_rows<2>(xp, K, gp, cp, N, vnni, exact);
    case 3: return greedy_rows<3>(xp, K, gp, cp, N, vnni, exact);
    case 4: return greedy_rows<4>(xp, K, gp, cp, N, vnni, exact);
    default: return greedy_rows<5>(xp, K, gp, cp, N, vnni, exact);
  }
#else
  return torch::empty({0}, torch::kLong);
#endif
}

// row n (0..15) of one group's K/32 blocks in the tile layout -> K fp32 (dequant_row's arithmetic)
void amx_dequant_row(const uint8_t* group, int64_t qtype, int64_t nb, int64_t GB, int64_t n, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = group + b * GB;
    const float d = half_to_float(gb + amx_quant_bytes(qtype) + 2 * n);
    float* o = out + b * QK;
    if (qtype == Q8_0) {
      for (int64_t k = 0; k < QK; ++k) o[k] = d * static_cast<float>(static_cast<int8_t>(gb[32 * (k / 2) + 2 * n + k % 2]));
    } else if (qtype == Q4_0) {
      for (int64_t k = 0; k < QK; ++k) o[k] = d * static_cast<float>(amx_quant(gb, n, k) - 8);
    } else {
      const float m = half_to_float(gb + amx_quant_bytes(qtype) + 32 + 2 * n);  // the m after the 16 d
      for (int64_t k = 0; k < QK; ++k) o[k] = d * static_cast<float>(amx_quant(gb, n, k)) + m;
    }
  }
}

// The tiles layout -> fp32 with AVX-512: one (group, block) at a time, its 16 rows' 32 values each
// stored at out + n * ldo, the values of amx_dequant_row bit for bit (the same mul (and add) per value).
// 4-bit: row n's 32 quants are the dword at 4n of each 64-byte chunk c; k = 8a + 2c + e is bits
// 16e + 4a of chunk c's dword. A 4x4 dword transpose per 128-bit lane puts each row's 4 dwords
// together; per row vpermd spreads them (lane l: chunk (l % 8) / 2), vpsrlvd moves each quant to
// its lane's low 4 bits and vpermps picks from the row's 16 values (dequant_table, as dequant16x2).
// Measured on the Xeon, one thread, 3072 x 576 Q4_1: 2.26 ms (amx_dequant_row per row) -> 0.44,
// where filling a fresh fp32 tensor of that size takes 0.34: the stores bound it.
template <int64_t T>
SPECSPLIT_AVX512 inline void amx_dequant_block4(const uint8_t* gb, float* out, int64_t ldo) {
  alignas(64) float ds[16], ms[16];
  _mm512_store_ps(ds, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 256))));
  if constexpr (T == Q4_1)
    _mm512_store_ps(ms, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 288))));
  __m512i c[4], r[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm512_loadu_si512(gb + 64 * i);
  const __m512i t0 = _mm512_unpacklo_epi32(c[0], c[1]), t1 = _mm512_unpackhi_epi32(c[0], c[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(c[2], c[3]), t3 = _mm512_unpackhi_epi32(c[2], c[3]);
  r[0] = _mm512_unpacklo_epi64(t0, t2);  // 128-bit lane L: row 4L + i's chunks 0..3
  r[1] = _mm512_unpackhi_epi64(t0, t2);
  r[2] = _mm512_unpacklo_epi64(t1, t3);
  r[3] = _mm512_unpackhi_epi64(t1, t3);
  const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3);
  const __m512i shift_lo = _mm512_setr_epi32(0, 16, 0, 16, 0, 16, 0, 16, 4, 20, 4, 20, 4, 20, 4, 20);  // k 0..15
  const __m512i shift_hi = _mm512_add_epi32(shift_lo, _mm512_set1_epi32(8));                            // k 16..31
  for (int n = 0; n < 16; ++n) {
    const __m512i v = _mm512_permutexvar_epi32(_mm512_add_epi32(spread, _mm512_set1_epi32(4 * (n / 4))), r[n % 4]);
    const __m512 table = dequant_table<T>(ds[n], T == Q4_1 ? ms[n] : 0.f);
    _mm512_storeu_ps(out + n * ldo, _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift_lo), table));
    _mm512_storeu_ps(out + n * ldo + 16, _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift_hi), table));
  }
}

// Q8_0: the 512 bytes are a 16 x 16 matrix of 16-bit words (tile row i, word n = row n's k 2i, 2i+1);
// eight zmm of two tile rows each are transposed in three stages of vpermt2w, each swapping one
// register bit with one position bit: register (i3 i2 i1), position (i0 n3 n2 n1 n0) -> (i3 i2 n1),
// (i0 n3 n2 i1 n0) -> (i3 n2 n1), (i0 n3 i2 i1 n0) -> (n3 n2 n1), (n0 i3 i2 i1 i0): register p then
// holds rows 2p and 2p + 1 in k order.
struct Q8Transpose {
  alignas(64) uint16_t index[3][2][32];  // [stage][bit s of the output register][position]
};

inline const Q8Transpose& q8_transpose() {
  static const Q8Transpose t = [] {
    // element (i, n) -> (register, position) in layout s
    auto bit = [](int v, int b) { return (v >> b) & 1; };
    auto place = [&](int s, int i, int n, int& reg, int& pos) {
      const int i0 = bit(i, 0), i1 = bit(i, 1), i2 = bit(i, 2), i3 = bit(i, 3);
      const int n0 = bit(n, 0), n1 = bit(n, 1), n2 = bit(n, 2), n3 = bit(n, 3);
      switch (s) {
        case 0: reg = i3 << 2 | i2 << 1 | i1; pos = i0 << 4 | n; break;
        case 1: reg = i3 << 2 | i2 << 1 | n1; pos = i0 << 4 | n3 << 3 | n2 << 2 | i1 << 1 | n0; break;
        case 2: reg = i3 << 2 | n2 << 1 | n1; pos = i0 << 4 | n3 << 3 | i2 << 2 | i1 << 1 | n0; break;
        default: reg = n3 << 2 | n2 << 1 | n1; pos = n0 << 4 | i; break;
      }
    };
    Q8Transpose t;
    for (int s = 0; s < 3; ++s)
      for (int h = 0; h < 2; ++h) {
        uint16_t* idx = t.index[s][h];
        for (int i = 0; i < 16; ++i)
          for (int n = 0; n < 16; ++n) {
            int reg, pos, from_reg, from_pos;
            place(s + 1, i, n, reg, pos);
            if (bit(reg, s) != h || (reg & ~(1 << s)) != 0) continue;  // output register h << s
            place(s, i, n, from_reg, from_pos);
            idx[pos] = static_cast<uint16_t>(from_pos + 32 * bit(from_reg, s));
          }
      }
    return t;
  }();
  return t;
}

SPECSPLIT_AVX512 inline void amx_dequant_block8(const uint8_t* gb, float* out, int64_t ldo, const Q8Transpose& tr) {
  alignas(64) float ds[16];
  alignas(64) int8_t q[512];
  _mm512_store_ps(ds, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 512))));
  __m512i z[8];
  for (int p = 0; p < 8; ++p) z[p] = _mm512_loadu_si512(gb + 64 * p);
  for (int s = 0; s < 3; ++s) {
    const __m512i i0 = _mm512_load_si512(tr.index[s][0]), i1 = _mm512_load_si512(tr.index[s][1]);
    for (int a = 0; a < 8; ++a)
      if (!(a >> s & 1)) {
        const int b = a | 1 << s;
        const __m512i x = _mm512_permutex2var_epi16(z[a], i0, z[b]);
        z[b] = _mm512_permutex2var_epi16(z[a], i1, z[b]);
        z[a] = x;
      }
  }
  for (int p = 0; p < 8; ++p) _mm512_store_si512(q + 64 * p, z[p]);
  for (int n = 0; n < 16; ++n) {  // row n's 32 quants now lie in k order, as a split row's block
    __m512 w[2];
    dequant16x2<Q8_0>(reinterpret_cast<const uint8_t*>(q + 32 * n), ds[n], 0.f, w);
    _mm512_storeu_ps(out + n * ldo, w[0]);
    _mm512_storeu_ps(out + n * ldo + 16, w[1]);
  }
}

// groups g0..g1 of the tiles layout -> rows 16 g0 .. 16 g1 of W [N, K]
template <int64_t T>
SPECSPLIT_AVX512 void amx_dequant_groups(const uint8_t* blocks, int64_t K, int64_t g0, int64_t g1, float* w) {
  const int64_t nb = K / QK, GB = amx_group_bytes(T);
  const Q8Transpose& tr = q8_transpose();
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* gb = blocks + (g * nb + b) * GB;
      float* out = w + 16 * g * K + b * QK;
      if constexpr (T == Q8_0)
        amx_dequant_block8(gb, out, K, tr);
      else
        amx_dequant_block4<T>(gb, out, K);
    }
}

// blocks in the tile layout -> W [N, K] fp32: the same values as quant_dequantize of the rows
// layout, bit for bit (any CPU: the AVX-512 loop where there is one, as on every AMX CPU, else
// amx_dequant_row per row)
torch::Tensor quant_dequantize_amx(const torch::Tensor& blocks, int64_t qtype, int64_t K) {
  check_amx_blocks(blocks, qtype, K);
  const int64_t G = blocks.size(0), nb = K / QK, GB = blocks.size(1) / nb;
  auto w = torch::empty({G * 16, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  const bool avx512 = use_avx512();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    if (avx512) {
      switch (qtype) {
        case Q4_0: amx_dequant_groups<Q4_0>(bp, K, g0, g1, wp); break;
        case Q4_1: amx_dequant_groups<Q4_1>(bp, K, g0, g1, wp); break;
        default: amx_dequant_groups<Q8_0>(bp, K, g0, g1, wp); break;
      }
      return;
    }
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t n = 0; n < 16; ++n) amx_dequant_row(bp + g * nb * GB, qtype, nb, GB, n, wp + (16 * g + n) * K);
  });
  return w;
}

// rows `ids` [R] int64 of the tile layout -> [R, K] fp32 (an embedding lookup in a tied head)
torch::Tensor quant_dequantize_amx_rows(const torch::Tensor& blocks, int64_t qtype, int64_t K, const torch::Tensor& ids_in) {
  check_amx_blocks(blocks, qtype, K);
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "quant_dequantize_amx_rows: ids must be int64 [R]");
  const torch::Tensor ids = ids_in.contiguous();
  const int64_t G = blocks.size(0), nb = K / QK, GB = blocks.size(1) / nb, R = ids.size(0);
  auto w = torch::empty({R, K}, blocks.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < 16 * G, "quant_dequantize_amx_rows: row ", ip[r], " out of ", 16 * G);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) amx_dequant_row(bp + (ip[r] / 16) * nb * GB, qtype, nb, GB, ip[r] % 16, wp + r * K);
  });
  return w;
}

bool quant_uses_amx() { return amx_ready(); }

bool quant_uses_avx512() { return use_avx512(); }

#ifndef SPECSPLIT_NO_MODULE  // kernels/cpu/layer_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ W.T (+ bias), W as split rows of GGUF Q4_0/Q4_1/Q8_0 blocks, fp32 x");
  m.def("quant_dequantize", &quant_dequantize, "split rows of GGUF Q4_0/Q4_1/Q8_0 blocks [N, K/32*B] -> fp32 [N, K]");
  m.def("quant_dequantize_rows", &quant_dequantize_rows, "rows ids [R] of split rows -> fp32 [R, K] (an embedding lookup)");
  m.def("quant_dequantize_scalar", &quant_dequantize_scalar, "the scalar dequantizer (tests)");
  m.def("quant_uses_avx512", &quant_uses_avx512, "whether the AVX-512 loop runs on this CPU");
  m.def("quant_greedy", &quant_greedy, "argmax ids [M] of x @ W.T for a Q8_0 W (M <= 3) from a bound, or empty");
  m.def("quant_greedy_amx", &quant_greedy_amx, "quant_greedy for a Q8_0 W in the tile layout (its candidates on AMX)");
  m.def("quant_greedy_pack", &quant_greedy_pack, "Q8_0 split rows -> (quant_greedy's 16-row groups, cmax [N])");
  m.def("quant_int8_linear", &quant_int8_linear, "y = x @ W.T (+ bias), x rounded to int8 per block, W's 16-row copy");
  m.def("quant_uses_vnni", &quant_uses_vnni, "whether the AVX-512 VNNI loops (greedy, int8 linear's) run on this CPU");
  m.def("quant_linear_amx", &quant_linear_amx, "y = x @ W.T (+ bias), W as Q4_0/Q4_1 in the tile layout, on AMX");
  m.def("quant_dequantize_amx", &quant_dequantize_amx, "the tile layout [N/16, K/32*GB] -> fp32 [N, K]");
  m.def("quant_dequantize_amx_rows", &quant_dequantize_amx_rows, "rows ids [R] of the tile layout -> fp32 [R, K]");
  m.def("quant_uses_amx", &quant_uses_amx, "whether AMX-BF16 runs on this CPU (flags and the kernel's permission)");
}
#endif
