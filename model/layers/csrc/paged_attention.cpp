// Dot-product attention that reads the paged KV cache where it lies (CPU).
//
// One call serves decode and prefill chunks alike: query token t of sequence seq[t] sees the
// first num_keys[t] positions of that sequence, found through its block table; with a sliding
// window w > 0 only the last w of them (positions num_keys[t] - w .. num_keys[t] - 1, as HF's
// sliding-window mask: key j is seen by query i when i - w < j <= i). Work items are
// (query token, KV head); each item scores all G = Hq / Hkv query heads of its group against
// every key row it reads, so a key is loaded once per group (grouped-query attention). Two
// passes per item over a scratch row of scores (scores, softmax, weighted sum of values),
// accumulated in float32 whatever the cache's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// Loads of 16 cache elements as float32, and the plain fallbacks.
#if defined(__AVX512F__)
constexpr bool kVector = true;
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32.
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename T>
inline __m512 load16(const T* p) {  // double: never on the fast path
  float buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = static_cast<float>(p[i]);
  return _mm512_loadu_ps(buf);
}
#else
constexpr bool kVector = false;
#endif

// AVX2 + FMA (machines without AVX-512): the same loops 8 floats wide.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
constexpr bool kVector8 = true;
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
template <typename T>
inline __m256 load8(const T* p) {  // double (and half without F16C): never on the fast path
  float buf[8];
  for (int i = 0; i < 8; ++i) buf[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(buf);
}
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}
#else
constexpr bool kVector8 = false;
#endif

// q . k over d elements (q float32, k in the cache's dtype).
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
#if defined(__AVX512F__)
  if (kVector && d % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (kVector8 && d % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
    return sum8(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

// y += a * x over d elements.
template <typename T>
inline void axpy(float* y, float a, const T* x, int64_t d) {
#if defined(__AVX512F__)
  if (kVector && d % 16 == 0) {
    const __m512 av = _mm512_set1_ps(a);
    for (int64_t i = 0; i < d; i += 16)
      _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, load16(x + i), _mm512_loadu_ps(y + i)));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (kVector8 && d % 8 == 0) {
    const __m256 av = _mm256_set1_ps(a);
    for (int64_t i = 0; i < d; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x + i), _mm256_loadu_ps(y + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) y[i] += a * static_cast<float>(x[i]);
}

// Asks the caches for `bytes` from p on, a line (64 bytes) at a time: Locality 3 into L1, 2 into L2.
template <int Locality>
inline void prefetch_run(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, Locality);
}
// With one or a few sequences a thread reads its heads' part of each row and waits on memory for
// each row in turn (nothing else runs beside it); requesting the keys this many positions ahead,
// and each position's values during the keys' pass, took cold-cache batch-1 calls (GPT-2's 12
// heads, 256-1,024 positions) to 0.79-0.95x their time. With many sequences it measured no gain.
constexpr int64_t kPrefetchAhead = 4;

struct Shape {
  int64_t bs, hkv, g, d;  // block size, KV heads, query heads per KV head, head size
};

// Query heads of KV heads [h0, h1) of one query token against its visible keys, positions
// lo .. end - 1 of its sequence (n = end - lo of them).
// q and out point at query head h0 * G; scores is scratch of (h1 - h0) * G * n floats.
// `prefetch`: request rows ahead of the reads (see kPrefetchAhead).
template <typename cache_t>
void attend_item(const float* q, const cache_t* k_cache, const cache_t* v_cache, const int64_t* table,
                 int64_t lo, int64_t end, int64_t h0, int64_t h1, const Shape& sh, float* out,
                 std::vector<float>& scores, bool prefetch) {
  const int64_t heads = (h1 - h0) * sh.g, d = sh.d, n = end - lo;
  scores.resize(static_cast<size_t>(heads * n));
  float* s = scores.data();
  const int64_t row_stride = sh.hkv * d;  // between consecutive positions of one block
  const int64_t block_stride = sh.bs * row_stride;
  const int64_t run = (h1 - h0) * d * static_cast<int64_t>(sizeof(cache_t));  // bytes of a row this item reads
  // Pass 1: scores s[i, j - lo] = q_i . k_j, reading each position's heads h0..h1 as one run;
  // block by block, the first one entered at row lo % bs.
  for (int64_t j = lo; j < end;) {
    const int64_t r0 = j % sh.bs, rows = std::min(sh.bs - r0, end - j);
    const cache_t* base = k_cache + table[j / sh.bs] * block_stride + h0 * d;
    const cache_t* vbase = v_cache + table[j / sh.bs] * block_stride + h0 * d;
    for (int64_t r = r0; r < r0 + rows; ++r) {
      if (prefetch) {  // the keys kPrefetchAhead positions on, and this position's values for pass 2
        const int64_t jn = j + r - r0 + kPrefetchAhead;
        if (jn < end)
          prefetch_run<3>(k_cache + table[jn / sh.bs] * block_stride + (jn % sh.bs) * row_stride + h0 * d, run);
        prefetch_run<2>(vbase + r * row_stride, run);
      }
      for (int64_t i = 0; i < heads; ++i)
        s[i * n + j - lo + r - r0] = dot(q + i * d, base + r * row_stride + (i / sh.g) * d, d);
    }
    j += rows;
  }
  // Softmax per head; the normaliser is applied to the output at the end.
  std::vector<float> inv(static_cast<size_t>(heads));
  for (int64_t i = 0; i < heads; ++i) {
    float* si = s + i * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, si[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      si[j] = std::exp(si[j] - m);
      sum += si[j];
    }
    inv[i] = 1.f / sum;
  }
  // Pass 2: out_i = sum_j p[i, j] v_j.
  std::fill(out, out + heads * d, 0.f);
  for (int64_t j = lo; j < end;) {
    const int64_t r0 = j % sh.bs, rows = std::min(sh.bs - r0, end - j);
    const cache_t* base = v_cache + table[j / sh.bs] * block_stride + h0 * d;
    for (int64_t r = r0; r < r0 + rows; ++r)
      for (int64_t i = 0; i < heads; ++i)
        axpy(out + i * d, s[i * n + j - lo + r - r0], base + r * row_stride + (i / sh.g) * d, d);
    j += rows;
  }
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t e = 0; e < d; ++e) out[i * d + e] *= inv[i];
}

// q (T, Hq, d) float32; k_cache, v_cache (N, bs, Hkv, d); block_tables (S, W) int64;
// query_seq (T,) int64: row of block_tables; num_keys (T,) int64 >= 1; window: the sliding
// window in positions, 0 for none. -> (T, Hq, d) float32.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_seq,
                           const at::Tensor& num_keys, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be (T, Hq, d) float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v caches must be (N, bs, Hkv, d)");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v caches must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong, "block_tables must be (S, W) int64");
  TORCH_CHECK(query_seq.scalar_type() == at::kLong && num_keys.scalar_type() == at::kLong,
              "query_seq and num_keys must be int64");
  const int64_t t_count = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), hkv = k_cache.size(2), width = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == d, "head size of q (", d, ") and cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(hq % hkv == 0, "query heads (", hq, ") must be a multiple of KV heads (", hkv, ")");
  TORCH_CHECK(query_seq.numel() == t_count && num_keys.numel() == t_count, "one query_seq/num_keys per query");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window), got ", window);
  const int64_t g_count = hq / hkv;

  const at::Tensor qs = (q * scale).contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor seqs = query_seq.contiguous(), nk = num_keys.contiguous();
  const int64_t* seq_p = seqs.data_ptr<int64_t>();
  const int64_t* nk_p = nk.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_count; ++t) {
    TORCH_CHECK(nk_p[t] >= 1 && nk_p[t] <= width * bs, "num_keys[", t, "] = ", nk_p[t], " outside [1, ", width * bs, "]");
    TORCH_CHECK(seq_p[t] >= 0 && seq_p[t] < tables.size(0), "query_seq[", t, "] outside the block tables");
  }
  at::Tensor out = at::empty({t_count, hq, d}, q.options());
  const float* q_p = qs.data_ptr<float>();
  const int64_t* tab_p = tables.data_ptr<int64_t>();
  float* out_p = out.data_ptr<float>();

  // Split each token's KV heads into chunks only when there are too few tokens to keep every
  // thread busy (decode at small batch); a chunk reads its heads' part of each cache row.
  const int64_t want = 4 * at::get_num_threads();
  const int64_t chunks = std::min(hkv, std::max<int64_t>(1, (want + t_count - 1) / t_count));
  const int64_t per_chunk = (hkv + chunks - 1) / chunks;
  const int64_t n_chunks = (hkv + per_chunk - 1) / per_chunk;
  const Shape sh{bs, hkv, g_count, d};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* k_p = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_p = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, t_count * n_chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t = item / n_chunks, h0 = (item % n_chunks) * per_chunk;
        const int64_t h1 = std::min(hkv, h0 + per_chunk);
        const int64_t off = (t * hq + h0 * g_count) * d;  // query head h0 * G of token t
        const int64_t lo = window > 0 ? std::max<int64_t>(0, nk_p[t] - window) : 0;
        attend_item<scalar_t>(q_p + off, k_p, v_p, tab_p + seq_p[t] * width, lo, nk_p[t], h0, h1, sh,
                              out_p + off, scores, n_chunks > 1);  // heads split: few tokens
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(qkv_paged, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_seq, "
        "Tensor num_keys, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(qkv_paged, CPU, m) { m.impl("paged_attention", &paged_attention); }
