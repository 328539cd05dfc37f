// Float32 y = x W^T (+ bias) for a few rows of x on the CPU: x (M, K), W (N, K), y (M, N).
//
// A decode step's products have one row per sequence, so they read every weight once to do
// 2 multiply-adds per weight: memory bound. MKL's product for one row reached 20% of the copy
// bandwidth on the AMD EPYC this project runs on (bench_engine's batch-1 row), llama.cpp's f32
// matrix-vector product about 55% on the same machine (loadtests/benchmarks/bench_llama_cpp.py).
// Here each thread streams its own contiguous share of W's rows once, four rows at a time, and
// dots them with four rows of x at a time: a run of W rows that fits in L2 meets every group of
// four x rows (in L1) before the next run is read, so neither is read from memory again. Accumulators are float32 vectors (AVX-512 or
// AVX2 + FMA), summed across lanes at the end of each row: the same products as F.linear up to
// float rounding (another summation order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
constexpr bool kVector = true;
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int64_t kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr bool kVector = true;
#else
constexpr bool kVector = false;
#endif

// y[m * ldy + n] = x_m . w_n for MR rows of x (row stride k) and NR rows of w (row stride k).
template <int MR, int NR>
inline void block(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  float s[MR][NR];
  int64_t j = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = vzero();
  for (; j + kLanes <= k; j += kLanes) {
    vec wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = vload(w + n * k + j);
    for (int m = 0; m < MR; ++m) {
      const vec xv = vload(x + m * k + j);
      for (int n = 0; n < NR; ++n) acc[m][n] = vfma(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) s[m][n] = vsum(acc[m][n]);
#else
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) s[m][n] = 0.f;
#endif
  for (; j < k; ++j)
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) s[m][n] += x[m * k + j] * w[n * k + j];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * ldy + n] = s[m][n];
}

template <int NR>
inline void rows_block(const float* x, int64_t m0, int64_t m1, const float* w, int64_t k, float* y, int64_t ldy) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) block<4, NR>(x + m * k, w, k, y + m * ldy, ldy);
  switch (m1 - m) {
    case 3: block<3, NR>(x + m * k, w, k, y + m * ldy, ldy); break;
    case 2: block<2, NR>(x + m * k, w, k, y + m * ldy, ldy); break;
    case 1: block<1, NR>(x + m * k, w, k, y + m * ldy, ldy); break;
    default: break;
  }
}

at::Tensor dense_matmul(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2, "dense_matmul: x must be (M, K) and weight (N, K)");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "dense_matmul: float32 only");
  TORCH_CHECK(weight.is_contiguous(), "dense_matmul: weight must be contiguous");
  TORCH_CHECK(x_in.size(1) == weight.size(1), "dense_matmul: K of x and W differ");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == n && bias.scalar_type() == at::kFloat), "dense_matmul: bad bias");
  const at::Tensor b = has_bias ? bias.contiguous() : bias;
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  // Blocks of 4 weight rows; chunks of at least 256K multiply-adds (a parallel region costs
  // more than a smaller product, much more when the cores are shared).
  const int64_t blocks = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, 4 * k * m));
  // Tiles: a run of weight blocks that fits in L2 (`span`) against 4 rows of x at a time (in
  // L1), so that with many rows neither x nor W is read again from memory per block.
  const int64_t span = std::max<int64_t>(1, (int64_t{256} << 10) / (16 * k));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t s0 = b0; s0 < b1; s0 += span) {
      const int64_t s1 = std::min(b1, s0 + span);
      for (int64_t m0 = 0; m0 < m; m0 += 4) {
        const int64_t m1 = std::min(m, m0 + 4);
        for (int64_t blk = s0; blk < s1; ++blk) {
          const int64_t r = blk * 4, nr = std::min<int64_t>(4, n - r);
          const float* w = wp + r * k;
          float* y = yp + r;
          switch (nr) {
            case 4: rows_block<4>(xp, m0, m1, w, k, y, n); break;
            case 3: rows_block<3>(xp, m0, m1, w, k, y, n); break;
            case 2: rows_block<2>(xp, m0, m1, w, k, y, n); break;
            default: rows_block<1>(xp, m0, m1, w, k, y, n); break;
          }
        }
      }
      if (bp)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t r = s0 * 4; r < std::min(n, s1 * 4); ++r) yp[i * n + r] += bp[r];
    }
  });
  return out;
}

bool vectorised() { return kVector; }

}  // namespace

TORCH_LIBRARY(qkv_dense, m) {
  m.def("dense_matmul(Tensor x, Tensor weight, Tensor bias) -> Tensor");
  m.def("vectorised() -> bool", &vectorised);
}

TORCH_LIBRARY_IMPL(qkv_dense, CPU, m) { m.impl("dense_matmul", &dense_matmul); }
