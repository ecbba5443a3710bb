// CPU kernels for the few-row forwards of decoding (decode steps, verify of k + 1 tokens, head draft steps).
//
// A decode step on a CPU is memory-bound: every weight is read once for one to a few rows of activations. These
// kernels read each weight once for up to 8 rows (fp32 activations, fp32 accumulation, weights in fp32 or bf16; in the
// AVX512-BF16 build bf16 weights meet bf16-rounded activations in `vdpbf16ps`, still accumulating in fp32),
// fuse what sits between the matmuls (RMSNorm, rotary embedding, the K/V cache write, SiLU-and-multiply, the residual
// add) and attend over the paged K/V cache in place, so one decoder layer is seven calls instead of ~50 small ops.
//
// Every output row is computed independently and in the same order whatever the number of rows, so a verify of k + 1
// tokens gives bit-identical rows to k + 1 single-token decode steps (greedy speculative output equals plain greedy).
//
// Registered as torch.ops.mtp_cpu.*; built on first use by mtp_train/runtime/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MTP_AVX2 1
#else
#define MTP_AVX2 0
#endif
// The build for CPUs with AVX-512 (kernels.py picks it by the CPU's flags): the weight streams in 16-lane vectors, and
// with AVX512-BF16 a bf16 weight meets bf16 activations in `vdpbf16ps` (no widening; fp32 accumulation).
#if MTP_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define MTP_AVX512 1
#else
#define MTP_AVX512 0
#endif
#if MTP_AVX512 && defined(__AVX512BF16__)
#define MTP_AVX512_BF16 1
#else
#define MTP_AVX512_BF16 0
#endif

namespace {

using bf16_bits = uint16_t;

inline float bf16_to_float(bf16_bits v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const bf16_bits* p) { return bf16_to_float(*p); }
inline float load_scalar(const int8_t* p) { return static_cast<float>(*p); }  // int8 weights: scaled per row later

#if MTP_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_bits* p) {
  __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for fp32 lanes: Cody-Waite range reduction and a degree-6 polynomial (max relative error ~2e-7 on the softmax
// range), inputs below -87 flush to 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return _mm256_andnot_ps(underflow, result);
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if MTP_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  total = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha * x
  int64_t i = 0;
#if MTP_AVX2
  __m256 a = _mm256_set1_ps(alpha);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// The largest of v[0:n] (-inf for none); a max is exact in any order.
inline float max_of(const float* v, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if MTP_AVX2
  __m256 m0 = _mm256_set1_ps(best), m1 = m0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(v + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(v + i + 8));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < n; ++i) best = std::max(best, v[i]);
  return best;
}

// Softmax numerator in place: v[i] = exp(v[i] - max); returns the sum.
inline float exp_minus_max(float* v, int64_t n, float max_value) {
  int64_t i = 0;
  float total = 0.f;
#if MTP_AVX2
  __m256 m = _mm256_set1_ps(max_value), acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), m));
    _mm256_storeu_ps(v + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) {
    v[i] = std::exp(v[i] - max_value);
    total += v[i];
  }
  return total;
}

// ------------------------------------------------------------------------------------------------------------------
// Linear: y[r, n] = sum_k x[r, k] w[n, k] (+ bias[n]) (+ residual[r, n]), up to 8 rows per pass over the weights.
//
// Each task walks its weight rows strictly in address order, one row (or one gate/up pair) at a time: a single
// sequential stream per thread is what the hardware prefetcher serves best (measured on a Zen 3: 13.4 GB/s for one
// stream per thread against 8.9-10.8 GB/s for 2-8 interleaved rows). With more than one activation row the FMAs
// slow the stream down; a software prefetch 16 KB ahead keeps it going (4 rows: 21.5 ms against 20.5 ms for 1 row
// over SmolLM2's bf16 weights, 31 ms without it).
//
// Batch invariance: every dot product accumulates in the same order whatever the row count (kU partial sums along k,
// rows in groups of at most 4 sharing each weight load; a second group re-reads the weight row from L1), so a verify
// of k + 1 rows reproduces k + 1 single-row decode steps bit for bit.
//
// SiluMul: the weight is the gate and up projections interleaved in chunks of 8 columns (`pack_gate_up`): row n holds
// gate[n, 0:8], up[n, 0:8], gate[n, 8:16], ... (2 K values), and y[r, n] = silu(x . gate[n]) * (x . up[n]).
// ------------------------------------------------------------------------------------------------------------------

constexpr int64_t kPrefetchBytes = 16384;  // how far ahead of the weight stream to prefetch (1-4 KB: no effect)
// Into L2, not L1: 16 KB of prefetched weights beside a few rows of fp32 activations (4 rows of the down projection's
// 1,536 inputs are 24 KB) overflow a 32 KB L1. On a Zen 4, the AVX2 build streaming 265 MB of bf16 weights
// (GB/s, L1 -> L2 hint): 1 row 32.0 -> 32.6, 3 rows 24.2 -> 34.1, 4 rows 21.2 -> 27.4 (576 inputs), 21.2 -> 33.0
// (1,536 inputs); the AVX-512 build with the bf16 dot products: a verify of 4 rows 20.6 -> 15.8 ms, the decode step
// 14.4 -> 13.0 ms (SmolLM2, 2 threads, the variants alternated in one process).
#define MTP_PREFETCH_HINT _MM_HINT_T1

#if MTP_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_bits* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// row_dots with 16-lane vectors (fp32 activations). P == 1: a vector holds 16 consecutive k. P == 2: it holds the
// row's gate[k:k+8] and up[k:k+8] chunk, met by x[k:k+8] in both halves; the halves are the two dot products.
template <typename W, int RG, int P>
inline void row_dots_avx512(const W* row, const float* x, int64_t ldx, int64_t K, float sums[P][RG]) {
  constexpr int kU = 2;           // partial sums along k per dot product (FMA latency)
  constexpr int kStep = 16 / P;   // k per vector
  __m512 acc[RG][kU];
  _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r)
    _Pragma("GCC unroll 16") for (int u = 0; u < kU; ++u) acc[r][u] = _mm512_setzero_ps();
  auto x_vec = [&](int r, int64_t k) {
    if constexpr (P == 1) return _mm512_loadu_ps(x + r * ldx + k);
    else return _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + k));
  };
  int64_t k = 0;
  for (; k + kStep * kU <= K; k += kStep * kU) {
    _mm_prefetch(reinterpret_cast<const char*>(row + P * k) + kPrefetchBytes, MTP_PREFETCH_HINT);
    _Pragma("GCC unroll 16") for (int u = 0; u < kU; ++u) {
      const __m512 wv = load16(row + P * (k + kStep * u));
      _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r)
        acc[r][u] = _mm512_fmadd_ps(wv, x_vec(r, k + kStep * u), acc[r][u]);
    }
  }
  for (; k + kStep <= K; k += kStep) {
    const __m512 wv = load16(row + P * k);
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) acc[r][0] = _mm512_fmadd_ps(wv, x_vec(r, k), acc[r][0]);
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) {
    __m512 total = acc[r][0];
    _Pragma("GCC unroll 16") for (int u = 1; u < kU; ++u) total = _mm512_add_ps(total, acc[r][u]);
    if constexpr (P == 1) {
      sums[0][r] = _mm512_reduce_add_ps(total);
    } else {
      sums[0][r] = _mm512_mask_reduce_add_ps(0x00FF, total);
      sums[1][r] = _mm512_mask_reduce_add_ps(0xFF00, total);
    }
  }
  for (; k < K; ++k) {  // columns past the last multiple of 16 (plain layout only: pack_gate_up needs K % 8 == 0)
    const float wk = load_scalar(row + k);
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) sums[0][r] += wk * x[r * ldx + k];
  }
}
#endif

#if MTP_AVX512_BF16
// row_dots of NW consecutive bf16 weight rows against bf16 activations (`to_bf16_activations`: rounded once per call,
// laid out like the weight rows), 32 products per `vdpbf16ps`, fp32 accumulation. `len` = a row's length in bf16
// values (P K). P == 2: a row alternates 8-value gate and up chunks, so fp32 lanes 0-3, 8-11 sum gate products, 4-7,
// 12-15 up. Two rows per pass (NW = 2) share each activation load and the loop's overhead: with SmolLM2's 576-wide
// rows (1,152 bytes, nine iterations) one row per pass streamed ~30 GB/s on a Zen 4 where 4096-wide rows reach ~45.
// `linear_block` takes two rows per pass from 4 activation rows up only: below, one row per pass (a single stream per
// thread) streamed faster from memory — the whole decode step 0.92-0.95x, verify(3) 0.96-0.99x, 4 and 8 rows
// 1.05x and 1.12x slower (SmolLM2, Zen 4, old and new kernels alternated in one process, session 12).
// Each dot product accumulates in the same order whatever NW and RG (batch invariance).
template <int RG, int P, int NW>
inline void row_dots_dpbf16(const bf16_bits* row, int64_t row_stride, const bf16_bits* x, int64_t ldx, int64_t len,
                            float sums[NW][P][RG]) {
  constexpr int kU = 2;
  __m512 acc[NW][RG][kU];
  _Pragma("GCC unroll 16") for (int w = 0; w < NW; ++w)
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r)
      _Pragma("GCC unroll 16") for (int u = 0; u < kU; ++u) acc[w][r][u] = _mm512_setzero_ps();
  auto dp = [](__m512 a, __m512i w, __m512i v) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)v); };
  int64_t i = 0;
  for (; i + 32 * kU <= len; i += 32 * kU) {  // 128 bytes of each row: two cache lines to prefetch per row
    _Pragma("GCC unroll 16") for (int w = 0; w < NW; ++w) {
      const char* ahead = reinterpret_cast<const char*>(row + w * row_stride + i) + kPrefetchBytes;
      _mm_prefetch(ahead, MTP_PREFETCH_HINT);
      _mm_prefetch(ahead + 64, MTP_PREFETCH_HINT);
    }
    _Pragma("GCC unroll 16") for (int u = 0; u < kU; ++u) {
      __m512i wv[NW];
      _Pragma("GCC unroll 16") for (int w = 0; w < NW; ++w) wv[w] = _mm512_loadu_si512(row + w * row_stride + i + 32 * u);
      _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) {
        const __m512i xv = _mm512_loadu_si512(x + r * ldx + i + 32 * u);
        _Pragma("GCC unroll 16") for (int w = 0; w < NW; ++w) acc[w][r][u] = dp(acc[w][r][u], wv[w], xv);
      }
    }
  }
  for (; i < len; i += 32) {  // the rest, zero-padded by masked loads
    const __mmask32 mask = len - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (len - i)) - 1;
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + r * ldx + i);
      _Pragma("GCC unroll 16") for (int w = 0; w < NW; ++w)
        acc[w][r][0] = dp(acc[w][r][0], _mm512_maskz_loadu_epi16(mask, row + w * row_stride + i), xv);
    }
  }
  _Pragma("GCC unroll 16") for (int w = 0; w < NW; ++w)
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) {
      __m512 total = acc[w][r][0];
      _Pragma("GCC unroll 16") for (int u = 1; u < kU; ++u) total = _mm512_add_ps(total, acc[w][r][u]);
      if constexpr (P == 1) {
        sums[w][0][r] = _mm512_reduce_add_ps(total);
      } else {
        sums[w][0][r] = _mm512_mask_reduce_add_ps(0x0F0F, total);
        sums[w][1][r] = _mm512_mask_reduce_add_ps(0xF0F0, total);
      }
    }
}
#endif

// sums[p][r] = x[r] . (part p of the weight row), for RG activation rows. kU partial sums per dot product hide the
// FMA latency: 2 for a plain row, 1 for a gate/up pair (whose two dot products are independent already), so that
// P * RG * kU <= 8 accumulators for groups of 4 rows.
template <typename W, int RG, int P>
inline void row_dots(const W* row, const float* x, int64_t ldx, int64_t K, float sums[P][RG]) {
#if MTP_AVX512
  return row_dots_avx512<W, RG, P>(row, x, ldx, K, sums);
#endif
  constexpr int kU = P == 2 ? 1 : 2;
  int64_t k = 0;
#if MTP_AVX2
  __m256 acc[P][RG][kU];
  _Pragma("GCC unroll 16") for (int p = 0; p < P; ++p)
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r)
      _Pragma("GCC unroll 16") for (int u = 0; u < kU; ++u) acc[p][r][u] = _mm256_setzero_ps();
  for (; k + 8 * kU <= K; k += 8 * kU) {
    _mm_prefetch(reinterpret_cast<const char*>(row + P * k) + kPrefetchBytes, MTP_PREFETCH_HINT);
    _Pragma("GCC unroll 16") for (int u = 0; u < kU; ++u) {
      __m256 wv[P];
      _Pragma("GCC unroll 16") for (int p = 0; p < P; ++p) wv[p] = load8(row + P * (k + 8 * u) + 8 * p);
      _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * ldx + k + 8 * u);
        _Pragma("GCC unroll 16") for (int p = 0; p < P; ++p) acc[p][r][u] = _mm256_fmadd_ps(wv[p], xv, acc[p][r][u]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv[P];
    _Pragma("GCC unroll 16") for (int p = 0; p < P; ++p) wv[p] = load8(row + P * k + 8 * p);
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      _Pragma("GCC unroll 16") for (int p = 0; p < P; ++p) acc[p][r][0] = _mm256_fmadd_ps(wv[p], xv, acc[p][r][0]);
    }
  }
  _Pragma("GCC unroll 16") for (int p = 0; p < P; ++p)
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) {
      __m256 total = acc[p][r][0];
      _Pragma("GCC unroll 16") for (int u = 1; u < kU; ++u) total = _mm256_add_ps(total, acc[p][r][u]);
      sums[p][r] = hsum(total);
    }
#else
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < RG; ++r) sums[p][r] = 0.f;
  if (P == 2) {  // the interleaved layout, chunk by chunk (K is a multiple of 8 here)
    for (; k < K; k += 8)
      for (int p = 0; p < P; ++p)
        for (int i = 0; i < 8; ++i) {
          const float wk = load_scalar(row + P * k + 8 * p + i);
          for (int r = 0; r < RG; ++r) sums[p][r] += wk * x[r * ldx + k + i];
        }
  }
#endif
  for (; k < K; ++k) {  // columns past the last multiple of 8 (plain layout only: pack_gate_up needs K % 8 == 0)
    const float wk = load_scalar(row + k);
    _Pragma("GCC unroll 16") for (int r = 0; r < RG; ++r) sums[0][r] += wk * x[r * ldx + k];
  }
}

// The dot products of one weight row: fp32 activations (any weight), or bf16 activations for bf16 weights where the
// CPU has vdpbf16ps (`X` = bf16_bits; x then holds P K values per row, laid out like the weight row).
template <int RG, int P, typename W>
inline void dots(const W* row, const float* x, int64_t ldx, int64_t K, float sums[P][RG]) {
  row_dots<W, RG, P>(row, x, ldx, K, sums);
}
#if MTP_AVX512_BF16
template <int RG, int P>
inline void dots(const bf16_bits* row, const bf16_bits* x, int64_t ldx, int64_t K, float sums[P][RG]) {
  row_dots_dpbf16<RG, P, 1>(row, P * K, x, ldx, P * K, reinterpret_cast<float(*)[P][RG]>(sums));
}
#endif

template <typename W, typename X, int R, bool SiluMul>
void linear_block(const X* x, int64_t ldx, const W* w, int64_t K, int64_t n_begin, int64_t n_end, float* y,
                  int64_t ldy, const float* bias, const float* scale, const float* residual, int64_t ldr) {
  constexpr int P = SiluMul ? 2 : 1;               // dot products per weight row
  constexpr int kGroup = 4;                        // rows sharing each weight load (8 accumulators, see row_dots)
  constexpr int G1 = R < kGroup ? R : kGroup;      // rows of the first group
  constexpr int G2 = R - G1;                       // and of the second (R <= 8)
  static_assert(G2 <= kGroup, "at most 8 rows per pass");
  const int64_t row_len = K * P;
  auto store = [&](int64_t n, const float (&sums)[P][R]) {
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      float value;
      if (SiluMul) {
        // bias (optional) holds the gate and up biases interleaved: [gate_bias[n], up_bias[n]] at 2 n.
        // scale (int8 weights) holds the gate and up rows' scales the same way
        const float gate = sums[0][r] * (scale ? scale[2 * n] : 1.f) + (bias ? bias[2 * n] : 0.f);
        const float up = sums[P - 1][r] * (scale ? scale[2 * n + 1] : 1.f) + (bias ? bias[2 * n + 1] : 0.f);
        value = gate / (1.f + std::exp(-gate)) * up;
      } else {
        value = sums[0][r];
        if (scale) value *= scale[n];
        if (bias) value += bias[n];
        if (residual) value += residual[r * ldr + n];
      }
      y[r * ldy + n] = value;
    }
  };
  int64_t n = n_begin;
#if MTP_AVX512_BF16
  if constexpr (std::is_same_v<X, bf16_bits> && R >= 4) {  // two weight rows per pass (see row_dots_dpbf16)
    for (; n + 2 <= n_end; n += 2) {
      const W* row = w + n * row_len;
      float sums[2][P][R];
      {
        float part[2][P][G1];
        row_dots_dpbf16<G1, P, 2>(row, row_len, x, ldx, row_len, part);
        for (int v = 0; v < 2; ++v)
          for (int p = 0; p < P; ++p)
            for (int r = 0; r < G1; ++r) sums[v][p][r] = part[v][p][r];
      }
      if constexpr (G2 > 0) {
        float part[2][P][G2];
        row_dots_dpbf16<G2, P, 2>(row, row_len, x + G1 * ldx, ldx, row_len, part);
        for (int v = 0; v < 2; ++v)
          for (int p = 0; p < P; ++p)
            for (int r = 0; r < G2; ++r) sums[v][p][G1 + r] = part[v][p][r];
      }
      store(n, sums[0]);
      store(n + 1, sums[1]);
    }
  }
#endif
  for (; n < n_end; ++n) {
    const W* row = w + n * row_len;
    float sums[P][R];
    {
      float part[P][G1];
      dots<G1, P>(row, x, ldx, K, part);
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < G1; ++r) sums[p][r] = part[p][r];
    }
    if constexpr (G2 > 0) {
      float part[P][G2];
      dots<G2, P>(row, x + G1 * ldx, ldx, K, part);
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < G2; ++r) sums[p][G1 + r] = part[p][r];
    }
    store(n, sums);
  }
}

template <typename W, typename X, int R, bool SiluMul>
void linear_rows(const X* x, int64_t ldx, const W* w, int64_t K, int64_t N, float* y, int64_t ldy,
                 const float* bias, const float* scale, const float* residual, int64_t ldr) {
  constexpr int P = SiluMul ? 2 : 1;
  // ~64 KB of weights per task: enough work to amortize scheduling, enough tasks to balance the threads.
  const int64_t grain = std::max<int64_t>(1, 64 * 1024 / (int64_t(sizeof(W)) * K * P));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    linear_block<W, X, R, SiluMul>(x, ldx, w, K, begin, end, y, ldy, bias, scale, residual, ldr);
  });
}

template <typename W, typename X, bool SiluMul>
void linear_dispatch(const X* x, int64_t ldx, const W* w, int64_t K, int64_t N, float* y, int64_t ldy,
                     const float* bias, const float* scale, const float* residual, int64_t ldr, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t r = std::min<int64_t>(8, rows - r0);
    const X* xr = x + r0 * ldx;
    float* yr = y + r0 * ldy;
    const float* res = residual ? residual + r0 * ldr : nullptr;
    switch (r) {
#define MTP_CASE(NR) \
  case NR:           \
    linear_rows<W, X, NR, SiluMul>(xr, ldx, w, K, N, yr, ldy, bias, scale, res, ldr); \
    break;
      MTP_CASE(1) MTP_CASE(2) MTP_CASE(3) MTP_CASE(4) MTP_CASE(5) MTP_CASE(6) MTP_CASE(7) MTP_CASE(8)
#undef MTP_CASE
    }
  }
}

template <typename W, typename X>
void linear_any(bool silu_mul, const X* x, int64_t ldx, const W* w, int64_t K, int64_t N, float* y, int64_t ldy,
                const float* bias, const float* scale, const float* residual, int64_t ldr, int64_t rows) {
  if (silu_mul)
    linear_dispatch<W, X, true>(x, ldx, w, K, N, y, ldy, bias, scale, residual, ldr, rows);
  else
    linear_dispatch<W, X, false>(x, ldx, w, K, N, y, ldy, bias, scale, residual, ldr, rows);
}

void check_activations(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// Whether bf16 weights meet bf16 activations (`vdpbf16ps`): in the AVX512-BF16 build, unless the environment sets
// MTP_TRAIN_CPU_BF16_ACTIVATIONS=0 (then the activations stay fp32 and the weights are widened, as in the AVX2 build).
bool bf16_activations() {
#if MTP_AVX512_BF16
  static const bool enabled = [] {
    const char* value = std::getenv("MTP_TRAIN_CPU_BF16_ACTIVATIONS");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
#else
  return false;
#endif
}

// x [rows, K] fp32 -> [rows, P K] bf16 (round to nearest even), laid out like the weight rows it meets: P == 2 repeats
// each chunk of 8 values (x[8c:8c+8] twice) to face the gate and up chunks of a packed gate_up row.
at::Tensor to_bf16_activations(const at::Tensor& x, int P) {
  const int64_t rows = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({rows, P * K}, x.options().dtype(at::kBFloat16));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x.data_ptr<float>() + r * x.stride(0);
    at::BFloat16* dst = out.data_ptr<at::BFloat16>() + r * P * K;
    if (P == 1) {
      for (int64_t k = 0; k < K; ++k) dst[k] = at::BFloat16(src[k]);
    } else {
      for (int64_t k = 0; k < K; ++k) dst[2 * (k / 8) * 8 + k % 8] = dst[2 * (k / 8) * 8 + 8 + k % 8] = at::BFloat16(src[k]);
    }
  }
  return out;
}

at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& scale,
                       bool silu_mul) {
  check_activations(x, "x");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous 2-D tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
                  weight.scalar_type() == at::kChar,
              "weight must be float32, bfloat16 or int8 (with its per-row scale)");
  const bool int8_weight = weight.scalar_type() == at::kChar;
  TORCH_CHECK(int8_weight == (scale.has_value() && scale->defined()),
              int8_weight ? "int8 weights need their per-row scale" : "a scale goes with int8 weights only");
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.size(1) == K * (silu_mul ? 2 : 1), "x has ", K, " features, weight rows have ", weight.size(1),
              silu_mul ? " (a packed gate_up weight has 2 K)" : "");
  TORCH_CHECK(!silu_mul || K % 8 == 0, "packed gate_up weights need K % 8 == 0");
  const int64_t N = weight.size(0);
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    const int64_t bias_len = N * (silu_mul ? 2 : 1);
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == bias_len,
                "bias must be float32 with ", bias_len, " elements");
    bias_ptr = bias->data_ptr<float>();
  }
  const float* scale_ptr = nullptr;
  if (int8_weight) {
    const int64_t scale_len = N * (silu_mul ? 2 : 1);
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == scale_len,
                "scale must be float32 with ", scale_len, " elements");
    scale_ptr = scale->data_ptr<float>();
  }
  const float* residual_ptr = nullptr;
  int64_t ldr = 0;
  if (residual.has_value() && residual->defined()) {
    check_activations(*residual, "residual");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == N, "residual must be [", rows, ", ", N, "]");
    residual_ptr = residual->data_ptr<float>();
    ldr = residual->stride(0);
  }
  at::Tensor y = at::empty({rows, N}, x.options());
  if (int8_weight) {  // weight-only int8: fp32 activations, the row's scale applied to its fp32 sum
    linear_any<int8_t>(silu_mul, x.data_ptr<float>(), x.stride(0), weight.data_ptr<int8_t>(), K, N, y.data_ptr<float>(),
                       N, bias_ptr, scale_ptr, residual_ptr, ldr, rows);
  } else if (weight.scalar_type() == at::kFloat) {
    linear_any<float>(silu_mul, x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), K, N, y.data_ptr<float>(), N,
                           bias_ptr, nullptr, residual_ptr, ldr, rows);
#if MTP_AVX512_BF16
  } else if (bf16_activations()) {
    const at::Tensor x_bf16 = to_bf16_activations(x, silu_mul ? 2 : 1);
    linear_any<bf16_bits, bf16_bits>(silu_mul, reinterpret_cast<const bf16_bits*>(x_bf16.data_ptr<at::BFloat16>()),
                                     x_bf16.stride(0), reinterpret_cast<const bf16_bits*>(weight.data_ptr<at::BFloat16>()),
                                     K, N, y.data_ptr<float>(), N, bias_ptr, nullptr, residual_ptr, ldr, rows);
#endif
  } else {
    linear_any<bf16_bits>(silu_mul, x.data_ptr<float>(), x.stride(0),
                               reinterpret_cast<const bf16_bits*>(weight.data_ptr<at::BFloat16>()), K, N,
                               y.data_ptr<float>(), N, bias_ptr, nullptr, residual_ptr, ldr, rows);
  }
  return y;
}

// y = x @ weight.T (+ bias) (+ residual); x [rows, K] fp32, weight [N, K] fp32 or bf16, or int8 with `scale` [N]
// (row n's weights are weight[n] * scale[n]; weight-only quantization, activations stay fp32).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& scale) {
  return linear_impl(x, weight, bias, residual, scale, false);
}

// silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias); gate_up [inter, 2 K] holds gate and up interleaved in chunks
// of 8 columns, the optional bias [inter, 2] the two biases side by side, and for int8 weights the scale [inter, 2]
// the gate and up rows' scales.
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& gate_up, const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& scale) {
  return linear_impl(x, gate_up, bias, c10::nullopt, scale, true);
}

// RMSNorm of one row as transformers computes it in fp32: weight * (x * rsqrt(mean(x^2) + eps)).
inline void rms_norm_row(const float* x, const float* w, double eps, int64_t dim, float* y) {
  const float inv = 1.f / std::sqrt(dot(x, x, dim) / static_cast<float>(dim) + static_cast<float>(eps));
  for (int64_t i = 0; i < dim; ++i) y[i] = w[i] * (x[i] * inv);
}

// RMSNorm of each row (rms_norm_row).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_activations(x, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1), "norm weight must be float32 [",
              x.size(1), "]");
  const int64_t rows = x.size(0), dim = x.size(1);
  at::Tensor y = at::empty({rows, dim}, x.options());
  const at::Tensor weight_c = weight.contiguous();  // held: a temporary's pointer would dangle
  const float* w = weight_c.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row(x.data_ptr<float>() + r * x.stride(0), w, eps, dim, y.data_ptr<float>() + r * dim);
  return y;
}

// An MTP head's input projection for a few rows in one call: eh_proj(cat(enorm(embed[t]), hnorm(h))) — the embedding
// row of each token and the hidden state normalized (the same RMSNorm as `rms_norm`), side by side, through `linear`
// (fp32, bf16 or int8 weight). The rows are those of the separate calls, bit for bit. token_ids [T] int64, hidden
// [T, d] fp32, embed [V, d] fp32, weight [d_out, 2 d].
at::Tensor mtp_input(const at::Tensor& token_ids, const at::Tensor& hidden, const at::Tensor& embed,
                     const at::Tensor& enorm, double enorm_eps, const at::Tensor& hnorm, double hnorm_eps,
                     const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& scale) {
  check_activations(hidden, "hidden");
  const int64_t T = token_ids.numel(), d = hidden.size(1);
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.dim() == 1 && hidden.size(0) == T,
              "token_ids must be int64 [T] beside hidden [T, d]");
  TORCH_CHECK(embed.scalar_type() == at::kFloat && embed.dim() == 2 && embed.size(1) == d && embed.is_contiguous(),
              "embed must be a contiguous float32 [vocab, ", d, "]");
  TORCH_CHECK(enorm.scalar_type() == at::kFloat && hnorm.scalar_type() == at::kFloat && enorm.numel() == d &&
                  hnorm.numel() == d && enorm.is_contiguous() && hnorm.is_contiguous(),
              "norm weights must be contiguous float32 [", d, "]");
  const at::Tensor ids_c = token_ids.contiguous();  // held: a temporary's pointer would dangle
  const int64_t* ids = ids_c.data_ptr<int64_t>();
  const int64_t vocab = embed.size(0);
  at::Tensor joined = at::empty({T, 2 * d}, hidden.options());
  float* out = joined.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id ", ids[t], " outside the embedding's ", vocab, " rows");
    rms_norm_row(embed.data_ptr<float>() + ids[t] * d, enorm.data_ptr<float>(), enorm_eps, d, out + t * 2 * d);
    rms_norm_row(hidden.data_ptr<float>() + t * hidden.stride(0), hnorm.data_ptr<float>(), hnorm_eps, d,
                 out + t * 2 * d + d);
  }
  return linear(joined, weight, bias, c10::nullopt, scale);
}

// In place on one head vector: optional per-head RMSNorm (Qwen3's q_norm / k_norm), then rotate-half RoPE.
inline void norm_and_rotate(float* v, int64_t D, const float* cos, const float* sin, const float* norm_weight,
                            float eps, float* scratch) {
  if (norm_weight) {
    const float inv = 1.f / std::sqrt(dot(v, v, D) / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) v[i] = norm_weight[i] * (v[i] * inv);
  }
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) scratch[i] = v[i] * cos[i] - v[i + half] * sin[i];
  for (int64_t i = half; i < D; ++i) scratch[i] = v[i] * cos[i] + v[i - half] * sin[i];
  std::memcpy(v, scratch, D * sizeof(float));
}

// Attention of a few new tokens per sequence over the paged K/V cache, in place (no gather of the history).
//
// qkv:  [T, (H + 2 G) * D] fp32, the fused projection output of the batch's new tokens (q heads, then k, then v);
//       its q and k parts are normalized (if weights are given) and rotated in place.
// cos, sin: [T, D] rotary tables of the new tokens' positions.
// The cache holds K and V in fp32 or bf16 (`C`): a bf16 cache halves the bytes a step streams at long context; the
// new tokens' K/V are rounded to it (nearest even) as they are written, and every query reads them back from it.
//
// Scores: score = scale * (q . K_i). Each dot accumulates along D in one fixed order (q[0:8] * K[0:8], then one FMA per
// further 8 lanes, in order) and is reduced horizontally in one fixed order (`quad_sums`), whichever other dots share
// its tile, so a key's score depends neither on the range asked for nor on the other query rows (batch invariance).
// A tile is up to 4 query rows (the query heads of one KV head, and the tokens of a verify) by 2 keys: each K load
// feeds 4 FMAs and each q load 2, and the 8 dot products are 8 independent FMA chains (one row's dots one at a time,
// as before: a verify of 4 tokens over 4,096 fp32 keys took 22.3 ms for SmolLM2's 30 layers on a Zen 4, now 15.5).
#if MTP_AVX2
// The sums of four 8-lane accumulators, each as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), times scale.
inline __m128 quad_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m128 scale4) {
  const __m256 quad = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(quad), _mm256_extractf128_ps(quad, 1)), scale4);
}

// scores[r][i + j] for query rows r < kR and keys j < kK of `keys` (key i + j at keys[i + j] + offset).
template <int kD, int kR, int kK, typename C>
inline void score_tile(const float* const* q_rows, const C* const* keys, int64_t offset, int64_t i, __m128 scale4,
                       float* const* scores) {
  constexpr int kV = kD / 8;
  const C* k[kK];
  #pragma GCC unroll 16
  for (int j = 0; j < kK; ++j) k[j] = keys[i + j] + offset;
  __m256 acc[kR][kK];
  #pragma GCC unroll 16
  for (int j = 0; j < kK; ++j) {
    const __m256 kv = load8(k[j]);
    #pragma GCC unroll 16
    for (int r = 0; r < kR; ++r) acc[r][j] = _mm256_mul_ps(_mm256_loadu_ps(q_rows[r]), kv);
  }
#pragma GCC unroll 16
  for (int v = 1; v < kV; ++v) {
    __m256 kv[kK];
    #pragma GCC unroll 16
    for (int j = 0; j < kK; ++j) kv[j] = load8(k[j] + 8 * v);
    #pragma GCC unroll 16
    for (int r = 0; r < kR; ++r) {
      const __m256 q = _mm256_loadu_ps(q_rows[r] + 8 * v);
      #pragma GCC unroll 16
      for (int j = 0; j < kK; ++j) acc[r][j] = _mm256_fmadd_ps(q, kv[j], acc[r][j]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  #pragma GCC unroll 16
  for (int j = 0; j < kK; ++j) {
    alignas(16) float out4[4];
    _mm_store_ps(out4, quad_sums(acc[0][j], kR > 1 ? acc[1 % kR][j] : zero, kR > 2 ? acc[2 % kR][j] : zero,
                                 kR > 3 ? acc[3 % kR][j] : zero, scale4));
    #pragma GCC unroll 16
    for (int r = 0; r < kR; ++r) scores[r][i + j] = out4[r];
  }
}

template <int kD, int kR, typename C>
void score_rows_of(const float* const* q_rows, const C* const* keys, int64_t offset, int64_t lo, int64_t hi,
                   __m128 scale4, float* const* scores) {
  int64_t i = lo;
  for (; i + 2 <= hi; i += 2) score_tile<kD, kR, 2>(q_rows, keys, offset, i, scale4, scores);
  if (i < hi) score_tile<kD, kR, 1>(q_rows, keys, offset, i, scale4, scores);
}

template <int kD, typename C>
void score_rows_avx2(const float* const* q_rows, int64_t n_rows, const C* const* keys, int64_t offset, int64_t lo,
                     int64_t hi, float scale, float* const* scores) {
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t r = 0; r < n_rows; r += 4) {
    switch (std::min<int64_t>(4, n_rows - r)) {
      case 4: score_rows_of<kD, 4>(q_rows + r, keys, offset, lo, hi, scale4, scores + r); break;
      case 3: score_rows_of<kD, 3>(q_rows + r, keys, offset, lo, hi, scale4, scores + r); break;
      case 2: score_rows_of<kD, 2>(q_rows + r, keys, offset, lo, hi, scale4, scores + r); break;
      default: score_rows_of<kD, 1>(q_rows + r, keys, offset, lo, hi, scale4, scores + r); break;
    }
  }
}

// out[r][0:kD] = sum over keys i in [lo, hi), in order, of weights[r][i] * V_i (V_i = v_rows[i] + offset), for kR
// rows that share the range, 32 lanes at a time (each lane's sum runs over the keys in the same order whatever the
// rows and lanes beside it).
template <int kD, int kR, typename C>
void weighted_sum_tile(const float* const* weights, const C* const* v_rows, int64_t offset, int64_t lo, int64_t hi,
                       float* const* out) {
  constexpr int kLanes = kD < 32 ? kD : 32, kV = kLanes / 8;
  #pragma GCC unroll 16
  for (int lane = 0; lane < kD; lane += kLanes) {
    __m256 acc[kR][kV];
    #pragma GCC unroll 16
    for (int r = 0; r < kR; ++r)
      #pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t i = lo; i < hi; ++i) {
      const C* row = v_rows[i] + offset + lane;
      __m256 w[kR];
      #pragma GCC unroll 16
      for (int r = 0; r < kR; ++r) w[r] = _mm256_broadcast_ss(weights[r] + i);
      #pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) {
        const __m256 x = load8(row + 8 * v);
        #pragma GCC unroll 16
        for (int r = 0; r < kR; ++r) acc[r][v] = _mm256_fmadd_ps(w[r], x, acc[r][v]);
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < kR; ++r)
      #pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) _mm256_storeu_ps(out[r] + lane + 8 * v, acc[r][v]);
  }
}

template <int kD, typename C>
void weighted_sums_avx2(const float* const* weights, int64_t n_rows, const C* const* v_rows, int64_t offset,
                        int64_t lo, int64_t hi, float* const* out) {
  for (int64_t r = 0; r < n_rows; r += 2) {
    if (n_rows - r >= 2) weighted_sum_tile<kD, 2>(weights + r, v_rows, offset, lo, hi, out + r);
    else weighted_sum_tile<kD, 1>(weights + r, v_rows, offset, lo, hi, out + r);
  }
}
#endif

// The portable dot and weighted sum (head dims without a register-resident kernel, builds without AVX2).
template <typename C>
inline float dot_any(const float* q, const C* k, int64_t D) {
  float total = 0.f;
  for (int64_t d = 0; d < D; ++d) total += q[d] * load_scalar(k + d);
  return total;
}

// scores[r][i] = scale * (q_rows[r] . K_i) for rows r < n_rows and keys i in [lo, hi).
template <typename C>
void score_rows(const float* const* q_rows, int64_t n_rows, const C* const* keys, int64_t offset, int64_t D,
                int64_t lo, int64_t hi, float scale, float* const* scores) {
#if MTP_AVX2
  switch (D) {
    case 32: return score_rows_avx2<32>(q_rows, n_rows, keys, offset, lo, hi, scale, scores);
    case 64: return score_rows_avx2<64>(q_rows, n_rows, keys, offset, lo, hi, scale, scores);
    case 128: return score_rows_avx2<128>(q_rows, n_rows, keys, offset, lo, hi, scale, scores);
    default: break;
  }
#endif
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t i = lo; i < hi; ++i) scores[r][i] = scale * dot_any(q_rows[r], keys[i] + offset, D);
}

// out[r] = sum over keys i in [lo, hi), in order, of weights[r][i] * V_i, for rows r < n_rows.
template <typename C>
void weighted_sums(const float* const* weights, int64_t n_rows, const C* const* v_rows, int64_t offset, int64_t D,
                   int64_t lo, int64_t hi, float* const* out) {
#if MTP_AVX2
  switch (D) {
    case 32: return weighted_sums_avx2<32>(weights, n_rows, v_rows, offset, lo, hi, out);
    case 64: return weighted_sums_avx2<64>(weights, n_rows, v_rows, offset, lo, hi, out);
    case 128: return weighted_sums_avx2<128>(weights, n_rows, v_rows, offset, lo, hi, out);
    default: break;
  }
#endif
  for (int64_t r = 0; r < n_rows; ++r) {
    std::memset(out[r], 0, D * sizeof(float));
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t d = 0; d < D; ++d) out[r][d] += weights[r][i] * load_scalar(v_rows[i] + offset + d);
  }
}

// Software prefetch of the K and V rows of a chunk of keys (into L2), issued a slice of cache lines at a time.
struct ChunkPrefetcher {
  struct Run {
    const char* k;
    const char* v;
    int64_t bytes;  // from k, and as many from v
  };
  std::function<void(int64_t, std::vector<Run>&)> chunk_bytes;  // a task's page runs
  std::vector<Run> runs;
  size_t run = 0;
  int64_t offset = 0, lines = 0;

  void plan(int64_t task) {  // forget what is left, and prefetch `task`'s chunk next (-1: nothing)
    runs.clear();
    run = 0;
    offset = 0;
    lines = 0;
    if (task < 0) return;
    chunk_bytes(task, runs);
    for (const Run& r : runs) lines += 2 * ((r.bytes + 63) / 64);
  }
  void issue(int64_t count) {  // about `count` more cache lines (K and V lines count one each)
#if MTP_AVX2
    for (; count > 0 && run < runs.size(); count -= 2) {
      _mm_prefetch(runs[run].k + offset, _MM_HINT_T1);
      _mm_prefetch(runs[run].v + offset, _MM_HINT_T1);
      offset += 64;
      if (offset >= runs[run].bytes) {
        ++run;
        offset = 0;
      }
    }
#else
    (void)count;
#endif
  }
};

inline void store_row(float* dst, const float* src, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
inline void store_row(bf16_bits* dst, const float* src, int64_t D) {  // round to nearest even, as torch's .to()
  for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(src[d]).x;
}

// k_cache, v_cache: [pages, page_size, G, D] fp32 or bf16 (both alike); the new tokens' k and v are written at
// slot_mapping first.
// positions [T] int64; qo_indptr [B + 1] int32; page_indptr [B + 1] int32; page_indices [pages used] int32.
// A new token at position p attends to cached positions max(0, p - window + 1) .. p of its sequence.
// Returns [T, H * D].
template <typename C>
at::Tensor paged_attention_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& positions, const at::Tensor& qo_indptr, const at::Tensor& page_indptr,
                           const at::Tensor& page_indices, int64_t num_heads, int64_t num_kv_heads, double scale,
                           int64_t window, const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, double norm_eps,
                           const c10::optional<at::Tensor>& tree_start, const c10::optional<at::Tensor>& tree_keys) {
  check_activations(qkv, "qkv");
  TORCH_CHECK(qkv.is_contiguous(), "qkv must be contiguous");
  const int64_t T = qkv.size(0), H = num_heads, G = num_kv_heads, D = k_cache.size(3), page_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == G && qkv.size(1) == (H + 2 * G) * D, "qkv width does not match the heads");
  TORCH_CHECK(H % G == 0 && D % 2 == 0, "bad head layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T &&
                  cos.size(1) == D,
              "cos/sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  qo_indptr.scalar_type() == at::kInt && page_indptr.scalar_type() == at::kInt &&
                  page_indices.scalar_type() == at::kInt,
              "index tensors: slot_mapping and positions int64, the indptrs and page indices int32");
  const float* qn = (q_norm.has_value() && q_norm->defined()) ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = (k_norm.has_value() && k_norm->defined()) ? k_norm->data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(norm_eps);
  float* qkv_ptr = qkv.data_ptr<float>();
  const int64_t width = qkv.size(1);
  C* kc = reinterpret_cast<C*>(k_cache.data_ptr());
  C* vc = reinterpret_cast<C*>(v_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * page_size;
  // Draft trees: a node at position p sees the keys of positions < tree_start[b] (its sequence's cached prefix) and,
  // for positions tree_start[b] .. p, its ancestors and itself: tree_keys[t, q - tree_start[b]] is the sequence's
  // cache index of the key standing at position q for token t. Keys are taken in position order and chunked by
  // position exactly as for a decode step at p, so a node's row is bit-identical to the decode step that would
  // compute it once its path is accepted.
  const bool tree = tree_start.has_value() && tree_start->defined();
  const int64_t* tree_start_ptr = nullptr;
  const int64_t* tree_keys_ptr = nullptr;
  int64_t tree_width = 0;
  if (tree) {
    TORCH_CHECK(tree_keys.has_value() && tree_keys->defined(), "tree_start needs tree_keys");
    TORCH_CHECK(tree_start->scalar_type() == at::kLong && tree_keys->scalar_type() == at::kLong &&
                    tree_start->is_contiguous() && tree_keys->is_contiguous() && tree_keys->dim() == 2 &&
                    tree_keys->size(0) == T && tree_start->numel() == qo_indptr.numel() - 1,
                "tree_start: int64 [B]; tree_keys: int64 [T, depth]");
    tree_start_ptr = tree_start->data_ptr<int64_t>();
    tree_keys_ptr = tree_keys->data_ptr<int64_t>();
    tree_width = tree_keys->size(1);
    const int32_t* qo_check = qo_indptr.data_ptr<int32_t>();
    const int32_t* pind_check = page_indptr.data_ptr<int32_t>();
    for (int64_t b = 0; b + 1 < qo_indptr.numel(); ++b) {
      const int64_t region = tree_start_ptr[b];
      if (region < 0) continue;
      const int64_t capacity = (pind_check[b + 1] - pind_check[b]) * page_size;
      for (int64_t t = qo_check[b]; t < qo_check[b + 1]; ++t) {
        TORCH_CHECK(pos[t] >= region && pos[t] - region < tree_width, "token ", t, " at position ", pos[t],
                    " is outside its tree region from ", region);
        for (int64_t q = region; q <= pos[t]; ++q) {
          const int64_t index = tree_keys_ptr[t * tree_width + (q - region)];
          TORCH_CHECK(index >= region && index < capacity, "tree_keys[", t, ", ", q - region, "] = ", index,
                      ": not a cache index of the tree region");
        }
      }
    }
  }

  // 1. rotate q and k of every new token, write k and v into the cache.
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache");
  }
  at::parallel_for(0, T * (H + G), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / (H + G), h = i % (H + G);
      float* v = qkv_ptr + t * width + h * D;
      const bool is_q = h < H;
      norm_and_rotate(v, D, cos.data_ptr<float>() + t * D, sin.data_ptr<float>() + t * D, is_q ? qn : kn, eps,
                      scratch.data());
      if (!is_q) {
        const int64_t g = h - H;
        store_row(kc + (slots[t] * G + g) * D, v, D);
        store_row(vc + (slots[t] * G + g) * D, qkv_ptr + t * width + (H + G + g) * D, D);
      }
    }
  });

  // 2. attend, split along the keys (as flash-decoding does): one task per (sequence, chunk of kKeyChunk keys),
  //    covering every head and the sequence's new tokens. A chunk's K (and V) rows of all KV heads are contiguous
  //    within a page, so a task streams one block of memory once, and a single sequence still spreads over the
  //    threads. Each task leaves, per (query head, token), the chunk's max score, sum of exponentials and exp-weighted
  //    sum of V; step 3 merges the chunks in order. Chunks are aligned to absolute positions and every reduction runs
  //    over the token's own allowed keys, so a token's output is bit-identical whether it is decoded alone or verified
  //    with others.
  constexpr int64_t kKeyChunk = 64;
  const int64_t B = qo_indptr.numel() - 1;
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* pind = page_indptr.data_ptr<int32_t>();
  const int32_t* pages = page_indices.data_ptr<int32_t>();
  const int64_t group = H / G;
  const float scale_f = static_cast<float>(scale);
  const int64_t slot_elems = G * D;  // one cached token: every KV head
  auto first_key = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : int64_t(0); };

  // Per sequence: its chunk range and where its tasks and partial results start.
  std::vector<int64_t> chunk_begin(B), chunk_count(B), task_start(B + 1, 0), partial_start(B + 1, 0);
  std::vector<int64_t> seq_kv_begin(B), seq_kv_end(B);  // the keys any of a sequence's new tokens sees
  for (int64_t b = 0; b < B; ++b) {
    int64_t kv_end = 0, kv_begin = std::numeric_limits<int64_t>::max();
    for (int64_t t = qo[b]; t < qo[b + 1]; ++t) {
      kv_end = std::max(kv_end, pos[t] + 1);
      kv_begin = std::min(kv_begin, first_key(pos[t]));
    }
    if (qo[b + 1] == qo[b]) kv_begin = kv_end = 0;
    seq_kv_begin[b] = kv_begin;
    seq_kv_end[b] = kv_end;
    TORCH_CHECK((pind[b + 1] - pind[b]) * page_size >= kv_end, "sequence ", b, " has too few pages for position ",
                kv_end - 1);
    chunk_begin[b] = kv_begin / kKeyChunk;
    chunk_count[b] = kv_end > kv_begin ? (kv_end - 1) / kKeyChunk - chunk_begin[b] + 1 : 0;
    task_start[b + 1] = task_start[b] + chunk_count[b];
    // per task: (query heads) x (tokens) x (D accumulators + max + sum)
    partial_start[b + 1] = partial_start[b] + chunk_count[b] * H * (qo[b + 1] - qo[b]) * (D + 2);
  }
  // every entry is written by its task before step 3 reads it: not zeroed (a verify of 4 tokens over 4k keys holds
  // 0.6 MB of them per layer)
  std::unique_ptr<float[]> partials(new float[std::max<int64_t>(1, partial_start[B])]);

  at::parallel_for(0, task_start[B], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> row_lo, row_hi;
    std::vector<const C*> k_rows(kKeyChunk), v_rows(kKeyChunk), row_k, row_v;
    std::vector<const float*> q_ptrs, w_ptrs(group);
    std::vector<float*> score_ptrs, out_ptrs(group);
    ChunkPrefetcher prefetcher;
    prefetcher.chunk_bytes = [&](int64_t task, std::vector<ChunkPrefetcher::Run>& runs) {
      const int64_t b = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
      const int64_t key_lo = (chunk_begin[b] + task - task_start[b]) * kKeyChunk;
      const int64_t lo = std::max(key_lo, seq_kv_begin[b]), hi = std::min(key_lo + kKeyChunk, seq_kv_end[b]);
      for (int64_t p = lo; p < hi;) {
        const int64_t run = std::min(hi - p, page_size - p % page_size);  // slots left in this page
        const int64_t slot = static_cast<int64_t>(pages[pind[b] + p / page_size]) * page_size + p % page_size;
        runs.push_back({reinterpret_cast<const char*>(kc + slot * slot_elems),
                        reinterpret_cast<const char*>(vc + slot * slot_elems),
                        run * slot_elems * static_cast<int64_t>(sizeof(C))});
        p += run;
      }
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
      const int64_t c = task - task_start[b];
      const int64_t t0 = qo[b], n_q = qo[b + 1] - qo[b], rows = H * n_q;
      if (static_cast<int64_t>(q_ptrs.size()) < group * n_q) {
        q_ptrs.resize(group * n_q);
        score_ptrs.resize(group * n_q);
      }
      const int64_t key_lo = (chunk_begin[b] + c) * kKeyChunk, key_hi = key_lo + kKeyChunk;
      float* part = partials.get() + partial_start[b] + c * rows * (D + 2);
      // the keys any of the tokens may see in this chunk, and each token's own: [row_lo, row_hi) from key_lo
      row_lo.assign(n_q, 0);
      row_hi.assign(n_q, 0);
      int64_t lo_all = key_hi, hi_all = key_lo;
      for (int64_t r = 0; r < n_q; ++r) {
        row_lo[r] = std::max(key_lo, first_key(pos[t0 + r])) - key_lo;
        row_hi[r] = std::max(row_lo[r], std::min(key_hi, pos[t0 + r] + 1) - key_lo);
        if (row_hi[r] > row_lo[r]) {
          lo_all = std::min(lo_all, key_lo + row_lo[r]);
          hi_all = std::max(hi_all, key_lo + row_hi[r]);
        }
      }
      auto slot_of = [&](int64_t p) {
        return static_cast<int64_t>(pages[pind[b] + p / page_size]) * page_size + p % page_size;
      };
      // The chunk's K and V rows are cold (the layer's weights streamed through the caches since they were
      // written). A thread asks for its first chunk up front, then for each next chunk while it computes the one
      // before, a slice at each step below, so the memory streams while the FMAs run.
      if (task == begin) {
        prefetcher.plan(task);
        prefetcher.issue(std::numeric_limits<int64_t>::max());
      }
      prefetcher.plan(task + 1 < end ? task + 1 : -1);
      const int64_t prefetch_slice = prefetcher.lines / (G + G * n_q) + 1;
      // The chunk's K and V rows, one pointer per key (pages are looked up once, not per head).
      for (int64_t p = lo_all; p < hi_all; ++p) {
        k_rows[p - key_lo] = kc + slot_of(p) * slot_elems;
        v_rows[p - key_lo] = vc + slot_of(p) * slot_elems;
      }
      if (static_cast<int64_t>(scores.size()) < rows * kKeyChunk) scores.resize(rows * kKeyChunk);  // each row's
      // own keys are written below before they are read
      // A tree node's own key rows where the chunk reaches its sequence's tree region (its ancestors'), else the
      // chunk's shared ones.
      const int64_t region = tree ? tree_start_ptr[b] : -1;
      const bool tree_chunk = region >= 0 && region < key_hi;
      if (tree_chunk) {
        row_k.assign(n_q * kKeyChunk, nullptr);
        row_v.assign(n_q * kKeyChunk, nullptr);
        for (int64_t r = 0; r < n_q; ++r)
          for (int64_t i = row_lo[r]; i < row_hi[r]; ++i) {
            const int64_t q = key_lo + i;
            const int64_t index = q < region ? q : tree_keys_ptr[(t0 + r) * tree_width + (q - region)];
            row_k[r * kKeyChunk + i] = kc + slot_of(index) * slot_elems;
            row_v[r * kKeyChunk + i] = vc + slot_of(index) * slot_elems;
          }
      }
      auto keys_of = [&](int64_t r) { return tree_chunk ? row_k.data() + r * kKeyChunk : k_rows.data(); };
      auto values_of = [&](int64_t r) { return tree_chunk ? row_v.data() + r * kKeyChunk : v_rows.data(); };
      // Scores, KV head by KV head: the group's query rows (its heads, for each token) meet each key row while it
      // sits in L1. Outside a tree region every row of a token takes the same keys: the group's rows share the
      // tiles, over the keys any of them sees (a row reads only its own range [row_lo, row_hi) of them below).
      float* const score_base = scores.data();
      auto score_row = [&](int64_t h, int64_t r) { return score_base + (h * n_q + r) * kKeyChunk; };
      auto q_row = [&](int64_t h, int64_t r) -> const float* { return qkv_ptr + (t0 + r) * width + h * D; };
      for (int64_t g = 0; g < G; ++g) {
        prefetcher.issue(prefetch_slice);
        if (!tree_chunk) {
          int64_t n_rows = 0;
          for (int64_t h = g * group; h < (g + 1) * group; ++h)
            for (int64_t r = 0; r < n_q; ++r) {
              if (row_hi[r] <= row_lo[r]) continue;
              q_ptrs[n_rows] = q_row(h, r);
              score_ptrs[n_rows++] = score_row(h, r);
            }
          // k_rows is indexed from key_lo: keys [lo_all, hi_all) of the chunk
          score_rows(q_ptrs.data(), n_rows, k_rows.data(), g * D, D, lo_all - key_lo, hi_all - key_lo, scale_f,
                     score_ptrs.data());
        } else {
          for (int64_t h = g * group; h < (g + 1) * group; ++h)
            for (int64_t r = 0; r < n_q; ++r) {
              if (row_hi[r] <= row_lo[r]) continue;
              const float* q = q_row(h, r);
              float* row = score_row(h, r);
              score_rows(&q, 1, keys_of(r), g * D, D, row_lo[r], row_hi[r], scale_f, &row);
            }
        }
      }
      // Softmax numerators per row over its own keys, then the exp-weighted sums of V: the heads of a group share a
      // token's range and V rows, so they share each V load.
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < n_q; ++r) {
          float* row = score_row(h, r);
          float* out = part + (h * n_q + r) * (D + 2);
          const float max_value = max_of(row + row_lo[r], row_hi[r] - row_lo[r]);
          out[D] = max_value;
          out[D + 1] = row_hi[r] > row_lo[r] ? exp_minus_max(row + row_lo[r], row_hi[r] - row_lo[r], max_value) : 0.f;
        }
      for (int64_t r = 0; r < n_q; ++r) {
        if (row_hi[r] <= row_lo[r]) {
          for (int64_t h = 0; h < H; ++h) std::memset(part + (h * n_q + r) * (D + 2), 0, D * sizeof(float));
          continue;
        }
        for (int64_t g = 0; g < G; ++g) {
          prefetcher.issue(prefetch_slice);
          for (int64_t j = 0; j < group; ++j) {
            const int64_t h = g * group + j;
            w_ptrs[j] = score_row(h, r);
            out_ptrs[j] = part + (h * n_q + r) * (D + 2);
          }
          weighted_sums(w_ptrs.data(), group, values_of(r), g * D, D, row_lo[r], row_hi[r], out_ptrs.data());
        }
      }
      prefetcher.issue(std::numeric_limits<int64_t>::max());
    }
  });

  // 3. merge the chunks of each (sequence, query head, token), in chunk order.
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, T * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / H, h = i % H;
      const int64_t b = std::upper_bound(qo, qo + B + 1, static_cast<int32_t>(t)) - qo - 1;
      const int64_t n_q = qo[b + 1] - qo[b], r = t - qo[b], rows = H * n_q;
      float max_value = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunk_count[b]; ++c) {
        const float* part = partials.get() + partial_start[b] + c * rows * (D + 2) + (h * n_q + r) * (D + 2);
        if (part[D + 1] > 0.f) max_value = std::max(max_value, part[D]);
      }
      float* o = out_ptr + t * H * D + h * D;
      std::memset(o, 0, D * sizeof(float));
      float total = 0.f;
      for (int64_t c = 0; c < chunk_count[b]; ++c) {
        const float* part = partials.get() + partial_start[b] + c * rows * (D + 2) + (h * n_q + r) * (D + 2);
        if (part[D + 1] <= 0.f) continue;
        const float weight = std::exp(part[D] - max_value);
        total += weight * part[D + 1];
        axpy(weight, part, o, D);
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

at::Tensor paged_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& positions, const at::Tensor& qo_indptr, const at::Tensor& page_indptr,
                           const at::Tensor& page_indices, int64_t num_heads, int64_t num_kv_heads, double scale,
                           int64_t window, const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, double norm_eps,
                           const c10::optional<at::Tensor>& tree_start, const c10::optional<at::Tensor>& tree_keys) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && v_cache.scalar_type() == dtype &&
                  k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "K/V caches must be contiguous [pages, page_size, kv_heads, head_dim], both float32 or both bfloat16");
  auto attend = [&](auto element) {  // the cache's element type: float or bf16_bits
    return paged_attention_impl<decltype(element)>(qkv, cos, sin, k_cache, v_cache, slot_mapping, positions, qo_indptr,
                                                   page_indptr, page_indices, num_heads, num_kv_heads, scale, window,
                                                   q_norm, k_norm, norm_eps, tree_start, tree_keys);
  };
  return dtype == at::kBFloat16 ? attend(bf16_bits{}) : attend(float{});
}

// A stack of decoder layers' few-row cached forward in one call: per layer exactly the seven kernel calls the
// per-layer path makes from Python (RMSNorm, QKV, paged attention, output projection + residual, RMSNorm, gate/up +
// SiLU-and-multiply, down projection + residual), so its rows are bit-identical to it; what it saves is the ~7 op
// dispatches and the Python between them per layer (a decode step of a 30-layer model crosses into C++ once instead
// of ~210 times).
//
// params: kStackParams optional tensors per layer, in this order: input norm weight (None: no input norm), fused
// q/k/v weight, its bias, output projection weight, its bias, post-attention norm weight, packed gate_up weight
// (see linear_silu_mul), its bias [inter, 2], down projection weight, its bias, q_norm and k_norm weights (None when
// the model has none), then the scales of the four weights when they are int8 (else None). cos and sin are the
// rotary tables of positions 0..L-1 ([L, head_dim]); the rows at `positions` are taken here. eps: per layer (input norm, post-attention norm, q/k norm). windows: per layer sliding
// window (0 = none). keep: layers (0-based) whose outputs are returned after the last one's.
constexpr int64_t kStackParams = 16;

// The stack's loop over layers, its parameters read from `params` from index `first` on (kStackParams per layer) and
// its epsilons from `eps` (3 per layer): `decode_layers`, and the layers of `mtp_head_forward`.
std::vector<at::Tensor> run_layers(const at::Tensor& x_in, const c10::List<c10::optional<at::Tensor>>& params,
                                   int64_t first, at::ArrayRef<double> eps, at::TensorList k_caches,
                                   at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& slot_mapping, const at::Tensor& positions,
                                   const at::Tensor& qo_indptr, const at::Tensor& page_indptr,
                                   const at::Tensor& page_indices, int64_t num_heads, int64_t num_kv_heads,
                                   double scale, at::IntArrayRef windows, const c10::optional<at::Tensor>& tree_start,
                                   const c10::optional<at::Tensor>& tree_keys, at::IntArrayRef keep) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == first + num_layers * kStackParams, "params: expected ",
              kStackParams, " per layer for ", num_layers, " layers, got ", static_cast<int64_t>(params.size()) - first);
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == 3 * num_layers &&
                  static_cast<int64_t>(windows.size()) == num_layers &&
                  static_cast<int64_t>(v_caches.size()) == num_layers,
              "eps (3 per layer), windows and v_caches must cover every layer");
  auto param = [&](int64_t layer, int64_t slot) -> c10::optional<at::Tensor> {
    return params.get(first + layer * kStackParams + slot);
  };
  std::vector<at::Tensor> outputs(1);
  at::Tensor x = x_in.contiguous();
  if (positions.numel() > 0) {
    const int64_t last = positions.max().item<int64_t>();
    TORCH_CHECK(last < cos.size(0), "position ", last, " past the rotary tables' ", cos.size(0), " rows");
  }
  const at::Tensor cos_rows = cos.index_select(0, positions);
  const at::Tensor sin_rows = sin.index_select(0, positions);
  for (int64_t l = 0; l < num_layers; ++l) {
    const c10::optional<at::Tensor> input_norm = param(l, 0);
    const at::Tensor h = input_norm.has_value() ? rms_norm(x, *input_norm, eps[3 * l]) : x;
    at::Tensor qkv = linear(h, *param(l, 1), param(l, 2), c10::nullopt, param(l, 12));
    const at::Tensor attn = paged_attention(qkv, cos_rows, sin_rows, k_caches[l], v_caches[l], slot_mapping,
                                            positions, qo_indptr, page_indptr, page_indices, num_heads, num_kv_heads,
                                            scale, windows[l], param(l, 10), param(l, 11), eps[3 * l + 2], tree_start,
                                            tree_keys);
    x = linear(attn, *param(l, 3), param(l, 4), x, param(l, 13));  // + residual
    const at::Tensor mlp_hidden =
        linear_silu_mul(rms_norm(x, *param(l, 5), eps[3 * l + 1]), *param(l, 6), param(l, 7), param(l, 14));
    x = linear(mlp_hidden, *param(l, 8), param(l, 9), x, param(l, 15));  // + residual
    if (std::find(keep.begin(), keep.end(), l) != keep.end()) outputs.push_back(x);
  }
  outputs[0] = x;
  return outputs;
}

std::vector<at::Tensor> decode_layers(const at::Tensor& x_in, const c10::List<c10::optional<at::Tensor>>& params,
                                      at::ArrayRef<double> eps, at::TensorList k_caches, at::TensorList v_caches,
                                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                                      const at::Tensor& positions, const at::Tensor& qo_indptr,
                                      const at::Tensor& page_indptr, const at::Tensor& page_indices, int64_t num_heads,
                                      int64_t num_kv_heads, double scale, at::IntArrayRef windows,
                                      const c10::optional<at::Tensor>& tree_start,
                                      const c10::optional<at::Tensor>& tree_keys, at::IntArrayRef keep) {
  return run_layers(x_in, params, 0, eps, k_caches, v_caches, cos, sin, slot_mapping, positions, qo_indptr,
                    page_indptr, page_indices, num_heads, num_kv_heads, scale, windows, tree_start, tree_keys, keep);
}

// An MTP head's few-row cached forward and its logits in one call: the input rows (`mtp_input`), the head's layers
// (`decode_layers`), its final RMSNorm, and the output projection of the rows `logits_rows` (a draft step: its one
// row; a catch-up: each sequence's last) with their argmax — what the per-op path computes with ~10 op dispatches
// and the Python between them, bit for bit. A draft step is short (~0.5 ms warm on a Zen 4) and follows a target
// forward that has pushed the interpreter's data out of the caches, where that Python costs as much as the kernels.
// params: kHeadParams tensors — embedding [V, d] fp32, enorm and hnorm weights, the input projection's weight, bias
// and int8 scales, the final norm's weight, the output projection's weight [N, d] and int8 scales — then the layers'
// (as decode_layers). eps: enorm, hnorm, final norm, then the layers'. Returns [output [T, d] (after the final norm),
// logits [R, N] fp32, argmax [R] int64].
constexpr int64_t kHeadParams = 9;

std::vector<at::Tensor> mtp_head_forward(const at::Tensor& token_ids, const at::Tensor& hidden,
                                         const c10::List<c10::optional<at::Tensor>>& params, at::ArrayRef<double> eps,
                                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                                         const at::Tensor& sin, const at::Tensor& slot_mapping,
                                         const at::Tensor& positions, const at::Tensor& qo_indptr,
                                         const at::Tensor& page_indptr, const at::Tensor& page_indices,
                                         int64_t num_heads, int64_t num_kv_heads, double scale,
                                         at::IntArrayRef windows, const at::Tensor& logits_rows) {
  TORCH_CHECK(static_cast<int64_t>(params.size()) >= kHeadParams && eps.size() >= 3,
              "params: the head's ", kHeadParams, " tensors first; eps: its 3 epsilons first");
  auto required = [&](int64_t slot, const char* name) -> at::Tensor {
    const c10::optional<at::Tensor> value = params.get(slot);
    TORCH_CHECK(value.has_value() && value->defined(), "mtp_head_forward: ", name, " is required");
    return *value;
  };
  TORCH_CHECK(logits_rows.scalar_type() == at::kLong && logits_rows.dim() == 1, "logits_rows must be int64 [R]");
  const at::Tensor x = mtp_input(token_ids, hidden, required(0, "the embedding"), required(1, "enorm"), eps[0],
                                 required(2, "hnorm"), eps[1], required(3, "the input projection"), params.get(4),
                                 params.get(5));
  const std::vector<at::Tensor> layers =
      run_layers(x, params, kHeadParams, eps.slice(3), k_caches, v_caches, cos, sin, slot_mapping, positions,
                 qo_indptr, page_indptr, page_indices, num_heads, num_kv_heads, scale, windows, c10::nullopt,
                 c10::nullopt, {});
  const at::Tensor out = rms_norm(layers[0], required(6, "the final norm"), eps[2]);
  const at::Tensor logits =
      linear(out.index_select(0, logits_rows), required(7, "the output projection"), c10::nullopt, c10::nullopt,
             params.get(8));
  return {out, logits, logits.argmax(-1)};
}

// An MTP head's greedy draft chain in one call: the catch-up forward (`mtp_head_forward` over each sequence's rows,
// the logits of its last row), then num_drafts - 1 draft steps, each feeding every sequence its
// last output and its last draft at the next position (the draft: the argmax of the step's logits, mapped to a target
// id through `target_ids` [N] int64 when the head has a reduced draft vocabulary). Every step is the call the
// step-by-step chain makes, so the drafts are those, bit for bit; the draft steps' K/V are written at the slots of
// positions last + 1 .. last + num_drafts - 1 of each sequence, whose pages `page_indices` must already hold. Returns
// [each sequence's catch-up output row [B, d], its logits [B, N], the drafts [B, num_drafts] (target ids)].
std::vector<at::Tensor> mtp_head_chain(const at::Tensor& token_ids, const at::Tensor& hidden,
                                       const c10::List<c10::optional<at::Tensor>>& params, at::ArrayRef<double> eps,
                                       at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& slot_mapping,
                                       const at::Tensor& positions, const at::Tensor& qo_indptr,
                                       const at::Tensor& page_indptr, const at::Tensor& page_indices,
                                       int64_t num_heads, int64_t num_kv_heads, double scale,
                                       at::IntArrayRef windows, int64_t num_drafts,
                                       const c10::optional<at::Tensor>& target_ids) {
  TORCH_CHECK(num_drafts >= 1, "num_drafts must be >= 1");
  TORCH_CHECK(!k_caches.empty(), "the head has no layer");
  const int64_t B = qo_indptr.numel() - 1;
  TORCH_CHECK(B >= 1 && page_indptr.numel() == B + 1, "qo_indptr and page_indptr must cover the same sequences");
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  at::Tensor logits_rows = at::empty({B}, positions.options());  // each sequence's last row
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qo[b + 1] > qo[b], "sequence ", b, " brings no row");
    logits_rows.data_ptr<int64_t>()[b] = qo[b + 1] - 1;
  }
  const bool mapped = target_ids.has_value() && target_ids->defined();
  if (mapped)
    TORCH_CHECK(target_ids->scalar_type() == at::kLong && target_ids->is_contiguous() && target_ids->dim() == 1,
                "target_ids must be a contiguous int64 [N]");
  std::vector<at::Tensor> step =
      mtp_head_forward(token_ids, hidden, params, eps, k_caches, v_caches, cos, sin, slot_mapping, positions,
                       qo_indptr, page_indptr, page_indices, num_heads, num_kv_heads, scale, windows, logits_rows);
  const at::Tensor newest = step[0].index_select(0, logits_rows);  // [B, d]
  const at::Tensor first_logits = step[1];
  at::Tensor drafts = at::empty({B, num_drafts}, token_ids.options().dtype(at::kLong));
  int64_t* draft_ptr = drafts.data_ptr<int64_t>();
  const int64_t vocab = first_logits.size(1);
  TORCH_CHECK(!mapped || target_ids->numel() == vocab, "target_ids must hold one target id per draft id (", vocab,
              "), got ", mapped ? target_ids->numel() : 0);
  auto take = [&](const at::Tensor& argmax, int64_t j) {  // draft ids -> target ids, column j
    const int64_t* a = argmax.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(a[b] >= 0 && a[b] < vocab, "argmax outside the logits");
      draft_ptr[b * num_drafts + j] = mapped ? target_ids->data_ptr<int64_t>()[a[b]] : a[b];
    }
  };
  take(step[2].contiguous(), 0);
  if (num_drafts == 1) return {newest, first_logits, drafts};

  const int64_t page_size = k_caches[0].size(1);
  const int64_t* row_ptr = logits_rows.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* pind = page_indptr.data_ptr<int32_t>();
  const int32_t* pages = page_indices.data_ptr<int32_t>();
  const at::Tensor step_rows = at::arange(B, logits_rows.options());
  const at::Tensor step_qo = at::arange(B + 1, qo_indptr.options());
  at::Tensor step_positions = at::empty({B}, positions.options());
  at::Tensor step_slots = at::empty({B}, slot_mapping.options());
  at::Tensor step_ids = at::empty({B}, drafts.options());
  at::Tensor carried = newest;
  for (int64_t j = 1; j < num_drafts; ++j) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(row_ptr[b] < positions.numel(), "qo_indptr runs past the batch's rows");
      const int64_t p = pos[row_ptr[b]] + j, page = p / page_size;
      TORCH_CHECK(page < pind[b + 1] - pind[b], "sequence ", b, " has no page for draft position ", p);
      step_positions.data_ptr<int64_t>()[b] = p;
      step_slots.data_ptr<int64_t>()[b] = static_cast<int64_t>(pages[pind[b] + page]) * page_size + p % page_size;
      step_ids.data_ptr<int64_t>()[b] = draft_ptr[b * num_drafts + j - 1];
    }
    step = mtp_head_forward(step_ids, carried, params, eps, k_caches, v_caches, cos, sin, step_slots, step_positions,
                            step_qo, page_indptr, page_indices, num_heads, num_kv_heads, scale, windows, step_rows);
    carried = step[0];
    take(step[2].contiguous(), j);
  }
  return {newest, first_logits, drafts};
}

}  // namespace

TORCH_LIBRARY(mtp_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, Tensor? scale=None) -> Tensor");
  m.def("linear_silu_mul(Tensor x, Tensor gate_up, Tensor? bias=None, Tensor? scale=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "mtp_input(Tensor token_ids, Tensor hidden, Tensor embed, Tensor enorm, float enorm_eps, Tensor hnorm, "
      "float hnorm_eps, Tensor weight, Tensor? bias=None, Tensor? scale=None) -> Tensor");
  m.def("bf16_activations() -> bool", &bf16_activations);  // no tensor to dispatch on: a catch-all kernel
  m.def(
      "paged_attention(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor slot_mapping, "
      "Tensor positions, Tensor qo_indptr, Tensor page_indptr, Tensor page_indices, int num_heads, int num_kv_heads, "
      "float scale, int window, Tensor? q_norm=None, Tensor? k_norm=None, float norm_eps=1e-6, Tensor? tree_start=None, "
      "Tensor? tree_keys=None) -> Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor?[] params, float[] eps, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor positions, Tensor qo_indptr, Tensor page_indptr, "
      "Tensor page_indices, int num_heads, int num_kv_heads, float scale, int[] windows, Tensor? tree_start=None, "
      "Tensor? tree_keys=None, int[] keep=[]) -> Tensor[]");
  m.def(
      "mtp_head_forward(Tensor token_ids, Tensor hidden, Tensor?[] params, float[] eps, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor positions, Tensor qo_indptr, "
      "Tensor page_indptr, Tensor page_indices, int num_heads, int num_kv_heads, float scale, int[] windows, "
      "Tensor logits_rows) -> Tensor[]");
  m.def(
      "mtp_head_chain(Tensor token_ids, Tensor hidden, Tensor?[] params, float[] eps, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor positions, Tensor qo_indptr, "
      "Tensor page_indptr, Tensor page_indices, int num_heads, int num_kv_heads, float scale, int[] windows, "
      "int num_drafts, Tensor? target_ids=None) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(mtp_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_silu_mul", &linear_silu_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("mtp_input", &mtp_input);
  m.impl("paged_attention", &paged_attention);
  m.impl("decode_layers", &decode_layers);
  m.impl("mtp_head_forward", &mtp_head_forward);
  m.impl("mtp_head_chain", &mtp_head_chain);
}
