// Block-sparse decode attention for CPUs: page scoring and attention that read the paged KV
// cache in place. Gathering pages into a contiguous buffer first (the torch path) triples the
// memory traffic, which on a memory-bound decode step eats most of what sparsity saves.
// Layout and semantics are those of kernels/layout.py; accumulation is in float32.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

constexpr int64_t kPage = 16;

// exp(x) for x <= 0 (softmax weights), written so that loops over it vectorize: 2^(x log2 e) split
// into an integer power set in the exponent bits and 2^f, |f| <= 1/2, by its Taylor series
// (relative error below 1e-8; underflows to 0 below -87).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.6931471805599453f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Pages sit at random places in the cache, so hardware prefetchers lose the stream at every page
// boundary; asking for the next page while computing on this one keeps memory busy.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

void check_cache(const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(cache.size(2) % kPage == 0, name, " block size must be a multiple of 16");
}

}  // namespace

// scores[r, h, p] = dot(qm[r, h], centroid of page p of row r); -inf past the row's last page.
torch::Tensor score_pages(torch::Tensor qm, torch::Tensor centroids, torch::Tensor block_table,
                          torch::Tensor seq_lens, int64_t block_size) {
  TORCH_CHECK(qm.scalar_type() == torch::kFloat && centroids.scalar_type() == torch::kFloat,
              "query means and centroids must be float32");
  qm = qm.contiguous();
  TORCH_CHECK(centroids.is_contiguous(), "centroids must be contiguous");
  auto bt = block_table.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  const int64_t rows = qm.size(0), heads = qm.size(1), d = qm.size(2);
  const int64_t per_block = block_size / kPage;
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t max_pages = 0;
  for (int64_t r = 0; r < rows; ++r) max_pages = std::max(max_pages, (lp[r] + kPage - 1) / kPage);
  auto out = torch::full({rows, heads, max_pages}, -std::numeric_limits<float>::infinity(), qm.options());
  const float* q = qm.data_ptr<float>();
  const float* c = centroids.data_ptr<float>();
  const int64_t* b = bt.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t bt_stride = bt.size(1);
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      const int64_t n = (lp[r] + kPage - 1) / kPage;
      const float* qv = q + (r * heads + h) * d;
      float* orow = o + (r * heads + h) * max_pages;
      constexpr int64_t kAhead = 8;
      for (int64_t p = 0; p < n; ++p) {
        if (p + kAhead < n) {
          const int64_t ahead = b[r * bt_stride + (p + kAhead) / per_block];
          prefetch(c + ((ahead * heads + h) * per_block + (p + kAhead) % per_block) * d, d * sizeof(float));
        }
        const int64_t blk = b[r * bt_stride + p / per_block];
        orow[p] = dot(qv, c + ((blk * heads + h) * per_block + p % per_block) * d, d);
      }
    }
  });
  return out;
}

// Selected pages per (row, kv head), ascending, -1 padded: all pages when the row fits its budget,
// else the sink pages, the local pages and the top (budget - sink - local) pages in between by
// score, ties to the lower page index (the rule of kernels/select.py).
torch::Tensor select_pages(torch::Tensor scores, torch::Tensor seq_lens, torch::Tensor budgets, int64_t sink,
                           int64_t local) {
  TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == torch::kFloat, "scores must be float32 [rows, heads, pages]");
  scores = scores.contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto buds = budgets.to(torch::kLong).contiguous();
  const int64_t rows = scores.size(0), heads = scores.size(1), max_pages = scores.size(2);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* kp = buds.data_ptr<int64_t>();
  int64_t width = 0;
  for (int64_t r = 0; r < rows; ++r) width = std::max(width, std::min((lp[r] + kPage - 1) / kPage, kp[r]));
  auto out = torch::full({rows, heads, width}, -1, scores.options().dtype(torch::kInt));
  const float* sp = scores.data_ptr<float>();
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      const int64_t n = (lp[r] + kPage - 1) / kPage, k = kp[r];
      const float* s = sp + (r * heads + h) * max_pages;
      int32_t* o = op + (r * heads + h) * width;
      int64_t w = 0;
      if (n <= k) {
        for (int64_t p = 0; p < n; ++p) o[w++] = static_cast<int32_t>(p);
        continue;
      }
      const int64_t k_mid = k - sink - local;
      float kth = std::numeric_limits<float>::infinity();
      int64_t room = 0;
      if (k_mid > 0) {
        std::vector<float> cand(s + sink, s + n - local);
        std::nth_element(cand.begin(), cand.begin() + (k_mid - 1), cand.end(), std::greater<float>());
        kth = cand[k_mid - 1];
        int64_t above = 0;
        for (int64_t p = sink; p < n - local; ++p) above += s[p] > kth;
        room = k_mid - above;
      }
      for (int64_t p = 0; p < n; ++p) {
        bool take = p < sink || p >= n - local;
        if (!take && k_mid > 0) take = s[p] > kth || (s[p] == kth && room-- > 0);
        if (take) o[w++] = static_cast<int32_t>(p);
      }
    }
  });
  return out;
}

#ifdef __AVX512F__
// One page of online softmax for one query head, float32 cache, head_dim = 16 * NC: the query and
// the accumulator live in registers across the page's 16 tokens, and each logit uses two
// independent FMA chains. (The generic loop below re-reads the accumulator per token and runs one
// long dependent chain per dot product: about three times slower.)
template <int NC>
void page_update_f32(const float* qv, const float* kb, const float* vb, int64_t valid, float scale, float& m,
                     float& l, float* acc) {
  static_assert(NC % 2 == 0, "two FMA chains per logit");
  __m512 qr[NC];
  for (int c = 0; c < NC; ++c) qr[c] = _mm512_loadu_ps(qv + 16 * c);
  float logits[kPage];
  float page_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < valid; ++t) {
    const float* kt = kb + t * NC * 16;
    __m512 s0 = _mm512_mul_ps(qr[0], _mm512_loadu_ps(kt));
    __m512 s1 = _mm512_mul_ps(qr[1], _mm512_loadu_ps(kt + 16));
    for (int c = 2; c < NC; c += 2) {
      s0 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kt + 16 * c), s0);
      s1 = _mm512_fmadd_ps(qr[c + 1], _mm512_loadu_ps(kt + 16 * (c + 1)), s1);
    }
    logits[t] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * scale;
    page_max = std::max(page_max, logits[t]);
  }
  const float new_m = std::max(m, page_max);
  const float correction = exp_nonpositive(m - new_m);
  __m512 ar[NC];
  const __m512 cv = _mm512_set1_ps(correction);
  for (int c = 0; c < NC; ++c) ar[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), cv);
  float sum = l * correction;
  for (int64_t t = 0; t < valid; ++t) {
    const float w = exp_nonpositive(logits[t] - new_m);
    sum += w;
    const __m512 wv = _mm512_set1_ps(w);
    const float* vt = vb + t * NC * 16;
    for (int c = 0; c < NC; ++c) ar[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(vt + 16 * c), ar[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + 16 * c, ar[c]);
  l = sum;
  m = new_m;
}
#endif

// One page of online softmax for one query vector, any cache dtype and head_dim: the first `valid` tokens
// of the page update the running max m, sum l and accumulator acc.
template <typename T>
inline void page_update(const float* qv, const T* kb, const T* vb, int64_t valid, float scale, int64_t d, float& m,
                        float& l, float* acc) {
  float logits[kPage];
  float page_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < valid; ++t) {
    logits[t] = dot(qv, kb + t * d, d) * scale;
    page_max = std::max(page_max, logits[t]);
  }
  const float new_m = std::max(m, page_max);
  float w[kPage];
#pragma omp simd
  for (int64_t t = 0; t < valid; ++t) w[t] = exp_nonpositive(logits[t] - new_m);
  const float correction = exp_nonpositive(m - new_m);
  float sum = l * correction;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
  for (int64_t t = 0; t < valid; ++t) {
    const float wt = w[t];
    sum += wt;
    const T* vt = vb + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += wt * static_cast<float>(vt[i]);
  }
  l = sum;
  m = new_m;
}

using PageUpdate = void (*)(const float*, const float*, const float*, int64_t, float, float&, float&, float*);

template <typename T>
PageUpdate fast_page_update(int64_t d) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float>) {
    if (d == 32) return page_update_f32<2>;
    if (d == 64) return page_update_f32<4>;
    if (d == 128) return page_update_f32<8>;
    if (d == 256) return page_update_f32<16>;
  }
#endif
  (void)d;
  return nullptr;
}

// kt[i, t] = float(kb[t, i]) for the page's first `valid` tokens, 0 past them: a page's keys, transposed.
template <typename T>
inline void widen_transposed(const T* kb, int64_t valid, int64_t d, float* kt) {
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t t = 0; t < kPage; ++t) kt[i * kPage + t] = t < valid ? static_cast<float>(kb[t * d + i]) : 0.f;
  }
}

// One page against many query vectors (any cache dtype and head_dim): the page's keys are transposed once, so
// each query's 16 logits and weights are loops over the page's 16 tokens, and its values a loop over head_dim,
// each of which the compiler vectorizes. Query j reads the page's first upto[j] tokens (none when <= 0). The
// queries of a verify or a GQA group share each page, which pays for the transpose; for a small head_dim the
// per-token path spends its time in one short dot product after another.
template <typename T>
void page_update_many(const float* const* qvs, const int64_t* upto, int64_t count, const T* kb, const T* vb,
                      int64_t valid, int64_t d, float scale, float* m, float* l, float* acc, float* kt) {
  widen_transposed(kb, valid, d, kt);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) {
    const int64_t lim = std::min(upto[j], valid);
    if (lim <= 0) continue;
    const float* qv = qvs[j];
    float logits[kPage] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float qi = qv[i];
      const float* row = kt + i * kPage;
#pragma omp simd
      for (int64_t t = 0; t < kPage; ++t) logits[t] += qi * row[t];
    }
    float page_max = kNegInf;
    for (int64_t t = 0; t < kPage; ++t) {
      logits[t] = t < lim ? logits[t] * scale : kNegInf;
      page_max = std::max(page_max, logits[t]);
    }
    const float new_m = std::max(m[j], page_max);
    float w[kPage];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < kPage; ++t) {
      w[t] = t < lim ? exp_nonpositive(logits[t] - new_m) : 0.f;
      sum += w[t];
    }
    const float correction = exp_nonpositive(m[j] - new_m);
    l[j] = l[j] * correction + sum;
    m[j] = new_m;
    float* a = acc + j * d;
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) a[x] *= correction;
    for (int64_t t = 0; t < lim; ++t) {
      const float wt = w[t];
      const T* vt = vb + t * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) a[x] += wt * static_cast<float>(vt[x]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) of eight lanes, x <= 0: exp_nonpositive's arithmetic, lane by lane (round-to-nearest for the split,
// which keeps |f| <= 1/2 as floor(t + 1/2) does).
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// page_update_many with AVX2 and FMA, for head_dim a multiple of 8: the page's keys (transposed) and values are
// widened to float32 once for all the queries, each query's 16 logits are two registers fed by two independent
// FMA chains, its weights come from exp8_nonpositive, and its accumulator takes the 16 values in two chains per
// 8 lanes. Tokens past a query's `upto` (and past `valid`) weigh exactly 0, as in page_update_many.
template <typename T>
void page_update_many_avx2(const float* const* qvs, const int64_t* upto, int64_t count, const T* kb, const T* vb,
                           int64_t valid, int64_t d, float scale, float* m, float* l, float* acc, float* kt,
                           float* vf) {
  widen_transposed(kb, valid, d, kt);
  for (int64_t t = 0; t < kPage; ++t) {
    for (int64_t x = 0; x < d; ++x) vf[t * d + x] = t < valid ? static_cast<float>(vb[t * d + x]) : 0.f;
  }
  const __m256 iota_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 iota_hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 sc = _mm256_set1_ps(scale);
  alignas(32) float w[kPage];
  for (int64_t j = 0; j < count; ++j) {
    const int64_t lim = std::min(upto[j], valid);
    if (lim <= 0) continue;
    const float* qv = qvs[j];
    __m256 lo_a = _mm256_setzero_ps(), hi_a = _mm256_setzero_ps();
    __m256 lo_b = _mm256_setzero_ps(), hi_b = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 2) {
      const __m256 qa = _mm256_set1_ps(qv[i]), qb = _mm256_set1_ps(qv[i + 1]);
      lo_a = _mm256_fmadd_ps(qa, _mm256_loadu_ps(kt + i * kPage), lo_a);
      hi_a = _mm256_fmadd_ps(qa, _mm256_loadu_ps(kt + i * kPage + 8), hi_a);
      lo_b = _mm256_fmadd_ps(qb, _mm256_loadu_ps(kt + (i + 1) * kPage), lo_b);
      hi_b = _mm256_fmadd_ps(qb, _mm256_loadu_ps(kt + (i + 1) * kPage + 8), hi_b);
    }
    __m256 lo = _mm256_mul_ps(_mm256_add_ps(lo_a, lo_b), sc);
    __m256 hi = _mm256_mul_ps(_mm256_add_ps(hi_a, hi_b), sc);
    const __m256 limit = _mm256_set1_ps(static_cast<float>(lim));
    const __m256 in_lo = _mm256_cmp_ps(iota_lo, limit, _CMP_LT_OQ);
    const __m256 in_hi = _mm256_cmp_ps(iota_hi, limit, _CMP_LT_OQ);
    lo = _mm256_blendv_ps(neg_inf, lo, in_lo);
    hi = _mm256_blendv_ps(neg_inf, hi, in_hi);
    const float new_m = std::max(m[j], hmax8(_mm256_max_ps(lo, hi)));
    const __m256 shift = _mm256_set1_ps(new_m);
    const __m256 w_lo = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(lo, shift)), in_lo);
    const __m256 w_hi = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(hi, shift)), in_hi);
    _mm256_store_ps(w, w_lo);
    _mm256_store_ps(w + 8, w_hi);
    const float correction = exp_nonpositive(m[j] - new_m);
    l[j] = l[j] * correction + hsum8(_mm256_add_ps(w_lo, w_hi));
    m[j] = new_m;
    const __m256 cv = _mm256_set1_ps(correction);
    float* a = acc + j * d;
    for (int64_t x = 0; x < d; x += 8) {
      __m256 even = _mm256_mul_ps(_mm256_loadu_ps(a + x), cv), odd = _mm256_setzero_ps();
      for (int64_t t = 0; t < kPage; t += 2) {
        even = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), _mm256_loadu_ps(vf + t * d + x), even);
        odd = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 1]), _mm256_loadu_ps(vf + (t + 1) * d + x), odd);
      }
      _mm256_storeu_ps(a + x, _mm256_add_ps(even, odd));
    }
  }
}
#endif

constexpr bool avx2_applies(int64_t d) {
#if defined(__AVX2__) && defined(__FMA__)
  return d % 8 == 0;
#else
  (void)d;
  return false;
#endif
}

// Every query vector of a (row, KV head) against one page: the AVX2 routine where it applies, else the generic one.
// `kt` and `vf` are scratch of kPage * d floats each.
template <typename T>
inline void page_update_queries(const float* const* qvs, const int64_t* upto, int64_t count, const T* kb,
                                const T* vb, int64_t valid, int64_t d, float scale, float* m, float* l, float* acc,
                                float* kt, float* vf) {
#if defined(__AVX2__) && defined(__FMA__)
  if (avx2_applies(d)) {
    page_update_many_avx2(qvs, upto, count, kb, vb, valid, d, scale, m, l, acc, kt, vf);
    return;
  }
#endif
  (void)vf;
  page_update_many(qvs, upto, count, kb, vb, valid, d, scale, m, l, acc, kt);
}

template <typename T>
void decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const int64_t* bt, int64_t bt_stride, const int64_t* lens, const int32_t* pages,
                 int64_t max_sel, double scale, torch::Tensor& out) {
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t heads = k_cache.size(1), bs = k_cache.size(2);
  const int64_t g = hq / heads;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const PageUpdate fast = fast_page_update<T>(d);
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      std::vector<float> acc(g * d, 0.f), m(g, -std::numeric_limits<float>::infinity()), l(g, 0.f);
      // Where the AVX2 routine applies, the GQA group's query vectors read each page together (widened and
      // transposed once for all of them); elsewhere the generic per-token loop, one query at a time.
      const bool together = !fast && avx2_applies(d);
      std::vector<float> kt(together ? kPage * d : 0), vf(together ? kPage * d : 0);
      std::vector<const float*> qvs(g);
      std::vector<int64_t> upto(g, kPage);
      for (int64_t gi = 0; gi < g; ++gi) qvs[gi] = qp + (r * hq + h * g + gi) * d;
      const int64_t len = lens[r];
      const int64_t n_pages = (len + kPage - 1) / kPage;
      const int64_t n = pages ? max_sel : n_pages;
      auto page_at = [&](int64_t j) -> int64_t { return pages ? pages[(r * heads + h) * max_sel + j] : j; };
      auto page_ptr = [&](const T* base, int64_t p) {
        const int64_t blk = bt[r * bt_stride + (p * kPage) / bs];
        return base + ((blk * heads + h) * bs + (p * kPage) % bs) * d;
      };
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = page_at(j);
        if (p < 0) continue;
        if (j + 1 < n && page_at(j + 1) >= 0) {
          prefetch(page_ptr(kp, page_at(j + 1)), kPage * d * sizeof(T));
          prefetch(page_ptr(vp, page_at(j + 1)), kPage * d * sizeof(T));
        }
        const int64_t valid = std::min<int64_t>(kPage, len - p * kPage);
        const T* kb = page_ptr(kp, p);
        const T* vb = page_ptr(vp, p);
        if (fast) {
          for (int64_t gi = 0; gi < g; ++gi) {
            fast(qp + (r * hq + h * g + gi) * d, reinterpret_cast<const float*>(kb), reinterpret_cast<const float*>(vb),
                 valid, static_cast<float>(scale), m[gi], l[gi], acc.data() + gi * d);
          }
          continue;
        }
        if (together) {
          page_update_queries(qvs.data(), upto.data(), g, kb, vb, valid, d, static_cast<float>(scale), m.data(),
                              l.data(), acc.data(), kt.data(), vf.data());
          continue;
        }
        for (int64_t gi = 0; gi < g; ++gi) {
          page_update(qvs[gi], kb, vb, valid, static_cast<float>(scale), d, m[gi], l[gi], acc.data() + gi * d);
        }
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        float* dst = op + (r * hq + h * g + gi) * d;
        const float inv = l[gi] > 0.f ? 1.f / l[gi] : 0.f;
        for (int64_t i = 0; i < d; ++i) dst[i] = acc[gi * d + i] * inv;
      }
    }
  });
}

// The caches of one layer and queries against them; `q_rows` names q's first dimension in the message.
void check_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const char* q_rows) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must match");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0,
              "q must be [", q_rows, ", q_heads, head_dim] matching the cache");
}

// out[r, hq] = softmax attention of q[r, hq] over the selected pages of its KV head (all pages
// when page_indices is empty), tokens past seq_lens[r] excluded. Returns float32.
torch::Tensor sparse_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens,
                            c10::optional<torch::Tensor> page_indices, double scale) {
  check_attention(q, k_cache, v_cache, "rows");
  auto qf = q.to(torch::kFloat).contiguous();
  auto bt = block_table.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  torch::Tensor pages;
  int64_t max_sel = 0;
  if (page_indices.has_value()) {
    pages = page_indices->to(torch::kInt).contiguous();
    TORCH_CHECK(pages.dim() == 3 && pages.size(0) == q.size(0) && pages.size(1) == k_cache.size(1),
                "page_indices must be [rows, kv_heads, n]");
    max_sel = pages.size(2);
  }
  auto out = torch::empty(qf.sizes(), qf.options());
  const int32_t* pp = pages.defined() ? pages.data_ptr<int32_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, k_cache.scalar_type(), "sparse_decode", [&] {
    decode_impl<scalar_t>(qf, k_cache, v_cache, bt.data_ptr<int64_t>(), bt.size(1), lens.data_ptr<int64_t>(), pp,
                          max_sel, scale, out);
  });
  return out;
}

template <typename T>
void prefill_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const int64_t* bt, int64_t bt_stride, const int64_t* lens, const int64_t* starts, int64_t rows,
                  double scale, torch::Tensor& out) {
  const int64_t hq = q.size(1), d = q.size(2);
  const int64_t heads = k_cache.size(1), bs = k_cache.size(2);
  const int64_t g = hq / heads;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const PageUpdate fast = fast_page_update<T>(d);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      const int64_t s0 = starts[r], q_len = starts[r + 1] - starts[r], len = lens[r];
      if (q_len <= 0) continue;
      const int64_t first = len - q_len;  // position of the row's first query token
      const int64_t nq = q_len * g;
      // Every query vector of the (row, KV head) against each page at once, unless it has a single one that
      // the AVX-512 per-token path serves.
      const bool many = !fast || nq > 1;
      std::vector<float> acc(nq * d, 0.f), m(nq, -std::numeric_limits<float>::infinity()), l(nq, 0.f);
      std::vector<const float*> qvs(nq);
      std::vector<int64_t> upto(nq);
      std::vector<float> kt(many ? kPage * d : 0), vf(many ? kPage * d : 0);
      for (int64_t i = 0; i < q_len; ++i) {
        for (int64_t gi = 0; gi < g; ++gi) qvs[i * g + gi] = qp + ((s0 + i) * hq + h * g + gi) * d;
      }
      auto page_ptr = [&](const T* base, int64_t p) {
        const int64_t blk = bt[r * bt_stride + (p * kPage) / bs];
        return base + ((blk * heads + h) * bs + (p * kPage) % bs) * d;
      };
      const int64_t n_pages = (len + kPage - 1) / kPage;
      for (int64_t p = 0; p < n_pages; ++p) {
        if (p + 1 < n_pages) {
          prefetch(page_ptr(kp, p + 1), kPage * d * sizeof(T));
          prefetch(page_ptr(vp, p + 1), kPage * d * sizeof(T));
        }
        const int64_t valid = std::min<int64_t>(kPage, len - p * kPage);
        const T* kb = page_ptr(kp, p);
        const T* vb = page_ptr(vp, p);
        // The page stays in L1 while every query token of the row reads it, each up to its own position.
        if (many) {
          for (int64_t i = 0; i < q_len; ++i) {
            for (int64_t gi = 0; gi < g; ++gi) upto[i * g + gi] = first + i - p * kPage + 1;
          }
          page_update_queries(qvs.data(), upto.data(), nq, kb, vb, valid, d, sc, m.data(), l.data(), acc.data(),
                              kt.data(), vf.data());
          continue;
        }
        const int64_t upto_one = std::min<int64_t>(valid, first - p * kPage + 1);  // the one query: q_len 1, g 1
        if (upto_one > 0) {
          fast(qvs[0], reinterpret_cast<const float*>(kb), reinterpret_cast<const float*>(vb), upto_one, sc, m[0], l[0],
               acc.data());
        }
      }
      for (int64_t i = 0; i < q_len; ++i) {
        for (int64_t gi = 0; gi < g; ++gi) {
          const int64_t j = i * g + gi;
          float* dst = op + ((s0 + i) * hq + h * g + gi) * d;
          const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
          for (int64_t x = 0; x < d; ++x) dst[x] = acc[j * d + x] * inv;
        }
      }
    }
  });
}

// out[t, hq] = causal attention of the query tokens q[t] over their row's cached tokens: row r's tokens are
// q[query_start_loc[r] : query_start_loc[r + 1]], the last ones of its seq_lens[r], so its i-th query token
// attends positions 0 .. seq_lens[r] - q_len + i. Dense; each (row, KV head) walks its pages once for all of
// the row's query tokens (a verify of k drafts reads the prefix once, not k + 1 times). Returns float32.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale) {
  check_attention(q, k_cache, v_cache, "tokens");
  auto qf = q.to(torch::kFloat).contiguous();
  auto bt = block_table.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto starts = query_start_loc.to(torch::kLong).contiguous();
  const int64_t rows = lens.size(0);
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == rows + 1, "query_start_loc must be [rows + 1]");
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) >= rows, "block_table must be [rows, blocks]");
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] >= 0 && sp[rows] <= q.size(0), "query_start_loc reaches past q");
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sp[r + 1] >= sp[r] && lp[r] >= sp[r + 1] - sp[r],
                "each row needs seq_len >= its query tokens, and query_start_loc must not decrease");
    TORCH_CHECK((lp[r] + k_cache.size(2) - 1) / k_cache.size(2) <= bt.size(1), "a row is longer than its block table");
  }
  auto out = torch::zeros(qf.sizes(), qf.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, k_cache.scalar_type(), "paged_prefill", [&] {
    prefill_impl<scalar_t>(qf, k_cache, v_cache, bt.data_ptr<int64_t>(), bt.size(1), lp, sp, rows, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("score_pages", &score_pages, "page scores against centroids, read in place");
  m.def("select_pages", &select_pages, "top-k page selection with sink and local pages");
  m.def("sparse_decode", &sparse_decode, "block-sparse decode attention over a paged cache, read in place");
  m.def("paged_prefill", &paged_prefill, "dense causal attention of several query tokens a row, read in place");
}
