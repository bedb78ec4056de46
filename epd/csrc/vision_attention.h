// The vision tower's attention in bfloat16 (included by gdn_chunk.cpp inside its anonymous
// namespace): one image's patches, every query against every key (no mask), on vdpbf16ps.
//
// Why: in bfloat16 the tower's attention went through float32 products (oneDNN's float32 bmm) and
// torch's softmax between them, ~300 ms of a 448x448 image's ~1,050 on one AMD EPYC core (784
// patches, 12 layers of 12 heads of 64): a quarter of the tower, where its share of the FLOPs is
// a ninth. Here the scores are bfloat16 products summed in float32 (vdpbf16ps: each product exact,
// as in the float32 path; only the order of the sums differs), the softmax runs on them in float32
// without leaving L1, and its weights multiply the values as bfloat16 (the rounding torch's own
// fused CPU kernel makes for bfloat16), summed in float32 and divided by the sum of the rounded
// weights (so constant values come back exactly).
//
// Layout: each head's keys as the few-row kernel's panels of 16 "columns" (keys), [L/16][D/2][16][2];
// its values transposed to panels of 16 output features, [D/16][L/2][16][2]; a block of 8 query
// rows at a time against all of them (its scores, 8 x L float32, stay in L1 for L up to ~1,000).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define EPD_VISION_ATTENTION 1

constexpr int64_t kAttentionRows = 8;  // query rows a block

inline uint32_t bf16_pair(const c10::BFloat16* at) {
  uint32_t pair;
  std::memcpy(&pair, at, sizeof(pair));
  return pair;
}

// out[r][p * 16 + c] = mul[r] * sum over `steps` pairs of x[r] (pairs, `ldx` pairs a row) and lane c of
// P panels of `w` (pairs, `panel` pairs apart; 16 lanes a step). The sums live in a local array
// (GCC keeps one passed in by reference in memory, a store and a load a product).
template <int P>
inline void pair_products(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t panel, int64_t steps,
                          const float* mul, float* out, int64_t ldo) {
  __m512 acc[kAttentionRows][P];
  for (int r = 0; r < kAttentionRows; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    __m512i wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_si512(w + p * panel + s * 16);
    for (int r = 0; r < kAttentionRows; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + s]));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)wv[p], xr);
    }
  }
  for (int r = 0; r < kAttentionRows; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + r * ldo + p * 16, _mm512_mul_ps(acc[r][p], _mm512_set1_ps(mul[r])));
}

// query/key/value [heads, L, D] bfloat16 (rows of D contiguous, any other strides) -> [L, heads, D]
at::Tensor vision_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->dim() == 3 && t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->stride(2) == 1 &&
                    t->sizes() == query.sizes(),
                "epd_gdn_chunk.vision_attention: query, key and value must be bfloat16 [heads, L, D] of one shape, "
                "D contiguous");
  const int64_t heads = query.size(0), length = query.size(1), dim = query.size(2);
  TORCH_CHECK(dim % 16 == 0 && dim <= 256 && length >= 1, "epd_gdn_chunk.vision_attention: D must be a multiple of 16 "
              "up to 256, got ", dim);
  const int64_t key_panels = (length + 15) / 16, pairs = dim / 2, value_steps = (length + 1) / 2;
  const int64_t padded = key_panels * 16;  // scores a row (keys past L masked)
  const int64_t value_panels = dim / 16;
  at::Tensor out = at::empty({length, heads, dim}, query.options());
  // each head's keys and values packed (12 heads of a 784-patch image: 2.4 MB)
  std::vector<uint32_t> keys(heads * key_panels * pairs * 16, 0);
  std::vector<uint32_t> values(heads * value_panels * value_steps * 16, 0);
  const auto* kp = key.data_ptr<c10::BFloat16>();
  const auto* vp = value.data_ptr<c10::BFloat16>();
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      uint32_t* kd = &keys[h * key_panels * pairs * 16];
      for (int64_t j = 0; j < length; ++j) {
        const c10::BFloat16* row = kp + h * key.stride(0) + j * key.stride(1);
        for (int64_t s = 0; s < pairs; ++s) kd[((j / 16) * pairs + s) * 16 + j % 16] = bf16_pair(row + 2 * s);
      }
      auto* vd = reinterpret_cast<c10::BFloat16*>(&values[h * value_panels * value_steps * 16]);
      for (int64_t j = 0; j < length; ++j) {
        const c10::BFloat16* row = vp + h * value.stride(0) + j * value.stride(1);
        for (int64_t d = 0; d < dim; ++d) vd[(((d / 16) * value_steps + j / 2) * 16 + d % 16) * 2 + j % 2] = row[d];
      }
    }
  });
  const int64_t blocks = (length + kAttentionRows - 1) / kAttentionRows;
  const auto* qp = query.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, heads * blocks, 4, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> rows(kAttentionRows * pairs);
    std::vector<float> scores(kAttentionRows * padded);
    std::vector<uint32_t> weights(kAttentionRows * value_steps);  // the softmax's bfloat16 weights, pairs
    std::vector<float> features(kAttentionRows * dim);  // a block's output rows in float32
    float total[kAttentionRows], inverse[kAttentionRows], scales[kAttentionRows];
    std::fill(scales, scales + kAttentionRows, static_cast<float>(scale));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, r0 = (task % blocks) * kAttentionRows;
      const int64_t nrows = std::min<int64_t>(kAttentionRows, length - r0);
      std::fill(rows.begin(), rows.end(), 0u);  // rows past L: zeros (computed, not stored)
      for (int64_t r = 0; r < nrows; ++r) {
        const c10::BFloat16* row = qp + h * query.stride(0) + (r0 + r) * query.stride(1);
        for (int64_t s = 0; s < pairs; ++s) rows[r * pairs + s] = bf16_pair(row + 2 * s);
      }
      // scores, two panels of keys at a time
      const uint32_t* kh = &keys[h * key_panels * pairs * 16];
      for (int64_t p = 0; p < key_panels; p += 2) {
        if (p + 1 < key_panels)
          pair_products<2>(rows.data(), pairs, kh + p * pairs * 16, pairs * 16, pairs, scales, &scores[p * 16], padded);
        else
          pair_products<1>(rows.data(), pairs, kh + p * pairs * 16, pairs * 16, pairs, scales, &scores[p * 16], padded);
      }
      // softmax in float32, its weights rounded to bfloat16 (pairs of keys; the odd key past L is 0)
      for (int r = 0; r < kAttentionRows; ++r) {
        float* s = &scores[r * padded];
        for (int64_t j = length; j < padded; ++j) s[j] = -std::numeric_limits<float>::infinity();
        __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t j = 0; j < padded; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        auto* w = reinterpret_cast<c10::BFloat16*>(&weights[r * value_steps]);
        for (int64_t j = 0; j < padded; j += 16) {
          const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(vexp(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
          sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
          const int64_t valid = std::min<int64_t>(16, 2 * value_steps - j);  // the weights' own length
          if (valid > 0) _mm256_mask_storeu_epi16(w + j, static_cast<__mmask16>((1u << valid) - 1), rounded);
        }
        total[r] = _mm512_reduce_add_ps(sum);
      }
      // the weighted values, two panels of 16 features at a time, divided by the weights' sums
      const uint32_t* vh = &values[h * value_panels * value_steps * 16];
      for (int r = 0; r < kAttentionRows; ++r) inverse[r] = 1.f / total[r];
      for (int64_t p = 0; p < value_panels; p += 2) {
        if (p + 1 < value_panels)
          pair_products<2>(weights.data(), value_steps, vh + p * value_steps * 16, value_steps * 16, value_steps, inverse,
                           &features[p * 16], dim);
        else
          pair_products<1>(weights.data(), value_steps, vh + p * value_steps * 16, value_steps * 16, value_steps, inverse,
                           &features[p * 16], dim);
      }
      for (int64_t r = 0; r < nrows; ++r)
        for (int64_t d = 0; d < dim; d += 16) {
          const __m256i bits = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(&features[r * dim + d]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + ((r0 + r) * heads + h) * dim + d), bits);
        }
    }
  });
  return out;
}

#endif  // __AVX512F__ && __AVX512BF16__
