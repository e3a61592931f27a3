// The per-layer glue of a CPU decode or verify step, fp32: RMSNorm, rotary embedding, and attention
// over the paged KV cache. A step of a small model at 1-16 rows is a few dozen torch ops per layer
// (norm: pow, mean, rsqrt, mul, mul; rope: chunk, cat, mul, mul, add; attention: two block gathers,
// a mask, SDPA), each a dispatcher round trip of microseconds: about 7 ms of SmolLM2-135M's 19 ms
// step on a Zen 4 core. Here each is one call that reads its inputs once.
//
// Same functions as the torch path, fp32 throughout; only the order of the sums differs (dot
// products and the softmax denominator accumulate in 8-lane chunks), so results agree within fp32
// rounding. Each query row is computed alone, in the same order whatever the batch or the number of
// rows: a verify row equals the decode row at that position bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum a[i] * b[i], i < n (n a multiple of 8: head_dim and hidden sizes are)
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a CPU float32 tensor");
}

}  // namespace

// x [T, D] (rows may be strided), w [D] -> w * x / sqrt(mean(x^2) + eps), [T, D] contiguous
torch::Tensor decode_rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1), "rms_norm: x [T, D], w [D]");
  const int64_t T = x.size(0), D = x.size(1), ld = x.stride(0);
  auto out = torch::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* r = xp + t * ld;
      const float inv = 1.0f / std::sqrt(dot(r, r, D) / static_cast<float>(D) + static_cast<float>(eps));
      float* o = op + t * D;
      for (int64_t i = 0; i < D; ++i) o[i] = wp[i] * (r[i] * inv);
    }
  });
  return out;
}

// x [T, S, D] (rows may be strided, heads contiguous), cos and signed sin [T, D] (as RotaryEmbedding.tables
// gives them, squeezed) -> x * cos + cat(x2, x1) * sin, [T, S, D] contiguous
torch::Tensor decode_rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope: x [T, S, D] with contiguous heads");
  const int64_t T = x.size(0), S = x.size(1), D = x.size(2), half = D / 2, ld = x.stride(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rope: cos and sin [T, D]");
  auto out = torch::empty({T, S, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < S; ++h) {
        const float* r = xp + t * ld + h * D;
        float* o = op + (t * S + h) * D;
        for (int64_t i = 0; i < half; ++i) o[i] = r[i] * c[i] + r[i + half] * s[i];
        for (int64_t i = half; i < D; ++i) o[i] = r[i] * c[i] + r[i - half] * s[i];
      }
    }
  });
  return out;
}

namespace {

// exp(x) for 8 lanes: Cephes' expf, range reduction by ln 2
// in two parts and a degree-5 polynomial, within 1-2 ulp of expf; below -87.3 it returns 0.
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762626647949f));  // above: the largest finite
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(zero_mask, y);
}

// 8 vectors of partial sums -> the 8 horizontal sums, lane i = sum of v[i]
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // lanes: 0 1 2 3 | 0 1 2 3 (halves)
  const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Keys and values ahead of the one being read, prefetched: a decode step reads each layer's cache
// once, after the weights of the layers between have pushed it out of the nearer caches. The
// callers prefetch the span of each token row their KV heads occupy (one head: 256 of SmolLM2's
// 768 bytes; all of them on one thread: the whole row). One-token steps of SmolLM2-135M
// at context 340 on the AMX Xeon, interleaved, 7 rounds: 13.35 ms without, 12.84 with 16 / 8 (8 / 4:
// 12.94, 64 / 32: 12.74).
constexpr int64_t PREFETCH_KEYS = 16, PREFETCH_VALUES = 8;

inline void prefetch_row(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

// At the block of 8 keys from j (of n8 in whole blocks, n in all): the keys PREFETCH_KEYS ahead, and
// at the last block the first values, which the values' pass reads next; `span` floats of each row.
inline void prefetch_ahead(const float* kc, const float* vc, const int64_t* rows, int64_t j, int64_t n8, int64_t n,
                           int64_t span) {
  for (int64_t u = j + PREFETCH_KEYS; u < std::min(j + PREFETCH_KEYS + 8, n); ++u) prefetch_row(kc + rows[u], span);
  if (j + 8 >= n8)
    for (int64_t u = 0; u < std::min(PREFETCH_VALUES, n); ++u) prefetch_row(vc + rows[u], span);
}

// sc[j] <- exp(sc[j] - max sc), j < n8up (the padded tail is -inf: exp 0); -> 1 / their sum
inline float softmax_row(float* sc, int64_t n8up) {
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n8up; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sc + j));
  alignas(32) float m[8];
  _mm256_store_ps(m, mx8);
  float mx = -INFINITY;
  for (float v : m) mx = v > mx ? v : mx;
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 den = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8up; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mxv));
    _mm256_storeu_ps(sc + j, e);
    den = _mm256_add_ps(den, e);
  }
  return 1.0f / hsum(den);
}

// o_h = inv * sum_j p_j v_j for one query head over W * 8 output lanes from i0, held in registers
// (W a template argument, so the compiler keeps the accumulators there). prefetch: the value rows
// PREFETCH_VALUES ahead, pf floats of each.
template <int W>
inline void values_lanes(const float* sc, const float* vc, const int64_t* rows, int64_t n, int64_t i0, float inv,
                         float* o, bool prefetch, int64_t pf) {
  __m256 acc[W];
  for (int u = 0; u < W; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (prefetch && j + PREFETCH_VALUES < n) prefetch_row(vc + rows[j + PREFETCH_VALUES], pf);
    const __m256 pj = _mm256_set1_ps(sc[j]);
    const float* v = vc + rows[j] + i0;
    for (int u = 0; u < W; ++u) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * u), acc[u]);
  }
  const __m256 invv = _mm256_set1_ps(inv);
  for (int u = 0; u < W; ++u) _mm256_storeu_ps(o + i0 + 8 * u, _mm256_mul_ps(acc[u], invv));
}

// One query row and KV heads [g0, g1) with their G query heads each, over n keys (rows[j]: key j's
// offset in the caches, in floats, at KV head 0; a token's KV heads contiguous); q and o hold all
// H heads one after another ([H, D]). The heads take turns on each 8 keys, so a key row is read
// from memory once for all of them, and the keys' pass reads whole token rows in order; the
// values go head by head, the first prefetching whole token rows.
// scores: scratch [(g1 - g0) * G, n8up]. Each head's sums are the same whatever the range.
void attend_group(const float* q, const float* kc, const float* vc, const int64_t* rows, int64_t n, int64_t D,
                  int64_t G, int64_t g0, int64_t g1, float scale, float* scores, float* o) {
  const int64_t n8 = n / 8 * 8, n8up = (n + 7) / 8 * 8, h0 = g0 * G, nh = (g1 - g0) * G;
  const int64_t span = (g1 - g0) * D;  // the range's floats of each token row (prefetched)
  auto sc_of = [&](int64_t h) { return scores + (h - h0) * n8up; };
  for (int64_t h = h0; h < h0 + nh; ++h)
    for (int64_t j = n8; j < n8up; ++j) sc_of(h)[j] = -INFINITY;  // exp -> 0 in the padded tail
  for (int64_t j = 0; j < n8; j += 8) {  // 8 keys at a time, one horizontal reduction for all 8
    prefetch_ahead(kc + g0 * D, vc + g0 * D, rows, j, n8, n, span);
    for (int64_t h = h0; h < h0 + nh; ++h) {
      const float* qh = q + h * D;
      const float* kh = kc + (h / G) * D;
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + i);
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + rows[j + u] + i), acc[u]);
      }
      _mm256_storeu_ps(sc_of(h) + j, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    }
  }
  for (int64_t j = n8; j < n; ++j)
    for (int64_t h = h0; h < h0 + nh; ++h) sc_of(h)[j] = dot(q + h * D, kc + (h / G) * D + rows[j], D) * scale;
  // o_h = sum_j p_hj v_j, 64 output lanes at a time held in registers (8 accumulators)
  for (int64_t h = h0; h < h0 + nh; ++h) {
    const float inv = softmax_row(sc_of(h), n8up);
    const float* vh = vc + (h / G) * D;
    for (int64_t i0 = 0; i0 < D; i0 += 64) {
      const bool p = h == h0 && i0 == 0;
      switch (D - i0 < 64 ? (D - i0) / 8 : 8) {
        case 1: values_lanes<1>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
        case 2: values_lanes<2>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
        case 3: values_lanes<3>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
        case 4: values_lanes<4>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
        case 5: values_lanes<5>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
        case 6: values_lanes<6>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
        case 7: values_lanes<7>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
        default: values_lanes<8>(sc_of(h), vh, rows, n, i0, inv, o + h * D, p, span); break;
      }
    }
  }
}


// Where the CPU has AVX-512 (and head_dim is a multiple of 16), the attention runs on 16-lane
// vectors (half the FMAs of attend_group), and the consecutive rows of a sequence (a verify) share
// their passes over its keys and values. Its sums group differently from attend_group's, so its
// bits are its own; every row, decode or verify, runs it on such a CPU, and a verify row still
// equals the decode row at its position bit for bit. SmolLM2-135M at context 300 on the AMX Xeon,
// a layer step's attention summed over the 30 layers, against attend_group (one process, 11
// rounds): 1 row 1.67 -> 1.52 ms, 3 rows 3.00 -> 2.20, 5 rows 4.16 -> 2.97; the whole step 12.23 ->
// 12.12, 15.58 -> 14.78, 19.31 -> 17.50 ms.
#define SPECSPLIT_ATTN512 __attribute__((target("avx512f,avx512dq,avx2,fma")))

// The most consecutive rows of one sequence that attend_rows512 takes at once (a run: they share
// the passes over the keys), and the most nodes of a draft tree (its ancestor bits in an int64;
// models/attention.py's KERNEL_TREE_NODES)
constexpr int64_t ATTN_RUN_ROWS = 8, TREE_MAX_NODES = 63;

// o_r = inv_r * sum_{j < n_r} p_rj v_(keys_r[j]) for RB rows (row r's probabilities sc[r], its keys
// keys[r], n[r] of them) over W * 16 output lanes from i0, held in registers (RB x W accumulators;
// W a template argument, so the compiler keeps them there: with W read at run time it spilled them
// to the stack): each row's sums are the one-row loop's, in order. The rows' first `common` keys
// are the same ones (a verify's rows: all of them; a draft tree's: the slots before it), and each
// of those value rows is loaded once for all RB rows; past them each row loads its own.
// prefetch: prefetch the shared value rows ahead, pf floats of each (a whole token's KV heads from
// the first head's pass, so the other heads' passes find them in the nearer caches).
// Tree: the rows' keys may differ past `common` (a run with a draft tree's node); else they are all
// shared.
template <int RB, int W, bool Tree>
SPECSPLIT_ATTN512 inline void values_lanes512(const float* const* sc, const float* vc, const int64_t* const* keys,
                                              const int64_t* n, int64_t common, int64_t i0, const float* iv,
                                              float* const* out, bool prefetch, int64_t pf) {
  int64_t n_of[RB];  // in registers: reading n[r] in the loop cost a verify's attention 6-20%
  for (int r = 0; r < RB; ++r) n_of[r] = n[r];
  int64_t nlast = 0, most = 0;  // the most keys of a row, and that row
  for (int r = 0; r < RB; ++r)
    if (n_of[r] > nlast) nlast = n_of[r], most = r;
  const int64_t shared = Tree ? std::min(common, nlast) : nlast;
  const int64_t* rows = keys[most];
  __m512 acc[RB][W];
  for (int r = 0; r < RB; ++r)
    for (int u = 0; u < W; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t j = 0; j < shared; ++j) {
    if (prefetch && j + PREFETCH_VALUES < shared) prefetch_row(vc + rows[j + PREFETCH_VALUES], pf);
    const float* v = vc + rows[j] + i0;
    __m512 vv[W];
    for (int u = 0; u < W; ++u) vv[u] = _mm512_loadu_ps(v + 16 * u);
    for (int r = 0; r < RB; ++r) {
      if (j >= n_of[r]) continue;  // past row r's keys
      const __m512 pj = _mm512_set1_ps(sc[r][j]);
      for (int u = 0; u < W; ++u) acc[r][u] = _mm512_fmadd_ps(pj, vv[u], acc[r][u]);
    }
  }
  if constexpr (Tree) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)  // each row's own keys (unrolled: acc stays in registers)
      for (int64_t j = shared; j < n_of[r]; ++j) {
        const float* v = vc + keys[r][j] + i0;
        const __m512 pj = _mm512_set1_ps(sc[r][j]);
        for (int u = 0; u < W; ++u) acc[r][u] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 16 * u), acc[r][u]);
      }
  }
  for (int r = 0; r < RB; ++r) {
    const __m512 invv = _mm512_set1_ps(iv[r]);
    for (int u = 0; u < W; ++u) _mm512_storeu_ps(out[r] + i0 + 16 * u, _mm512_mul_ps(acc[r][u], invv));
  }
}

// values_lanes512 over all D lanes, 64 at a time; first: prefetch (on the first 64 lanes' pass).
template <int RB, bool Tree>
SPECSPLIT_ATTN512 inline void values_rows512(const float* const* sc, const float* vc, const int64_t* const* keys,
                                             const int64_t* n, int64_t common, int64_t D, const float* iv,
                                             float* const* out, bool first, int64_t pf) {
  for (int64_t i0 = 0; i0 < D; i0 += 64) {
    const bool p = first && i0 == 0;
    switch (D - i0 < 64 ? (D - i0) / 16 : 4) {
      case 1: values_lanes512<RB, 1, Tree>(sc, vc, keys, n, common, i0, iv, out, p, pf); break;
      case 2: values_lanes512<RB, 2, Tree>(sc, vc, keys, n, common, i0, iv, out, p, pf); break;
      case 3: values_lanes512<RB, 3, Tree>(sc, vc, keys, n, common, i0, iv, out, p, pf); break;
      default: values_lanes512<RB, 4, Tree>(sc, vc, keys, n, common, i0, iv, out, p, pf); break;
    }
  }
}

// R consecutive query rows of one sequence and KV heads [g0, g1) with their G query heads each:
// row r sees n[r] keys, keys[r][j] the offset of its key j in the caches (in floats, at KV head 0; a
// token's KV heads contiguous), and the rows' first `common` keys are the same ones (a verify's
// rows: n0 + r keys each, all of them shared; a draft tree's nodes: the slots before the tree).
// Every (row, head) is computed exactly as one row alone (the same sums in the same order), so a
// verify row equals the decode row bit for bit, and a tree node the row of its path's chain. q and
// o: rows ld floats apart, the heads of each one after another ([H, D], H = G * KV heads); kc, vc:
// the caches at KV head 0. The rows share the passes over the keys and values: a 5-row verify
// reads each layer's cache once instead of five times. The keys' pass takes every KV head of the
// range at each 8 keys, so it reads whole token rows in order (the cache's layout); the values'
// pass goes head by head, its first head prefetching whole token rows. scores: scratch
// [R, (g1 - g0) * G, (max n + 7) / 8 * 8]. Tree false: row r sees n[0] + r keys of keys[0] (a run
// of causal rows), all shared.
// SmolLM2-135M at context 300 on a Zen 4 core, the 30 layers' attention with 2.2 MB streamed
// between layers (as a step's weights do), the AVX-512 loop before (one KV head per call, the
// values' accumulators spilled) and after, 21 interleaved rounds: 1 / 3 / 5 rows 2.75 -> 2.39,
// 3.69 -> 3.07, 4.84 -> 3.94 ms.
template <bool Tree>
SPECSPLIT_ATTN512 void attend_rows512(const float* q, int64_t ld, const float* kc, const float* vc,
                                      const int64_t* const* keys, const int64_t* n, int64_t common, int64_t R,
                                      int64_t D, int64_t G, int64_t g0, int64_t g1, float scale, float* scores,
                                      float* o) {
  // each row's count and keys, copied: the compiler keeps them in registers (read through n and
  // keys in the loops, a verify's attention took 6-20% longer)
  int64_t nn[ATTN_RUN_ROWS];  // R <= ATTN_RUN_ROWS
  const int64_t* kk[ATTN_RUN_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    nn[r] = Tree ? n[r] : n[0] + r;
    kk[r] = keys[Tree ? r : 0];
  }
  auto n_of = [&](int64_t r) { return nn[r]; };
  auto keys_of = [&](int64_t r) { return kk[r]; };
  int64_t nmax = 0, most = 0;  // the most keys of a row, and that row
  for (int64_t r = 0; r < R; ++r)
    if (n_of(r) > nmax) nmax = n_of(r), most = r;
  const int64_t h0 = g0 * G, nh = (g1 - g0) * G, stride = (nmax + 7) / 8 * 8;
  auto sc_of = [&](int64_t r, int64_t h) { return scores + (r * nh + h - h0) * stride; };  // h: the head's index
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n8 = n_of(r) / 8 * 8, n8up = (n_of(r) + 7) / 8 * 8;
    for (int64_t h = h0; h < h0 + nh; ++h)
      for (int64_t j = n8; j < n8up; ++j) sc_of(r, h)[j] = -INFINITY;  // exp -> 0 in the padded tail
  }
  const float* kg0 = kc + g0 * D;  // the range's keys; prefetch its whole span of each token row
  const int64_t span = (g1 - g0) * D;
  const int64_t n8max = nmax / 8 * 8;
  for (int64_t j = 0; j < n8max; j += 8) {  // 8 keys at a time, one horizontal reduction for all 8
    prefetch_ahead(kg0, vc + g0 * D, keys_of(most), j, n8max, nmax, span);
    for (int64_t r = 0; r < R; ++r) {
      if (j + 8 > n_of(r) / 8 * 8) continue;  // past this row's whole blocks of 8
      const int64_t* rows = keys_of(r);
      for (int64_t h = h0; h < h0 + nh; ++h) {
        const float* qh = q + r * ld + h * D;
        const float* kh = kc + (h / G) * D;
        __m512 acc[8];
        for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
          const __m512 qv = _mm512_loadu_ps(qh + i);
          for (int u = 0; u < 8; ++u) acc[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kh + rows[j + u] + i), acc[u]);
        }
        __m256 half[8];
        for (int u = 0; u < 8; ++u) half[u] = _mm256_add_ps(_mm512_castps512_ps256(acc[u]), _mm512_extractf32x8_ps(acc[u], 1));
        _mm256_storeu_ps(sc_of(r, h) + j, _mm256_mul_ps(hsum8(half), _mm256_set1_ps(scale)));
      }
    }
  }
  std::vector<float> inv(R * nh);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nr = n_of(r), n8up = (nr + 7) / 8 * 8;
    for (int64_t j = nr / 8 * 8; j < nr; ++j)
      for (int64_t h = h0; h < h0 + nh; ++h) sc_of(r, h)[j] = dot(q + r * ld + h * D, kc + (h / G) * D + keys_of(r)[j], D) * scale;
    for (int64_t h = h0; h < h0 + nh; ++h) inv[r * nh + h - h0] = softmax_row(sc_of(r, h), n8up);
  }
  // o_rh = sum_j p_rhj v_j, up to 4 rows at a time
  for (int64_t h = h0; h < h0 + nh; ++h)
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t rb = std::min<int64_t>(4, R - r0);
      const float* sc[4];
      float* out[4];
      float iv[4];
      for (int64_t r = 0; r < rb; ++r) {
        sc[r] = sc_of(r0 + r, h);
        out[r] = o + (r0 + r) * ld + h * D;
        iv[r] = inv[(r0 + r) * nh + h - h0];
      }
      const bool first = h == h0 && r0 == 0;
      const float* vh = vc + (h / G) * D;
      const int64_t* const* kr = kk + r0;
      const int64_t* nr = nn + r0;
      switch (rb) {
        case 1: values_rows512<1, Tree>(sc, vh, kr, nr, common, D, iv, out, first, span); break;
        case 2: values_rows512<2, Tree>(sc, vh, kr, nr, common, D, iv, out, first, span); break;
        case 3: values_rows512<3, Tree>(sc, vh, kr, nr, common, D, iv, out, first, span); break;
        default: values_rows512<4, Tree>(sc, vh, kr, nr, common, D, iv, out, first, span); break;
      }
    }
}

// AVX-512 for the attention where the CPU has it and the caller allows it (the caller passes
// kernels/quant_linear.py's avx512_allowed(): SPECSPLIT_QUANT_AVX512=0 makes an AVX-512 machine
// stand in for an AVX2-only one, in the linears and the attention alike)
bool attention_avx512(bool allowed) {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return allowed && cpu;
}

// Which KV heads a work item takes: on one thread all of them (one pass over each token's KV row),
// with more threads one each, so the threads share a sequence's heads. Items are numbered
// unit * parts + part.
struct HeadParts {
  int64_t parts, hkv;
  explicit HeadParts(int64_t Hkv) : parts(at::get_num_threads() > 1 ? Hkv : 1), hkv(Hkv) {}
  std::pair<int64_t, int64_t> of(int64_t w) const {  // [g0, g1) of item w
    return parts == 1 ? std::pair<int64_t, int64_t>(0, hkv) : std::pair<int64_t, int64_t>(w % parts, w % parts + 1);
  }
};

}  // namespace

// Causal attention of each new token over its sequence's paged context.
//   query [T, H, D]: the batch's new tokens, sequence by sequence (q_lens[b] each)
//   k_cache, v_cache [num_blocks, block_size, Hkv, D] (the new tokens' K/V already stored)
//   block_tables [B, max_blocks] int64, q_lens [B], kv_lens [B] int64 (context after this forward)
// Token i of sequence b sits at position kv_lens[b] - q_lens[b] + i and attends to positions 0..that.
//   tree_mask [T] int64, optional (specsplit.draft_tree): a row's bits, 0 for a causal row. A
//   sequence's rows with bits are its last n, the n nodes of a draft tree in its last n slots
//   (kv_lens[b] - n ..); node i's bit j says it sees node j (its ancestors and itself: bit i set,
//   none above; at most TREE_MAX_NODES), and it sees every slot before the tree. Its keys are those
//   slots in order, so it is computed exactly as the row of its path verified as a chain (the same
//   sums in the same order).
// -> [T, H, D]
torch::Tensor decode_paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor q_lens, torch::Tensor kv_lens,
                                     double scale, bool avx512, c10::optional<torch::Tensor> tree_mask) {
  check_f32(query, "query");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: query [T, H, D], caches [blocks, block_size, Hkv, D], contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && q_lens.scalar_type() == torch::kInt64 &&
                  kv_lens.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "paged_attention: int64 block_tables, q_lens, kv_lens");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), B = q_lens.numel(), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0 && H % Hkv == 0 && kv_lens.numel() == B && block_tables.size(0) == B,
              "paged_attention: shapes disagree (head_dim a multiple of 8)");
  const bool trees = tree_mask.has_value();
  TORCH_CHECK(!trees || (tree_mask->scalar_type() == torch::kInt64 && tree_mask->dim() == 1 &&
                         tree_mask->numel() == T && tree_mask->is_contiguous()),
              "paged_attention: tree_mask must be int64 [T] (T = ", T, " query rows)");
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* kl = kv_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* bits = trees ? tree_mask->data_ptr<int64_t>() : nullptr;
  const int64_t token_stride = Hkv * D, num_blocks = k_cache.size(0);
  // per sequence: where its tokens start in the query, and each context position's offset in the caches
  std::vector<int64_t> seq_of(T), pos_of(T), row_start(B + 1, 0), nodes(B, 0);
  int64_t t = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ql[b] >= 0 && kl[b] >= ql[b] && kl[b] <= max_blocks * BS, "paged_attention: sequence ", b,
                " has q_len ", ql[b], " and kv_len ", kl[b], " (", max_blocks, " blocks of ", BS, ")");
    for (int64_t i = 0; i < ql[b]; ++i, ++t) {
      TORCH_CHECK(t < T, "paged_attention: q_lens add up to more than the query's ", T, " rows");
      seq_of[t] = b;
      pos_of[t] = kl[b] - ql[b] + i;
      if (bits && bits[t]) {
        ++nodes[b];
      } else {
        TORCH_CHECK(nodes[b] == 0, "paged_attention: sequence ", b, "'s tree rows must be its last rows");
      }
    }
    row_start[b + 1] = row_start[b] + kl[b];
  }
  TORCH_CHECK(t == T, "paged_attention: q_lens add up to ", t, ", the query has ", T, " rows");
  std::vector<int64_t> rows(row_start[B]);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j0 = 0, i = 0; j0 < kl[b]; j0 += BS, ++i) {  // block by block: no division per position
      const int64_t blk = tables[b * max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention: block ", blk, " outside the cache");
      for (int64_t j = j0; j < std::min(j0 + BS, kl[b]); ++j) rows[row_start[b] + j] = (blk * BS + j - j0) * token_stride;
    }
  // each row's keys: (offsets in the caches, how many). A causal row's are its sequence's first
  // pos + 1 positions (`rows` in place), and so are those of a tree's leading chain (node i that
  // sees nodes 0..i: its keys are the causal row's at its slot). Any other tree node's are listed
  // apart: the slots before the tree, then the nodes it sees, in slot order (a chain of its path
  // has them in that order).
  std::vector<const int64_t*> keys_of(T);
  std::vector<int64_t> num_keys(T);
  std::vector<int64_t> node_keys;
  std::vector<int64_t> node_start(T, -1);
  if (trees) {
    for (int64_t r = 0; r < T; ++r) {
      if (!bits[r]) continue;
      const int64_t b = seq_of[r], n = nodes[b], before = kl[b] - n, i = pos_of[r] - before;  // node i of n
      TORCH_CHECK(n <= TREE_MAX_NODES && (bits[r] >> i & 1) && bits[r] >> (i + 1) == 0, "paged_attention: row ", r,
                  " is node ", i, " of a ", n, "-node tree: its tree_mask must have bit ", i,
                  " set and none above (at most ", TREE_MAX_NODES, " nodes)");
      if (static_cast<uint64_t>(bits[r]) == (uint64_t{2} << i) - 1) continue;  // nodes 0..i: a leading chain's node
      node_start[r] = static_cast<int64_t>(node_keys.size());
      const int64_t* seq_rows = rows.data() + row_start[b];
      node_keys.insert(node_keys.end(), seq_rows, seq_rows + before);
      for (int64_t j = 0; j <= i; ++j)
        if (bits[r] >> j & 1) node_keys.push_back(seq_rows[before + j]);
      num_keys[r] = static_cast<int64_t>(node_keys.size()) - node_start[r];
    }
  }
  for (int64_t r = 0; r < T; ++r) {
    if (node_start[r] >= 0) {
      keys_of[r] = node_keys.data() + node_start[r];
    } else {
      keys_of[r] = rows.data() + row_start[seq_of[r]];
      num_keys[r] = pos_of[r] + 1;
    }
  }
  auto out = torch::empty({T, H, D}, query.options());
  const float* qp = query.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hkv;
  const float fscale = static_cast<float>(scale);
  if (D % 16 == 0 && attention_avx512(avx512)) {
    // work item: a run of up to ATTN_RUN_ROWS consecutive rows of one sequence, with its KV heads (HeadParts),
    // and how many keys its rows share: all (causal rows), or the slots before the sequence's tree
    // (a run with a listed node)
    struct Run {
      int64_t tok, rows, common;  // common < 0: causal rows
    };
    std::vector<Run> runs;
    for (int64_t b = 0, t0 = 0; b < B; t0 += ql[b], ++b)
      for (int64_t i = 0; i < ql[b]; i += ATTN_RUN_ROWS) {
        const int64_t R = std::min(ATTN_RUN_ROWS, ql[b] - i);
        bool listed = false;
        for (int64_t r = t0 + i; r < t0 + i + R; ++r) listed = listed || node_start[r] >= 0;
        runs.push_back({t0 + i, R, listed ? kl[b] - nodes[b] : -1});
      }
    const int64_t num_runs = static_cast<int64_t>(runs.size());
    const HeadParts heads(Hkv);
    at::parallel_for(0, num_runs * heads.parts, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> scores;
      for (int64_t w = w0; w < w1; ++w) {
        const Run& run = runs[w / heads.parts];
        const auto [g0, g1] = heads.of(w);
        const int64_t nmax = *std::max_element(num_keys.begin() + run.tok, num_keys.begin() + run.tok + run.rows);
        scores.resize(run.rows * (g1 - g0) * group * ((nmax + 7) / 8 * 8));
        if (run.common >= 0)
          attend_rows512<true>(qp + run.tok * H * D, H * D, kp, vp, keys_of.data() + run.tok, num_keys.data() + run.tok,
                               run.common, run.rows, D, group, g0, g1, fscale, scores.data(), op + run.tok * H * D);
        else
          attend_rows512<false>(qp + run.tok * H * D, H * D, kp, vp, keys_of.data() + run.tok,
                                num_keys.data() + run.tok, 0, run.rows, D, group, g0, g1, fscale, scores.data(),
                                op + run.tok * H * D);
      }
    });
    return out;
  }
  // work item: a token with its KV heads (HeadParts)
  const HeadParts heads(Hkv);
  at::parallel_for(0, T * heads.parts, 2, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t tok = w / heads.parts, n = num_keys[tok];
      const auto [g0, g1] = heads.of(w);
      scores.resize((g1 - g0) * group * ((n + 7) / 8 * 8));
      attend_group(qp + tok * H * D, kp, vp, keys_of[tok], n, D, group, g0, g1, fscale, scores.data(), op + tok * H * D);
    }
  });
  return out;
}

// gate_up [T, 2I] (gate | up, rows may be strided) -> silu(gate) * up [T, I], silu(g) = g / (1 + exp(-g))
torch::Tensor decode_silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 16 == 0,
              "silu_mul: gate_up [T, 2I], I a multiple of 8");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * ld;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(op + t * I + i, _mm256_mul_ps(sig, _mm256_loadu_ps(g + I + i)));
      }
    }
  });
  return out;
}

// k_cache[slot_mapping[t]] = key[t], v_cache[...] = value[t]; slots < 0 are skipped (padding rows)
//   key, value [T, Hkv, D] (rows may be strided, heads contiguous); caches [blocks, block_size, Hkv, D]
void decode_store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor slot_mapping) {
  check_f32(key, "key");
  check_f32(value, "value");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  const int64_t T = key.size(0), row = k_cache.size(2) * k_cache.size(3), slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) * key.size(2) == row &&
                  key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == T,
              "store_kv: key, value [T, Hkv, D]; caches [blocks, block_size, Hkv, D]; int64 slot_mapping [T]");
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sm[t];
    if (s < 0) continue;
    TORCH_CHECK(s < slots, "store_kv: slot ", s, " outside the cache's ", slots);
    std::copy_n(key.data_ptr<float>() + t * key.stride(0), row, k_cache.data_ptr<float>() + s * row);
    std::copy_n(value.data_ptr<float>() + t * value.stride(0), row, v_cache.data_ptr<float>() + s * row);
  }
}

#ifndef SPECSPLIT_NO_MODULE  // kernels/cpu/layer_stack.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", &decode_silu_mul, "silu(gate) * up of fp32 rows");
  m.def("store_kv", &decode_store_kv, "write new tokens' K and V into the paged caches, fp32");
  m.def("rms_norm", &decode_rms_norm, "RMSNorm of fp32 rows");
  m.def("rope", &decode_rope, "rotate-half rotary embedding of fp32 heads");
  m.def("paged_attention", &decode_paged_attention, "causal (or draft tree) attention over the paged KV cache, fp32",
        pybind11::arg("query"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("q_lens"), pybind11::arg("kv_lens"), pybind11::arg("scale"), pybind11::arg("avx512"),
        pybind11::arg("tree_mask") = pybind11::none());
}
#endif
