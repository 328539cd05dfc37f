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
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
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

// ---- int8 activations (llama.cpp's Q8_0 way) ---------------------------------------------------
//
// quant_matmul_q8: each block of 32 values of a row of x becomes int8 codes c = round(x / d) with
// d = max|x| / 127 (round half to even), and
//
//     y[m, n] = sum_g scale[n, g] * sum_{b in g} d[m, b] * (c[m, b] . q[n, b]) + offset[n, g] * sum(x[m, g])
//
// with each block's dot product in int32 (AVX-512 VNNI's vpdpbusd, or AVX2's maddubs + madd), the
// rest in float32, sum(x[m, g]) from the rounded x (d times the codes' sum). The weights are read as the codes they are, so a
// product costs integer work on 1 or 0.5 byte per weight instead of a decode to float per weight.
// It is not the format's float32 math: the activations carry the rounding of their 8-bit codes
// (about 0.4% of each block's largest value), as in llama.cpp. Each row of y depends only on its
// own row of x, whatever M is. Needs K and the group size to be multiples of 32.

struct QuantizedRows {
  std::vector<int8_t> codes;   // (M, K)
  std::vector<float> scale8;   // (M, K / 4): each block's d repeated 8 times, one per int32 lane
  std::vector<float> gsum;     // (M, K / group): sum of the rounded x over each group (offsets only)
};

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k, int64_t group, bool sums) {
  QuantizedRows q;
  q.codes.resize(m * k);
  q.scale8.resize(m * k / 4);
  q.gsum.resize(sums ? m * (k / group) : 0);
  at::parallel_for(0, m, std::max<int64_t>(1, 4096 / k), [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0; i < m1; ++i) {
      const float* xr = x + i * k;
      for (int64_t b = 0; b < k / 32; ++b) {
        const float* xb = xr + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* c = q.codes.data() + i * k + b * 32;
        for (int j = 0; j < 32; ++j) c[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
        for (int j = 0; j < 8; ++j) q.scale8[i * (k / 4) + b * 8 + j] = d;
      }
      // The offsets meet the same rounded x as the codes: W = (q - z) * s puts -z * s on every
      // weight, and the float sum of x would leave -z * s * sum(x - x_rounded) uncancelled
      // (z is about 8 for 4-bit codes: that doubled the error in a check against float math).
      if (sums)
        for (int64_t g = 0; g < k / group; ++g) {
          float t = 0.f;
          for (int64_t b = g * group / 32; b < (g + 1) * group / 32; ++b) {
            int32_t c = 0;
            for (int j = 0; j < 32; ++j) c += q.codes[i * k + b * 32 + j];
            t += static_cast<float>(c) * q.scale8[i * (k / 4) + b * 8];
          }
          q.gsum[i * (k / group) + g] = t;
        }
    }
  });
  return q;
}

#if defined(__AVX2__) && defined(__FMA__)
// One vector step of the product: V256 takes one block of 32 weights (AVX2: maddubs + madd; the
// pairs' sums stay below 2^15: 2 * 127 * 127 for int8, 2 * 15 * 127 for int4), V512 two blocks
// (AVX-512 VNNI's vpdpbusd; int32 lanes 0-7 hold the first block, 8-15 the second). `wload*`
// readies a step's weights once for all rows of x (int4: the 4-bit codes in element order; int8:
// see each struct), `xprep8` a step's activations once for all weight rows.
struct V256 {
  static constexpr int64_t step = 32;
  using ivec = __m256i;
  using fvec = __m256;
  struct W { ivec sign; ivec u; };  // int8: the codes (whose signs x takes) and their magnitudes
  static fvec zero() { return _mm256_setzero_ps(); }
  static fvec fma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
  static fvec set(float v) { return _mm256_set1_ps(v); }
  static fvec load(const float* p) { return _mm256_loadu_ps(p); }
  static float sum(fvec v) { return hsum(v); }
  static ivec xload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static ivec xprep8(ivec x) { return x; }
  static W wload8(const int8_t* q) {
    const ivec w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    return {w, _mm256_abs_epi8(w)};
  }
  static W wload4(const uint8_t* q) {  // 32 codes from 16 bytes
    // The 16 bytes in both halves; the upper half's 32-bit lanes shifted right by 4 bring each
    // byte's high nibble down (the bits shifted in from the next byte are masked off).
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i s = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return {_mm256_setzero_si256(), _mm256_and_si256(s, _mm256_set1_epi8(15))};  // elements 0-15, 16-31
  }
  static fvec madd(ivec u, ivec s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static fvec dot8(const W& w, ivec x) { return madd(w.u, _mm256_sign_epi8(x, w.sign)); }
  static fvec dot4(const W& w, ivec x) { return madd(w.u, x); }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
struct V512 {
  static constexpr int64_t step = 64;
  using ivec = __m512i;
  using fvec = __m512;
  // int8: the signed codes and -128 * the sum of each lane's four (the activations enter
  // vpdpbusd as unsigned bytes, c + 128, and the lane's sum starts from this correction);
  // int4: the codes in element order, nothing to correct.
  struct W { ivec q; ivec base; };
  static fvec zero() { return _mm512_setzero_ps(); }
  static fvec fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
  static fvec set(float v) { return _mm512_set1_ps(v); }
  static fvec load(const float* p) { return _mm512_loadu_ps(p); }
  static float sum(fvec v) { return _mm512_reduce_add_ps(v); }
  static ivec xload(const int8_t* p) { return _mm512_loadu_si512(p); }
  static ivec xprep8(ivec x) { return _mm512_xor_si512(x, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static W wload8(const int8_t* q) {
    const ivec w = _mm512_loadu_si512(q);
    const ivec sum128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), w);
    return {w, _mm512_sub_epi32(_mm512_setzero_si512(), sum128)};
  }
  static W wload4(const uint8_t* q) {  // 64 codes from 32 bytes (two blocks of the packed layout)
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i mask = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
    const ivec c = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo0 lo1 hi0 hi1
    return {_mm512_shuffle_i64x2(c, c, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_setzero_si512()};  // lo0 hi0 lo1 hi1
  }
  static fvec dot8(const W& w, ivec xu) { return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(w.base, xu, w.q)); }
  static fvec dot4(const W& w, ivec x) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.q, x));
  }
};
constexpr int kIntPath = 2;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kIntPath = 1;
#else
constexpr int kIntPath = 0;
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kTileRows = 2;  // four measured slower: 4 x 4 tiles need 32 accumulators, every AVX-512 register

// RW weight rows (row stride row_bytes; their scales and offsets at stride `groups`) against RX
// rows of activations (codes xc, row stride k; lane scales xs, row stride k / 4): out[i * stride
// + a] = the formula above for x row i and weight row a. Each step's weights are readied once for
// the RX x rows and each x block once for the RW weight rows. Every (x row, weight row) pair is
// summed in the same order whatever the tile (the offsets' term by std::fma, rounded once in
// every instantiation whatever the compiler contracts), so a row of y does not depend on M. The
// offsets' term (gs: each x row's group sums, row stride k / group) is a scalar sum beside the
// vector work.
template <class V, int BITS, int RW, int RX>
inline void q8_tile(const int8_t* xc, const float* xs, const uint8_t* q, int64_t row_bytes, int64_t k,
                    int64_t group, const float* scale, const float* offset, const float* gs, float* out,
                    int64_t stride) {
  typename V::fvec acc[RW][RX], part[RW][RX];
  float off[RW][RX];
  for (int a = 0; a < RW; ++a)
    for (int i = 0; i < RX; ++i) acc[a][i] = V::zero(), off[a][i] = 0.f;
  const int64_t groups = k / group;
  for (int64_t g = 0; g < groups; ++g) {
    for (int a = 0; a < RW; ++a)
      for (int i = 0; i < RX; ++i) part[a][i] = V::zero();
    for (int64_t j = g * group; j < (g + 1) * group; j += V::step) {
      typename V::W w[RW];
      for (int a = 0; a < RW; ++a)
        if constexpr (BITS == 8) w[a] = V::wload8(reinterpret_cast<const int8_t*>(q + a * row_bytes) + j);
        else w[a] = V::wload4(q + a * row_bytes + j / 2);
      for (int i = 0; i < RX; ++i) {
        typename V::ivec x = V::xload(xc + i * k + j);
        if constexpr (BITS == 8) x = V::xprep8(x);
        const typename V::fvec s = V::load(xs + i * (k / 4) + j / 4);
        for (int a = 0; a < RW; ++a)
          part[a][i] = V::fma(BITS == 8 ? V::dot8(w[a], x) : V::dot4(w[a], x), s, part[a][i]);
      }
    }
    for (int a = 0; a < RW; ++a) {
      const typename V::fvec s = V::set(scale[a * groups + g]);
      for (int i = 0; i < RX; ++i) acc[a][i] = V::fma(part[a][i], s, acc[a][i]);
    }
    if (offset)
      for (int a = 0; a < RW; ++a)
        for (int i = 0; i < RX; ++i) off[a][i] = std::fma(offset[a * groups + g], gs[i * groups + g], off[a][i]);
  }
  for (int a = 0; a < RW; ++a)
    for (int i = 0; i < RX; ++i) out[i * stride + a] = V::sum(acc[a][i]) + off[a][i];
}

template <class V, int BITS, int RW>
inline void q8_block(int64_t rows, const int8_t* xc, const float* xs, const uint8_t* q, int64_t row_bytes, int64_t k,
                     int64_t group, const float* scale, const float* offset, const float* gs, float* out,
                     int64_t stride) {
  switch (rows) {
    case 4: q8_tile<V, BITS, RW, 4>(xc, xs, q, row_bytes, k, group, scale, offset, gs, out, stride); break;
    case 3: q8_tile<V, BITS, RW, 3>(xc, xs, q, row_bytes, k, group, scale, offset, gs, out, stride); break;
    case 2: q8_tile<V, BITS, RW, 2>(xc, xs, q, row_bytes, k, group, scale, offset, gs, out, stride); break;
    default: q8_tile<V, BITS, RW, 1>(xc, xs, q, row_bytes, k, group, scale, offset, gs, out, stride); break;
  }
}

// Weight rows r0:r1 against `rows` rows of x (at most 4): kTileRows weight rows at a time when
// `pair` (x has several rows; at one row, one stream of weights reads faster), then one by one.
template <class V, int BITS>
inline void q8_span(int64_t r0, int64_t r1, int64_t rows, bool pair, const int8_t* xc, const float* xs,
                    const uint8_t* q, int64_t row_bytes, int64_t k, int64_t group, const float* scale,
                    const float* offset, const float* gs, float* out, int64_t stride) {
  const int64_t groups = k / group;
  int64_t r = r0;
  if (pair)
    for (; r + kTileRows <= r1; r += kTileRows)
      q8_block<V, BITS, kTileRows>(rows, xc, xs, q + r * row_bytes, row_bytes, k, group, scale + r * groups,
                                 offset ? offset + r * groups : nullptr, gs, out + r, stride);
  for (; r < r1; ++r)
    q8_block<V, BITS, 1>(rows, xc, xs, q + r * row_bytes, row_bytes, k, group, scale + r * groups,
                         offset ? offset + r * groups : nullptr, gs, out + r, stride);
}
#endif

// The same without vectors (and for groups the vector step does not divide).
inline float q8_row_scalar(const int8_t* xc, const float* xs, const void* qrow, int64_t bits, int64_t k,
                           int64_t group, const float* scale, const float* offset, const float* gs) {
  float y = 0.f, off = 0.f;
  for (int64_t g = 0; g < k / group; ++g) {
    float part = 0.f;
    for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
      int32_t t = 0;
      for (int j = 0; j < 32; ++j) {
        const int64_t e = b + j;
        int32_t q;
        if (bits == 8) {
          q = static_cast<const int8_t*>(qrow)[e];
        } else {
          const uint8_t byte = static_cast<const uint8_t*>(qrow)[b / 2 + (j & 15)];
          q = j < 16 ? (byte & 15) : (byte >> 4);
        }
        t += q * static_cast<int32_t>(xc[e]);
      }
      part += static_cast<float>(t) * xs[b / 4];
    }
    y += part * scale[g];
    if (offset) off += offset[g] * gs[g];
  }
  return y + off;
}

// `path` -1: the best this build has; 1 or 0: at most AVX2's, or the scalar loop (tests).
at::Tensor quant_matmul_q8(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales_in,
                           const at::Tensor& offsets_in, int64_t bits, int64_t group, int64_t path) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul_q8: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x_in.dim() == 2, "quant_matmul_q8: x must be (M, K)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor scales = scales_in.to(at::kFloat).contiguous();
  const bool has_offset = offsets_in.numel() > 0;
  const at::Tensor offsets = has_offset ? offsets_in.to(at::kFloat).contiguous() : offsets_in;
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.is_contiguous(), "quant_matmul_q8: qweight must be contiguous");
  TORCH_CHECK(qweight.size(1) * (bits == 4 ? 2 : 1) == k, "quant_matmul_q8: K of x and W differ");
  TORCH_CHECK(group > 0 && group % 32 == 0 && k % group == 0, "quant_matmul_q8: the group size must be a "
              "multiple of 32 dividing K, got ", group, " for K ", k);
  const int64_t groups = k / group;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups, "quant_matmul_q8: scales must be (N, K/group)");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), m, k, group, has_offset);
  const int8_t* xc = xq.codes.data();
  const float* xs = xq.scale8.data();
  const float* sp = scales.data_ptr<float>();
  const float* op = has_offset ? offsets.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const auto* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const int64_t row_bytes = bits == 8 ? k : k / 2;
  // 2: two blocks per vector step (AVX-512 VNNI; groups a multiple of 64), 1: one (AVX2), 0: none.
  const int64_t best = path < 0 ? kIntPath : std::min<int64_t>(path, kIntPath);
  const int vector = best == 2 && group % 64 == 0 ? 2 : best > 0 ? 1 : 0;
  // A run of weight rows that fits in L2 meets every 4 rows of x before the next run is read.
  const int64_t span = std::max<int64_t>(1, (int64_t{256} << 10) / row_bytes);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, k * m));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t s0 = n0; s0 < n1; s0 += span) {
      const int64_t s1 = std::min(n1, s0 + span);
      for (int64_t i = 0; i < m; i += 4) {
        const int64_t rows = std::min<int64_t>(4, m - i);
        const int8_t* xci = xc + i * k;
        const float* xsi = xs + i * (k / 4);
        const float* gsi = op ? xq.gsum.data() + i * groups : nullptr;
        if (!vector) {
          for (int64_t r = s0; r < s1; ++r)
            for (int64_t t = 0; t < rows; ++t)
              yp[(i + t) * n + r] = q8_row_scalar(xci + t * k, xsi + t * (k / 4), qp + r * row_bytes, bits, k, group,
                                                  sp + r * groups, op ? op + r * groups : nullptr,
                                                  op ? gsi + t * groups : nullptr);
          continue;
        }
        float* y = yp + i * n;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
        if (vector == 2) {
          if (bits == 8) q8_span<V512, 8>(s0, s1, rows, m > 1, xci, xsi, qp, row_bytes, k, group, sp, op, gsi, y, n);
          else q8_span<V512, 4>(s0, s1, rows, m > 1, xci, xsi, qp, row_bytes, k, group, sp, op, gsi, y, n);
          continue;
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (bits == 8) q8_span<V256, 8>(s0, s1, rows, m > 1, xci, xsi, qp, row_bytes, k, group, sp, op, gsi, y, n);
        else q8_span<V256, 4>(s0, s1, rows, m > 1, xci, xsi, qp, row_bytes, k, group, sp, op, gsi, y, n);
#endif
      }
    }
  });
  return out;
}

// 2: AVX-512 VNNI, 1: AVX2, 0: scalar.
int64_t int8_path() { return kIntPath; }

}  // namespace

TORCH_LIBRARY(qkv_quant, m) {
  m.def("quant_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int bits, int group) -> Tensor");
  m.def("quant_matmul_q8(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int bits, int group, int path=-1) -> Tensor");
  m.def("int8_path() -> int", &int8_path);
}

TORCH_LIBRARY_IMPL(qkv_quant, CPU, m) {
  m.impl("quant_matmul", &quant_matmul);
  m.impl("quant_matmul_q8", &quant_matmul_q8);
}
