// Weight-only quantized matmul on the CPU: y = x W^T with x float32 (M, K) and W stored as int8
// (N, K) or as 4-bit codes packed two to a byte (N, K/2: in each block of 32 elements, byte j
// holds element j in its low nibble and element j + 16 in its high one, so that both halves
// unpack into contiguous lanes), one float32 scale per (row, group) and optionally one float32
// offset per (row, group): W[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k / group_size.
//
// Work items are blocks of output rows. With one row of x (batch-1 decode) each weight row is
// decoded in registers and dotted group by group; with several, each weight row is decoded once
// into a float32 scratch row that stays in L1, then dotted with every row of x, four at a time.
// Everything is float32: the only rounding beyond the format's own math is summation order. The
// weights are read once per call, which is what bounds decode at small batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Row n of W as float32 into w (K values).
inline void decode_row(const void* qrow, int64_t bits, int64_t k, int64_t group, const float* scale,
                       const float* offset, float* w) {
  const int64_t groups = k / group;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = scale[g], o = offset ? offset[g] : 0.f;
    float* wg = w + g * group;
    if (bits == 8) {
      const int8_t* qg = static_cast<const int8_t*>(qrow) + g * group;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
      for (; i + 8 <= group; i += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + i));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        _mm256_storeu_ps(wg + i, _mm256_fmadd_ps(q, vs, vo));
      }
#endif
      for (; i < group; ++i) wg[i] = static_cast<float>(qg[i]) * s + o;
    } else {
      const uint8_t* qg = static_cast<const uint8_t*>(qrow) + g * group / 2;
      for (int64_t b0 = 0; b0 < group; b0 += 32) {
        const uint8_t* qb = qg + b0 / 2;
        float* wb = wg + b0;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
        const __m256i mask = _mm256_set1_epi32(15);
        for (; j < 16; j += 8) {
          const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + j)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
          _mm256_storeu_ps(wb + j, _mm256_fmadd_ps(lo, vs, vo));
          _mm256_storeu_ps(wb + 16 + j, _mm256_fmadd_ps(hi, vs, vo));
        }
#endif
        for (; j < 16; ++j) {
          wb[j] = static_cast<float>(qb[j] & 15) * s + o;
          wb[16 + j] = static_cast<float>(qb[j] >> 4) * s + o;
        }
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[i * stride] = x_i . w for R rows of x starting at x (row length k); R is a compile-time
// constant so that the 2R accumulators stay in registers.
template <int R>
inline void dot_rows(const float* x, const float* w, int64_t k, float* out, int64_t stride) {
  int64_t j = 0;
  float acc[R];
  for (int i = 0; i < R; ++i) acc[i] = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a[R], b[R];
  for (int i = 0; i < R; ++i) a[i] = b[i] = _mm256_setzero_ps();
  for (; j + 16 <= k; j += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + j), w1 = _mm256_loadu_ps(w + j + 8);
    for (int i = 0; i < R; ++i) {
      a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + j), w0, a[i]);
      b[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + j + 8), w1, b[i]);
    }
  }
  for (int i = 0; i < R; ++i) acc[i] = hsum(_mm256_add_ps(a[i], b[i]));
#endif
  for (int i = 0; i < R; ++i) {
    float t = acc[i];
    for (int64_t jj = j; jj < k; ++jj) t += x[i * k + jj] * w[jj];
    out[i * stride] = t;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// One activation row against one quantized row, decoding in registers (no scratch row):
// y = sum_g scale[g] * (x_g . q_g) + offset[g] * sum(x_g), with sum(x_g) precomputed in xsum.
inline float fused_row(const float* x, const void* qrow, int64_t bits, int64_t k, int64_t group,
                       const float* scale, const float* offset, const float* xsum) {
  float y = 0.f;
  const int64_t groups = k / group;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const float* xg = x + g * group;
    if (bits == 8) {
      const int8_t* qg = static_cast<const int8_t*>(qrow) + g * group;
      int64_t i = 0;
      for (; i + 32 <= group; i += 32) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + i));
        const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(xg + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                             _mm256_loadu_ps(xg + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(xg + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
                             _mm256_loadu_ps(xg + i + 24), a3);
      }
      float t = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (; i < group; ++i) t += static_cast<float>(qg[i]) * xg[i];
      y += scale[g] * t;
    } else {
      const uint8_t* qg = static_cast<const uint8_t*>(qrow) + g * group / 2;
      const __m256i mask = _mm256_set1_epi32(15);
      for (int64_t b0 = 0; b0 < group; b0 += 32) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + b0 / 2));
        const __m256i c0 = _mm256_cvtepu8_epi32(b), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
        const float* xb = xg + b0;
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c0, mask)), _mm256_loadu_ps(xb), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c1, mask)), _mm256_loadu_ps(xb + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), _mm256_loadu_ps(xb + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)), _mm256_loadu_ps(xb + 24), a3);
      }
      y += scale[g] * hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
    if (offset) y += offset[g] * xsum[g];
  }
  return y;
}
constexpr bool kFused = true;
#else
constexpr bool kFused = false;
inline float fused_row(const float*, const void*, int64_t, int64_t, int64_t, const float*, const float*,
                       const float*) { return 0.f; }
#endif

at::Tensor quant_matmul(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales_in,
                        const at::Tensor& offsets_in, int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x_in.dim() == 2, "quant_matmul: x must be (M, K)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor scales = scales_in.to(at::kFloat).contiguous();
  const bool has_offset = offsets_in.numel() > 0;
  const at::Tensor offsets = has_offset ? offsets_in.to(at::kFloat).contiguous() : offsets_in;
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.is_contiguous(), "quant_matmul: qweight must be contiguous");
  TORCH_CHECK(qweight.size(1) * (bits == 4 ? 2 : 1) == k, "quant_matmul: K of x and W differ");
  TORCH_CHECK(group > 0 && k % group == 0 && (bits == 8 || group % 32 == 0), "quant_matmul: bad group size ", group);
  const int64_t groups = k / group;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups, "quant_matmul: scales must be (N, K/group)");
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* op = has_offset ? offsets.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const auto* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const int64_t row_bytes = bits == 8 ? k : k / 2;
  // A single activation row decodes in registers (fused_row, the offsets applied through the
  // per-group sums of x); several rows share one decoded scratch row.
  const bool fused = kFused && m == 1 && (bits == 4 || group % 32 == 0);
  std::vector<float> xsum(fused ? groups : 0);
  for (int64_t g = 0; g < (int64_t)xsum.size(); ++g) {
    float t = 0.f;
    for (int64_t i = 0; i < group; ++i) t += xp[g * group + i];
    xsum[g] = t;
  }
  // Chunks of at least 64K multiply-adds: smaller layers run on one thread (a parallel region
  // costs more than their work, much more when the cores are shared).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, k * m));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    if (fused) {
      for (int64_t r = n0; r < n1; ++r)
        yp[r] = fused_row(xp, qp + r * row_bytes, bits, k, group, sp + r * groups, op ? op + r * groups : nullptr,
                          xsum.data());
      return;
    }
    std::vector<float> buf(k);
    float* w = buf.data();
    for (int64_t r = n0; r < n1; ++r) {
      decode_row(qp + r * row_bytes, bits, k, group, sp + r * groups, op ? op + r * groups : nullptr, w);
      int64_t i = 0;
      for (; i + 4 <= m; i += 4) dot_rows<4>(xp + i * k, w, k, yp + i * n + r, n);
      if (m - i == 3) dot_rows<3>(xp + i * k, w, k, yp + i * n + r, n);
      if (m - i == 2) dot_rows<2>(xp + i * k, w, k, yp + i * n + r, n);
      if (m - i == 1) dot_rows<1>(xp + i * k, w, k, yp + i * n + r, n);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(qkv_quant, m) {
  m.def("quant_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int bits, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(qkv_quant, CPU, m) { m.impl("quant_matmul", &quant_matmul); }
