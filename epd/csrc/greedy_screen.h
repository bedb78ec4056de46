// The LM head of a greedy decode step, screened on int8 (included by decode_ops.cpp inside its
// anonymous namespace, after the AMX section: it uses on_team, kPanel and the tiles' grant). Two
// paths: AMX-INT8 tiles (Intel Sapphire Rapids and later) and AVX-512 VNNI registers (AMD Zen 4,
// Intel Ice Lake and later), the second for CPUs without the tiles (see "On AVX-512 VNNI" below).
//
// Why: a greedy row needs the index of its largest logit, not the logits, and the LM head is a
// third of the bytes a decode step streams (248,320 x 1,024 bfloat16: 508 MB of qwen3.5-0.8b's
// ~1.5 GB a step). The screen reads an int8 copy of the head instead (254 MB) and, for each row
// and column, a certain interval around the column's logit; only the columns whose interval
// reaches the row's best lower bound can hold the maximum (a few dozen of 248,320), and those are
// multiplied exactly, by the same kernel and panels as the full head (``linear_float``), so the
// index is the one the full head's logits give, first maximum included (the caller does that
// product, ``kernels.GreedyScreen``).
//
// The interval. Each head row i is w_i = s_i q_i + b_i with q_i int8 (round to nearest of w / s_i,
// s_i = max |w_i| / 127, so |b_ij| <= s_i / 2). Each activation row h (the step's final-normed
// hidden, exact in float) is taken in two int8 levels, h = sh1 q1 + sh2 q2 + a (the second level
// quantizes the first's remainder, so |a_j| <= sh2 / 2, about |h|max / 32,000). The tiles give the
// integer dots d1 = q1 . q_i and d2 = q2 . q_i exactly (int32), and
//   h . w_i = s_i (sh1 d1 + sh2 d2) + s_i (a . q_i) + h . b_i
//   |h . w_i - s_i (sh1 d1 + sh2 d2)| <= s_i (max|a| ||q_i||_1 + ||h||_1 / 2).
// The exact kernel's float32 sum differs from h . w_i by at most gamma_K sum_j |h_j w_ij| <=
// gamma_K ||h||_1 127 s_i (gamma_K = K u / (1 - K u), u = 2^-24), and the float32 evaluation of
// the approximation by a few u of its terms; the bound adds both, and a relative 1e-5 besides.
// A column is dropped when its upper end is below the row's best lower end L: then its sum is
// below the largest sum. With bfloat16 logits (the head's values are rounded once, and greedy
// takes the first of equal maxima) it is dropped only when its upper end rounds below L's rounded
// value: rounding is monotonic, so its rounded logit is then below the maximum's, never equal.
// While the product runs, each thread drops below L - |L| / 64 of what it has seen (two bfloat16
// steps under it: a line that only rises and stays below the final one).
//
// On AVX-512 VNNI (no tiles). There the bfloat16 head is as much arithmetic as memory: a 16-row
// step's head is ~20 ms of vdpbf16ps at the cores' peak and ~20 ms of the memory's rate (AMD
// EPYC, 2 cores). vpdpbusd does 64 int8 products an instruction where vdpbf16ps does 32, so one
// level of the rows (q1 alone) halves the arithmetic as the int8 copy halves the bytes; a second
// level would give the arithmetic back. With one level a = h - sh1 q1 is ~|h|max / 254 an
// element, and max|a| ||q_i||_1 leaves ~230 columns a row (a 0.8b's decode rows); Cauchy-Schwarz
// is tighter for both of the bound's terms, |a . q_i| <= ||a||_2 ||q_i||_2 and
// |h . b_i| <= ||h||_2 ||b_i||_2 (||q_i||_2 and ||b_i||_2 computed once, exactly, with the copy;
// ||a||_2, ||h||_2 a row, a step), and the smaller of each pair is taken: ~60 columns a row left.
// Those are gathered from the head's rows and multiplied exactly by the caller (a few thousand
// columns for 16 rows, under 1% of the head's bytes). vpdpbusd multiplies unsigned by signed
// bytes: the rows go in as q1 + 128 and 128 sum_j q_ij is taken off each column's sum.
#if defined(EPD_DECODE_AMX) && defined(__AMX_INT8__)
#define EPD_DECODE_SCREEN_TILES 1
#endif
#if defined(EPD_DECODE_AVX512) && defined(__AVX512VNNI__)
#define EPD_DECODE_SCREEN_VECTOR 1
#endif
#if defined(EPD_DECODE_SCREEN_TILES) || defined(EPD_DECODE_SCREEN_VECTOR)
#define EPD_DECODE_SCREEN 1

constexpr int64_t kScreenStep = 64;  // k values per int8 tile step (64 bytes a tile row); the copy's K rounds up to it
// more columns left: the caller multiplies the whole head instead (the tiles' two levels leave a
// few dozen, whose whole panels are multiplied; the vector path's one level a few thousand,
// gathered as single rows: 16,384 of them are 32 MiB of a bfloat16 head of 1,024 features)
constexpr int64_t kScreenMaxCandidates = 4096;
constexpr int64_t kScreenMaxGathered = 16384;
constexpr float kUnit = 5.9604645e-08f;  // 2^-24

// Each row of a [N, K] weight in int8 at its own scale, laid out as the tiles' B operand (and
// vpdpbusd's: one 64-byte vector is 16 columns x 4 k): [N/16 panels][Kp/4][16 columns][4 k] with
// Kp = K rounded up to 64 (zeros past K, and zero rows past N). `offset`: each q stored as the
// unsigned byte q + 128 (vpdpbusd's unsigned operand; the vector path). Returns (packed bytes,
// scale float [N], ||q_i||_1 float [N], ||q_i||_2 float [N] rounded up, ||w_i - s_i q_i||_2
// float [N] rounded up).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> pack_i8(const at::Tensor& weight, bool offset) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "epd_decode.pack_i8: a 2-D CPU weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "epd_decode.pack_i8: bfloat16 or float32, got ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const int64_t kp = (k + kScreenStep - 1) / kScreenStep * kScreenStep, panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, kp / 4, kPanel * 4}, weight.options().dtype(at::kChar));
  at::Tensor scale = at::zeros({n}, weight.options().dtype(at::kFloat));
  at::Tensor l1 = at::zeros({n}, weight.options().dtype(at::kFloat));
  at::Tensor l2 = at::zeros({n}, weight.options().dtype(at::kFloat));
  at::Tensor rounding = at::zeros({n}, weight.options().dtype(at::kFloat));
  int8_t* dst = packed.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  float* l1p = l1.data_ptr<float>();
  float* l2p = l2.data_ptr<float>();
  float* bp = rounding.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);  // a row at a time in float32 (the whole head would be 4 bytes an element more)
    for (int64_t i = begin; i < end; ++i) {
      if (bf16) {
        const c10::BFloat16* src = w.data_ptr<c10::BFloat16>() + i * k;
        for (int64_t j = 0; j < k; ++j) row[j] = static_cast<float>(src[j]);
      } else {
        std::memcpy(row.data(), w.data_ptr<float>() + i * k, k * sizeof(float));
      }
      float top = 0.f;
      for (int64_t j = 0; j < k; ++j) top = std::max(top, std::fabs(row[j]));
      TORCH_CHECK(std::isfinite(top), "epd_decode.pack_i8: row ", i, " of the weight is not finite");
      const float s = top / 127.f;
      sp[i] = s;
      if (s == 0.f) continue;  // q = 0, b = 0: the row's logits are exactly 0
      int64_t sum = 0, squares = 0;
      double rest = 0.0;
      int8_t* panel = dst + (i / kPanel) * kp * kPanel;
      const int64_t lane = i % kPanel;
      for (int64_t j = 0; j < k; ++j) {
        const int q = static_cast<int>(std::clamp(std::nearbyint(row[j] / s), -127.f, 127.f));
        panel[(j / 4) * kPanel * 4 + lane * 4 + j % 4] = offset ? static_cast<int8_t>(static_cast<uint8_t>(q + 128)) : static_cast<int8_t>(q);
        sum += std::abs(q);
        squares += q * q;
        const double b = static_cast<double>(row[j]) - static_cast<double>(q) * s;  // exact in double
        rest += b * b;
      }
      l1p[i] = static_cast<float>(sum);
      l2p[i] = static_cast<float>(std::sqrt(static_cast<double>(squares)) * (1.0 + 1e-6));
      bp[i] = static_cast<float>(std::sqrt(rest) * (1.0 + 1e-6));
    }
  });
  return {packed, scale, l1, l2, rounding};
}

// One activation row in one or two int8 levels (see above) and the figures its bounds need.
constexpr int kScreenOutliers = 8;  // features of a row the vector path takes apart, in float
struct ScreenRow {
  float sh1 = 0.f, sh2 = 0.f;  // the two levels' scales (sh2 0: one level)
  float norm1 = 0.f;           // ||h||_1, rounded up
  float norm2 = 0.f;           // ||h||_2, rounded up
  float rest = 0.f;            // max |a|, rounded up
  float rest2 = 0.f;           // ||a||_2, rounded up
  // the features taken apart (the row's largest in magnitude; not in q1 or a) and their ||.||_1
  int outliers = 0;
  int32_t at[kScreenOutliers] = {};
  float value[kScreenOutliers] = {};
  float outlier_norm1 = 0.f;
  bool finite = true;
};

// Row `x` (k values) in int8 levels: q1 always, q2 (the first level's remainder) where `q2` is
// not null, after the `outliers` largest features in magnitude are taken apart (their
// products are summed in float: one outlier feature, as the massive activations of trained
// models, would otherwise set q1's scale for every feature and loosen every bound of the row).
// q1 and q2 are written for kp values (zeros past k and at the features taken apart).
template <typename T>
ScreenRow quantize_row(const T* x, int64_t k, int64_t kp, int8_t* q1, int8_t* q2, int outliers = 0) {
  ScreenRow row;
  std::vector<float> dense(k);
  double norm1 = 0.0, squares = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    const float v = static_cast<float>(x[j]);
    dense[j] = v;
    norm1 += std::fabs(v);
    squares += static_cast<double>(v) * v;
  }
  if (!std::isfinite(norm1) || !std::isfinite(squares)) {
    row.finite = false;
    return row;
  }
  std::memset(q1, 0, kp);
  if (q2 != nullptr) std::memset(q2, 0, kp);
  row.norm1 = static_cast<float>(norm1 * (1.0 + 1e-6));
  row.norm2 = static_cast<float>(std::sqrt(squares) * (1.0 + 1e-6));
  if (outliers > 0) {
    // the largest `outliers` + 1 features in magnitude; those at least twice the last one are
    // taken apart (none in a row without outliers: a Gaussian row's largest is ~1.3x its ninth)
    const int64_t ranked = std::min<int64_t>(std::min(outliers, kScreenOutliers) + 1, k);
    std::vector<int32_t> order(k);
    for (int64_t j = 0; j < k; ++j) order[j] = static_cast<int32_t>(j);
    std::partial_sort(order.begin(), order.begin() + ranked, order.end(),
                      [&](int32_t l, int32_t r) { return std::fabs(dense[l]) > std::fabs(dense[r]); });
    const float floor = 2.f * std::fabs(dense[order[ranked - 1]]);
    while (row.outliers < ranked - 1 && std::fabs(dense[order[row.outliers]]) >= floor) ++row.outliers;
    double taken = 0.0;
    for (int t = 0; t < row.outliers; ++t) {
      row.at[t] = order[t];
      row.value[t] = dense[order[t]];
      taken += std::fabs(dense[order[t]]);
      dense[order[t]] = 0.f;
    }
    row.outlier_norm1 = static_cast<float>(taken * (1.0 + 1e-6));
  }
  float top = 0.f;
  for (int64_t j = 0; j < k; ++j) top = std::max(top, std::fabs(dense[j]));
  std::vector<double> remainder(k);
  if (!std::isnormal(top / 127.f)) {  // zero or (sub)normal-small: no levels, all of h is the remainder a
    for (int64_t j = 0; j < k; ++j) remainder[j] = dense[j];
  } else {
    row.sh1 = top / 127.f;
    double top2 = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const float v = dense[j];
      const int q = static_cast<int>(std::clamp(std::nearbyint(v / row.sh1), -127.f, 127.f));
      q1[j] = static_cast<int8_t>(q);
      remainder[j] = static_cast<double>(v) - static_cast<double>(q) * row.sh1;  // exact in double
      top2 = std::max(top2, std::fabs(remainder[j]));
    }
    if (q2 != nullptr && std::isnormal(static_cast<float>(top2 / 127.0))) {  // else the remainder stays all of a
      row.sh2 = static_cast<float>(top2 / 127.0);
      for (int64_t j = 0; j < k; ++j) {
        const float q = std::clamp(std::nearbyint(static_cast<float>(remainder[j] / row.sh2)), -127.f, 127.f);
        q2[j] = static_cast<int8_t>(q);
        remainder[j] -= static_cast<double>(q) * row.sh2;
      }
    }
  }
  double rest = 0.0, rest2 = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    rest = std::max(rest, std::fabs(remainder[j]));
    rest2 += remainder[j] * remainder[j];
  }
  row.rest = static_cast<float>(rest * (1.0 + 1e-6));
  row.rest2 = static_cast<float>(std::sqrt(rest2) * (1.0 + 1e-6));
  return row;
}

struct Found {
  int32_t row, column;
  float upper;
};

// The final cut, exact: with bfloat16 logits a column stays while its upper end rounds to the
// best lower end's rounded value or above (rounding is monotonic, so a column below that has a
// rounded logit below the maximum's); with float32 ones while it reaches the best lower end.
// Returns the columns left, sorted, each once; empty where a bound is not finite or more than
// `cap` are left.
at::Tensor screened_columns(const std::vector<Found>& found, const std::vector<float>& best_lower, bool bf16_logits,
                            int64_t cap, const at::Tensor& like) {
  const at::Tensor none = at::empty({0}, like.options().dtype(at::kLong));
  std::vector<int64_t> columns;
  for (const Found& f : found) {
    const float l = best_lower[f.row];
    if (!std::isfinite(l) || !std::isfinite(f.upper)) return none;
    const bool keep = bf16_logits ? static_cast<float>(c10::BFloat16(f.upper)) >= static_cast<float>(c10::BFloat16(l))
                                  : f.upper >= l;
    if (keep) columns.push_back(f.column);
  }
  std::sort(columns.begin(), columns.end());
  columns.erase(std::unique(columns.begin(), columns.end()), columns.end());
  if (columns.empty() || static_cast<int64_t>(columns.size()) > cap) return none;
  at::Tensor out = at::empty({static_cast<int64_t>(columns.size())}, like.options().dtype(at::kLong));
  std::memcpy(out.data_ptr<int64_t>(), columns.data(), columns.size() * sizeof(int64_t));
  return out;
}

void check_screen_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& l1,
                       int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "epd_decode.screen: x must be 2-D bfloat16 or float32, rows contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kPanel * 4,
              "epd_decode.screen: the packed weight must come from pack_i8");
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1) * 4, panels = packed.size(0);
  TORCH_CHECK(k <= kp && kp - k < kScreenStep, "epd_decode.screen: x has ", k, " features, the weight ", kp);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel && scale.numel() == n && l1.numel() == n &&
                  scale.scalar_type() == at::kFloat && l1.scalar_type() == at::kFloat,
              "epd_decode.screen: bad n, scale or l1");
  TORCH_CHECK(m >= 1 && m <= 256, "epd_decode.screen: 1 to 256 rows");
}

inline __mmask16 panel_mask(int64_t col, int64_t n) {
  const int64_t valid = std::min<int64_t>(kPanel, n - col);
  return valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
}

// The columns of a panel whose upper end reaches `line`: into `mine`; the lanes' lower ends raise
// `lane_lo`'s (masked lanes, past n, count as -inf).
inline void keep_panel(__m512 lo, __m512 hi, __mmask16 mask, float line, int32_t row, int64_t col, float* lane_lo,
                       std::vector<Found>& mine) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  _mm512_storeu_ps(lane_lo, _mm512_max_ps(_mm512_loadu_ps(lane_lo), _mm512_mask_blend_ps(mask, minus_inf, lo)));
  __mmask16 keep = _mm512_cmp_ps_mask(hi, _mm512_set1_ps(line), _CMP_GE_OQ) & mask;
  if (keep) {
    alignas(64) float upper[16];
    _mm512_store_ps(upper, hi);
    for (; keep; keep &= keep - 1) {
      const int lane = __builtin_ctz(keep);
      mine.push_back({row, static_cast<int32_t>(col + lane), upper[lane]});
    }
  }
}

#endif  // EPD_DECODE_SCREEN
#ifdef EPD_DECODE_SCREEN_TILES
inline void configure_screen_tiles(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {  // 0-3: int32 sums (level 1 and 2 of two panels), 4-5: q1, q2
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {  // the two panels' int8 weight
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // see configure_tiles
  _tile_loadconfig(&cfg);
}

// The columns of the head that may hold the maximum of some row of x, on the tiles with two levels
// of the rows: sorted, each once; empty when a row is not finite or more than
// kScreenMaxCandidates columns remain (the caller then multiplies the whole head).
at::Tensor screen(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& l1,
                  int64_t n, bool bf16_logits) {
  check_screen_args(x, packed, scale, l1, n);
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1) * 4, panels = packed.size(0);
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  if (!amx_enabled()) return none;

  // the rows in two levels, zero-padded to whole tiles of 16 rows
  const int64_t blocks = (m + 15) / 16;
  std::vector<int8_t> q1(blocks * 16 * kp, 0), q2(blocks * 16 * kp, 0);
  std::vector<ScreenRow> rows(blocks * 16);
  for (int64_t r = 0; r < m; ++r) {
    rows[r] = x.scalar_type() == at::kBFloat16
                  ? quantize_row(x.data_ptr<c10::BFloat16>() + r * x.stride(0), k, kp, &q1[r * kp], &q2[r * kp])
                  : quantize_row(x.data_ptr<float>() + r * x.stride(0), k, kp, &q1[r * kp], &q2[r * kp]);
    if (!rows[r].finite) return none;
  }
  const float gamma = static_cast<float>(k) * kUnit / (1.f - static_cast<float>(k) * kUnit);
  // per s_i ||h||_1: the weight's rounding (1/2, and 127u for w / s_i's own) and the exact sum's
  const float half = 0.5f + 1e-4f + 127.001f * gamma;

  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* lp = l1.data_ptr<float>();
  const int64_t panel_bytes = kp * kPanel;
  const int64_t grain = std::max<int64_t>(4, (64 << 10) / panel_bytes);
  const int64_t tasks = (panels + grain - 1) / grain;
  const float below = bf16_logits ? 1.f / 64.f + 1e-6f : 1e-6f;  // the drop line under L, relative
  std::atomic<int64_t> next{0};
  std::mutex merge;
  std::vector<float> best_lower(m, -std::numeric_limits<float>::infinity());
  std::vector<Found> found;
  on_team(tasks, [&]() {
    // per row: this thread's lower ends so far, lane by lane, and the drop line they give (the
    // line is raised at each task's end: a lower line only keeps more columns for the final cut)
    std::vector<float> lanes(m * 16, -std::numeric_limits<float>::infinity());
    std::vector<float> line(m, -std::numeric_limits<float>::infinity());
    std::vector<Found> mine;
    alignas(64) int32_t sums[4][16][16];
    const __m512 v_half = _mm512_set1_ps(half), v_unit = _mm512_set1_ps(8.f * kUnit);
    const __m512 v_rel = _mm512_set1_ps(1.f + 1e-5f), v_abs = _mm512_set1_ps(1e-6f), v_tiny = _mm512_set1_ps(1e-30f);
    int configured = 0;
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t end = std::min(panels, (task + 1) * grain);
      for (int64_t p = task * grain; p < end; p += 2) {
        const bool pair = p + 1 < end;
        const int8_t* w0 = wp + p * panel_bytes;
        const int8_t* w1 = w0 + panel_bytes;
        for (int64_t block = 0; block < blocks; ++block) {
          const int64_t r0 = block * 16, nrows = std::min<int64_t>(16, m - r0);
          if (configured != nrows) {
            if (configured) _tile_release();
            configure_screen_tiles(static_cast<int>(nrows));
            configured = static_cast<int>(nrows);
          }
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t s = 0; s < kp / kScreenStep; ++s) {
            if (block == 0)
              for (int64_t at = 0; at < 1024; at += 64) {
                _mm_prefetch(reinterpret_cast<const char*>(w0 + s * 1024 + at) + kPrefetchBytes, _MM_HINT_T1);
                if (pair) _mm_prefetch(reinterpret_cast<const char*>(w1 + s * 1024 + at) + kPrefetchBytes, _MM_HINT_T1);
              }
            _tile_loadd(4, &q1[r0 * kp + s * kScreenStep], kp);
            _tile_loadd(5, &q2[r0 * kp + s * kScreenStep], kp);
            _tile_loadd(6, w0 + s * 1024, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 5, 6);
            if (pair) {
              _tile_loadd(7, w1 + s * 1024, 64);
              _tile_dpbssd(2, 4, 7);
              _tile_dpbssd(3, 5, 7);
            }
          }
          _tile_stored(0, sums[0], 64);
          _tile_stored(1, sums[1], 64);
          if (pair) {
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
          }
          for (int64_t j = 0; j < (pair ? 2 : 1); ++j) {
            const int64_t col = (p + j) * kPanel;
            const __mmask16 mask = panel_mask(col, n);
            const __m512 s_i = _mm512_maskz_loadu_ps(mask, sp + col);
            const __m512 l1_i = _mm512_maskz_loadu_ps(mask, lp + col);
            for (int64_t r = 0; r < nrows; ++r) {
              const ScreenRow& row = rows[r0 + r];
              const int64_t gr = r0 + r;
              const __m512 t1 = _mm512_mul_ps(_mm512_set1_ps(row.sh1), _mm512_cvtepi32_ps(_mm512_load_si512(sums[2 * j][r])));
              const __m512 t2 = _mm512_mul_ps(_mm512_set1_ps(row.sh2), _mm512_cvtepi32_ps(_mm512_load_si512(sums[2 * j + 1][r])));
              const __m512 approx = _mm512_mul_ps(s_i, _mm512_add_ps(t1, t2));
              // s_i (||h||_1 half + max|a| ||q_i||_1 + 8u (|t1| + |t2|)), then the relative margins
              __m512 err = _mm512_fmadd_ps(_mm512_set1_ps(row.norm1), v_half, _mm512_mul_ps(_mm512_set1_ps(row.rest), l1_i));
              err = _mm512_fmadd_ps(v_unit, _mm512_add_ps(_mm512_abs_ps(t1), _mm512_abs_ps(t2)), err);
              err = _mm512_mul_ps(_mm512_mul_ps(s_i, err), v_rel);
              err = _mm512_add_ps(_mm512_fmadd_ps(v_abs, _mm512_abs_ps(approx), err), v_tiny);
              keep_panel(_mm512_sub_ps(approx, err), _mm512_add_ps(approx, err), mask, line[gr],
                         static_cast<int32_t>(gr), col, &lanes[gr * 16], mine);
            }
          }
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        const float l = _mm512_reduce_max_ps(_mm512_loadu_ps(&lanes[r * 16]));
        line[r] = l - std::fabs(l) * below - 1e-30f;
      }
    }
    if (configured) _tile_release();
    std::lock_guard<std::mutex> hold(merge);
    for (int64_t r = 0; r < m; ++r)
      best_lower[r] = std::max(best_lower[r], _mm512_reduce_max_ps(_mm512_loadu_ps(&lanes[r * 16])));
    found.insert(found.end(), mine.begin(), mine.end());
  });
  return screened_columns(found, best_lower, bf16_logits, kScreenMaxCandidates, x);
}

#endif  // EPD_DECODE_SCREEN_TILES
#ifdef EPD_DECODE_SCREEN_VECTOR
// R rows' sums against one panel of the copy on vpdpbusd: sums[r][c] = sum_j (q_cj + 128) q1[r][j]
// for the panel's 16 columns. The weight is the unsigned operand (its bytes are q + 128, pack_i8's
// offset) and the rows the signed one, each row's 4 bytes of a k step broadcast from memory in
// the instruction; `rows` holds a block's rows interleaved, [Kp/4][16 rows][4]: one pointer and
// constant offsets. Each weight vector is prefetched `ahead` bytes on into L2 (a hint), as the
// few-row kernel's. The instruction is written out (GCC 12 copies every intrinsic's accumulator
// through another register, and spills, in a loop of 16).
template <int R>
void screen_block(const int8_t* rows, int64_t steps, const uint8_t* w, int64_t ahead, int32_t (*sums)[16]) {
  // sixteen named accumulators: GCC keeps an array of them in memory, not in registers
  __m512i a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15;
  a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = _mm512_setzero_si512();
#define EPD_SCREEN_ROW(i)                                                                              \
  if constexpr (R > i)                                                                                 \
    asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(a##i) : [w] "v"(wv), [x] "m"(x[i]));
  for (int64_t s = 0; s < steps; ++s) {
    _mm_prefetch(reinterpret_cast<const char*>(w + s * 64) + ahead, _MM_HINT_T1);
    const __m512i wv = _mm512_loadu_si512(w + s * 64);
    const int32_t* x = reinterpret_cast<const int32_t*>(rows + s * 64);
    EPD_SCREEN_ROW(0) EPD_SCREEN_ROW(1) EPD_SCREEN_ROW(2) EPD_SCREEN_ROW(3)
    EPD_SCREEN_ROW(4) EPD_SCREEN_ROW(5) EPD_SCREEN_ROW(6) EPD_SCREEN_ROW(7)
    EPD_SCREEN_ROW(8) EPD_SCREEN_ROW(9) EPD_SCREEN_ROW(10) EPD_SCREEN_ROW(11)
    EPD_SCREEN_ROW(12) EPD_SCREEN_ROW(13) EPD_SCREEN_ROW(14) EPD_SCREEN_ROW(15)
  }
#undef EPD_SCREEN_ROW
  const __m512i all[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
  for (int r = 0; r < R; ++r) _mm512_store_si512(sums[r], all[r]);
}

using ScreenBlockFn = void (*)(const int8_t*, int64_t, const uint8_t*, int64_t, int32_t (*)[16]);

template <int... Rs>
constexpr auto screen_table(std::integer_sequence<int, Rs...>) {
  return std::array<ScreenBlockFn, sizeof...(Rs)>{&screen_block<Rs + 1>...};
}

// The columns of the head that may hold the maximum of some row of x, on AVX-512 VNNI with one
// level of the rows, their outlier features apart, and the Cauchy-Schwarz bounds (the header):
// sorted, each once; empty when a row is not finite or more columns remain than are worth
// gathering (the caller then multiplies the whole head). `packed` comes from pack_i8 with its
// offset.
at::Tensor screen_vector(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& l1,
                         const at::Tensor& l2, const at::Tensor& rounding, int64_t n, bool bf16_logits) {
  check_screen_args(x, packed, scale, l1, n);
  TORCH_CHECK(l2.numel() == n && rounding.numel() == n && l2.scalar_type() == at::kFloat &&
                  rounding.scalar_type() == at::kFloat,
              "epd_decode.screen_vector: l2 and rounding must come from pack_i8");
  static constexpr auto table = screen_table(std::make_integer_sequence<int, 16>{});
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1) * 4, panels = packed.size(0), steps = kp / 4;
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));

  // the rows in one level, interleaved by blocks of 16 ([blocks][Kp/4][16][4]), and each row's
  // 128 sum_j q1_j (what the weight's offset adds to its sums)
  const int64_t blocks = (m + 15) / 16;
  std::vector<int8_t> q1(kp);
  std::vector<int8_t> interleaved(blocks * steps * 64, 0);
  std::vector<int32_t> offset(m);
  std::vector<ScreenRow> rows(m);
  for (int64_t r = 0; r < m; ++r) {
    rows[r] = x.scalar_type() == at::kBFloat16
                  ? quantize_row(x.data_ptr<c10::BFloat16>() + r * x.stride(0), k, kp, q1.data(), nullptr,
                                 kScreenOutliers)
                  : quantize_row(x.data_ptr<float>() + r * x.stride(0), k, kp, q1.data(), nullptr, kScreenOutliers);
    if (!rows[r].finite) return none;
    int32_t sum = 0;
    int8_t* dst = &interleaved[(r / 16) * steps * 64 + (r % 16) * 4];
    for (int64_t s = 0; s < steps; ++s) {
      std::memcpy(dst + s * 64, &q1[s * 4], 4);
      sum += q1[s * 4] + q1[s * 4 + 1] + q1[s * 4 + 2] + q1[s * 4 + 3];
    }
    offset[r] = 128 * sum;
  }
  const float gamma = static_cast<float>(k) * kUnit / (1.f - static_cast<float>(k) * kUnit);
  const float exact_sum = 127.001f * gamma;  // per s_i ||h||_1: the exact kernel's float32 sum
  const float half = 0.5f + 1e-4f;           // per s_i ||h||_1: the copy's rounding (and w / s_i's own)
  const float outlier_sum = 127.001f * (kScreenOutliers + 2) * kUnit;  // per s_i ||h_o||_1: o's float sum

  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  const float* sp = scale.data_ptr<float>();
  const float* l1p = l1.data_ptr<float>();
  const float* l2p = l2.data_ptr<float>();
  const float* bp = rounding.data_ptr<float>();
  const int64_t panel_bytes = kp * kPanel;
  const int64_t grain = std::max<int64_t>(4, (64 << 10) / panel_bytes);
  const int64_t tasks = (panels + grain - 1) / grain;
  const float below = bf16_logits ? 1.f / 64.f + 1e-6f : 1e-6f;  // the drop line under L, relative
  std::atomic<int64_t> next{0};
  std::mutex merge;
  std::vector<float> best_lower(m, -std::numeric_limits<float>::infinity());
  std::vector<Found> found;
  on_team(tasks, [&]() {
    std::vector<float> lanes(m * 16, -std::numeric_limits<float>::infinity());
    std::vector<float> line(m, -std::numeric_limits<float>::infinity());
    std::vector<Found> mine;
    alignas(64) int32_t acc[16][16];
    const __m512 v_half = _mm512_set1_ps(half), v_exact = _mm512_set1_ps(exact_sum), v_unit = _mm512_set1_ps(8.f * kUnit);
    const __m512 v_rel = _mm512_set1_ps(1.f + 1e-5f), v_abs = _mm512_set1_ps(1e-6f), v_tiny = _mm512_set1_ps(1e-30f);
    const __m512i v_128 = _mm512_set1_epi32(128);
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t end = std::min(panels, (task + 1) * grain);
      for (int64_t p = task * grain; p < end; ++p) {
        const uint8_t* w = wp + p * panel_bytes;
        const int64_t col = p * kPanel;
        const __mmask16 mask = panel_mask(col, n);
        const __m512 s_i = _mm512_maskz_loadu_ps(mask, sp + col);
        const __m512 l1_i = _mm512_maskz_loadu_ps(mask, l1p + col);
        const __m512 l2_i = _mm512_maskz_loadu_ps(mask, l2p + col);
        const __m512 b_i = _mm512_maskz_loadu_ps(mask, bp + col);
        for (int64_t r0 = 0; r0 < m; r0 += 16) {
          const int64_t nrows = std::min<int64_t>(16, m - r0);
          // the first block streams the panel in; later ones read it from L1/L2
          table[nrows - 1](&interleaved[(r0 / 16) * steps * 64], steps, w, r0 == 0 ? kPrefetchBytes : 0, acc);
          for (int64_t r = 0; r < nrows; ++r) {
            const ScreenRow& row = rows[r0 + r];
            const int64_t gr = r0 + r;
            const __m512i d1 = _mm512_sub_epi32(_mm512_load_si512(acc[r]), _mm512_set1_epi32(offset[gr]));  // q1 . q_i
            const __m512 t1 = _mm512_mul_ps(_mm512_set1_ps(row.sh1), _mm512_cvtepi32_ps(d1));
            // the features taken apart: h_j q_ij in float, q_ij from the panel's vector of k step
            // j / 4 (byte j % 4 of each column's 32-bit lane, less the offset), in L1 now
            __m512 o = _mm512_setzero_ps();
            for (int t = 0; t < row.outliers; ++t) {
              const int32_t j = row.at[t];
              const __m512i v = _mm512_loadu_si512(w + (j / 4) * 64);
              const __m512i byte = _mm512_srli_epi32(_mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * (j % 4))), 24);
              o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(byte, v_128)), _mm512_set1_ps(row.value[t]), o);
            }
            const __m512 approx = _mm512_mul_ps(s_i, _mm512_add_ps(t1, o));
            // |a . q_i| <= min(max|a| ||q_i||_1, ||a||_2 ||q_i||_2); |h . b_i| <= min(s_i ||h||_1 / 2, ||h||_2 ||b_i||_2)
            const __m512 rest = _mm512_min_ps(_mm512_mul_ps(_mm512_set1_ps(row.rest), l1_i),
                                              _mm512_mul_ps(_mm512_set1_ps(row.rest2), l2_i));
            const __m512 norm1 = _mm512_set1_ps(row.norm1);
            const __m512 rounding_i = _mm512_min_ps(_mm512_mul_ps(s_i, _mm512_mul_ps(norm1, v_half)),
                                                    _mm512_mul_ps(_mm512_set1_ps(row.norm2), b_i));
            // s_i (||h||_1 127 gamma + that + o's float sum + 8u (|t1| + |o|)) + that, then the
            // relative margins (o's sum: kScreenOutliers + 1 roundings of terms <= 127 |h_j|)
            __m512 err = _mm512_fmadd_ps(norm1, v_exact, _mm512_add_ps(rest, _mm512_set1_ps(row.outlier_norm1 * outlier_sum)));
            err = _mm512_fmadd_ps(v_unit, _mm512_add_ps(_mm512_abs_ps(t1), _mm512_abs_ps(o)), err);
            err = _mm512_mul_ps(_mm512_fmadd_ps(s_i, err, rounding_i), v_rel);
            err = _mm512_add_ps(_mm512_fmadd_ps(v_abs, _mm512_abs_ps(approx), err), v_tiny);
            keep_panel(_mm512_sub_ps(approx, err), _mm512_add_ps(approx, err), mask, line[gr],
                       static_cast<int32_t>(gr), col, &lanes[gr * 16], mine);
          }
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        const float l = _mm512_reduce_max_ps(_mm512_loadu_ps(&lanes[r * 16]));
        line[r] = l - std::fabs(l) * below - 1e-30f;
      }
    }
    std::lock_guard<std::mutex> hold(merge);
    for (int64_t r = 0; r < m; ++r)
      best_lower[r] = std::max(best_lower[r], _mm512_reduce_max_ps(_mm512_loadu_ps(&lanes[r * 16])));
    found.insert(found.end(), mine.begin(), mine.end());
  });
  // gathering more than an eighth of the head is not worth it beside the whole head's product
  return screened_columns(found, best_lower, bf16_logits, std::min<int64_t>(kScreenMaxGathered, n / 8), x);
}
#endif  // EPD_DECODE_SCREEN_VECTOR
