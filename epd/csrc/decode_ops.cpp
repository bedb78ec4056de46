// Decode's linear layers on a CPU: y = x W^T for the few rows of a decode step (M = 1..32),
// reading each weight once for all M rows.
//
// Why: a decode step's GEMMs have M = batch rows against weights of up to 248,320 x 1,024; their
// cost is streaming the weight from memory (1.5 GB a step for qwen3.5-0.8b in bfloat16), and
// every row must reuse each weight vector while it sits in a register. The weight is laid out
// once at load (``pack``) in panels of 16 output columns: bfloat16 [N/16][K/2][16][2] (each
// 64-byte vector holds 16 columns x one pair of k, the operand order of AVX-512 BF16's
// vdpbf16ps), float32 [N/16][K][16]. The kernel walks P panels at a time with R rows' float32
// accumulators in registers (R x P <= 16): per k pair, P weight vectors are loaded and each row's
// x pair is broadcast into R x P dot-product instructions. The threads claim tasks of a few
// panels from a shared counter (robust to a thread losing its core); rows beyond 8 are taken 8
// at a time over the same panels (from L1/L2), and for up to 32 rows those later passes
// prefetch the next panels into L2 while they compute (a 16-row step's linear layers of the
// 0.8b: 44.3 -> 41.2 ms on two cores, python -m bench.decode_linears --rows 16; docs/BENCHMARKS.md).
//
// Rounding: float32 sums of exact bf16 x bf16 products (vdpbf16ps), rounded to bfloat16 once at
// the end (nearest even), as oneDNN's bf16 GEMM does; only the order of the float32 sums differs
// from oneDNN or ATen. The float32 path is fused multiply-adds, k ascending per column.
//
// On a CPU with AMX the AVX-512 build also multiplies bfloat16 products of 5 rows or more on the
// tiles (EPD_DECODE_AMX below): the panels are already the tiles' B layout.
//
// Two instruction sets, chosen at build time (the build is -march=native, one per CPU): AVX-512
// with BF16 (above), or AVX2 + FMA on CPUs without them (AMD Zen 2/3, Intel before Cooper Lake).
// AVX2 has no bfloat16 arithmetic, and there ATen's and oneDNN's bfloat16 products fall back to
// slow paths (10-15 GFLOP/s on two Zen 3 cores, against ~165 for float32); this kernel
// widens the bfloat16 weights to float32 in registers instead (a pair lane's low half is k even,
// its high half k odd: one shift and one mask), so a step still streams bfloat16 bytes, and sums
// with float32 FMAs (products of bfloat16 values are exact in float32: the same sums as the
// AVX-512 path in another order). Products of more than kFewRows rows (prefill chunks, the vision
// tower) widen the weight a block of panels at a time and multiply with ATen's float32 GEMM.
//
// Registered as torch.ops.epd_decode.{pack, linear, linear_wide, ...} (TORCH_LIBRARY, no
// pybind11). Built at first use by epd/kernels.py through epd.fused.compile_library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/mm.h>

#include "elementwise.h"

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EPD_DECODE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define EPD_DECODE_AVX2 1
#else
#error "epd_decode needs AVX2 and FMA, or AVX-512 with BF16"
#endif

#if defined(EPD_DECODE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define EPD_DECODE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <type_traits>
#include <utility>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace {

#ifdef EPD_DECODE_AVX512
constexpr int64_t kPanel = 16;  // output columns per panel (one zmm of float32 sums)
#else
constexpr int64_t kPanel = 16;  // AVX2: two ymm of float32 sums
#endif
constexpr int64_t kMaxRows = 8;  // rows per block (more are taken in blocks)
// Each panel's stream is prefetched 3 KiB ahead into L2: a decode step's products wait on memory,
// and 1 KiB ahead into L1 (the kernel's first version) was too short a lead for this memory's
// latency; 3 KiB into L2 made the 0.8b's linear layers of a batch-8 step ~20% faster on two
// threads (docs/BENCHMARKS.md, "The few-row kernel's prefetch").
constexpr int64_t kPrefetchBytes = 3072;

// `run` once on each of min(tasks, torch's threads) threads of the team, where each claims tasks
// from a counter of its own until none is left; on this thread alone when one suffices or when
// called inside a parallel region already.
template <typename F>
void on_team(int64_t tasks, F&& run) {
  const int64_t workers = std::min<int64_t>(tasks, at::get_num_threads());
  if (workers <= 1 || at::in_parallel_region()) {
    run();
    return;
  }
  // one claimant per thread of the team (at::parallel_for over [0, workers) hands each one index)
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { run(); });
}

#ifdef EPD_DECODE_AVX512
// ---- element traits: how one k step of a panel is loaded and accumulated

struct BF16 {
  using T = c10::BFloat16;
  using O = c10::BFloat16;  // the output's element
  static constexpr int64_t kStep = 2;  // k values per vector lane (a pair)
  static inline __m512 madd(__m512 acc, __m512i w, const T* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
  }
  static inline void store(T* out, __m512 acc, __mmask16 mask) {
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(acc);
    _mm256_mask_storeu_epi16(out, mask, bits);
  }
};

struct F32 {
  using T = float;
  using O = float;
  static constexpr int64_t kStep = 1;
  static inline __m512 madd(__m512 acc, __m512i w, const T* x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_set1_ps(*x), acc);
  }
  static inline void store(T* out, __m512 acc, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, acc); }
};

// bfloat16 inputs, float32 outputs holding the bfloat16-rounded values: what the bfloat16 product
// followed by .float() gives, in one pass (the LM head's logits, which sampling reads in float32)
struct BF16ToF32 : BF16 {
  using O = float;
  static inline void store(float* out, __m512 acc, __mmask16 mask) {
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(acc);
    _mm512_mask_storeu_ps(out, mask, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
};

// R rows x P panels of output, starting at panel `panel`: acc[r][p] += sum_k x[r][k] W[col][k].
// `w` points at the first panel; a panel is `panel_stride` elements (K_padded * 16). Each weight
// vector's line `ahead` bytes on is prefetched into L2 (a hint: past the weight's end it is
// dropped, never a fault).
template <typename E, int R, int P>
inline void block(const typename E::T* x, int64_t ldx, const typename E::T* w, int64_t panel_stride,
                  int64_t steps, const float* bias, typename E::O* out, int64_t ldo, int64_t col0, int64_t n,
                  int64_t ahead) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  constexpr int64_t kVec = 16 * E::kStep;  // elements per weight vector
  for (int64_t s = 0; s < steps; ++s) {
    __m512i wv[P];
    for (int p = 0; p < P; ++p) {
      const typename E::T* src = w + p * panel_stride + s * kVec;
      _mm_prefetch(reinterpret_cast<const char*>(src) + ahead, _MM_HINT_T1);
      wv[p] = _mm512_loadu_si512(src);
    }
    for (int r = 0; r < R; ++r) {
      const typename E::T* xr = x + r * ldx + s * E::kStep;
      for (int p = 0; p < P; ++p) acc[r][p] = E::madd(acc[r][p], wv[p], xr);
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t col = col0 + p * kPanel;
    const int64_t valid = std::min<int64_t>(kPanel, n - col);
    const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) E::store(out + r * ldo + col, _mm512_add_ps(acc[r][p], b), mask);
  }
}

// R rows x P panels per block: R x P float32 accumulators, at most 16 of the 32 zmm registers.
// Rows are taken 8 at a time (kMaxRows); a call of up to 4 rows walks 4 panels at once, more rows 2.
template <typename E>
using BlockFn = void (*)(const typename E::T*, int64_t, const typename E::T*, int64_t, int64_t, const float*,
                         typename E::O*, int64_t, int64_t, int64_t, int64_t);

template <typename E, int P, int... Rs>
constexpr auto row_table(std::integer_sequence<int, Rs...>) {
  return std::array<BlockFn<E>, sizeof...(Rs)>{&block<E, Rs + 1, P>...};
}

template <typename E>
void linear_impl(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n, at::Tensor& out) {
  using T = typename E::T;
  static constexpr auto by4 = row_table<E, 4>(std::make_integer_sequence<int, 4>{});
  static constexpr auto by2 = row_table<E, 2>(std::make_integer_sequence<int, kMaxRows>{});
  static constexpr auto by1 = row_table<E, 1>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t m = x.size(0), panels = packed.size(0), steps = packed.size(1);
  const int64_t panel_stride = steps * 16 * E::kStep;
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  typename E::O* op = out.data_ptr<typename E::O>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const int P = m <= 4 ? 4 : 2;
  const BlockFn<E>* wide = P == 4 ? by4.data() : by2.data();
  // at least ~64 KiB of weight per task: each task is one long sequential stream
  const int64_t panel_bytes = panel_stride * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(P, (64 << 10) / panel_bytes);
  // Tasks of `grain` panels, claimed one at a time from a shared counter rather than split up
  // front: on cores shared with other processes a thread that loses its core for a while holds
  // up only the task it is in, and the others take the rest (a static split makes the whole
  // product wait at its end for the slowest thread's share).
  const int64_t tasks = (panels + grain - 1) / grain;
  std::atomic<int64_t> next{0};
  // Two to four blocks of rows over each panel group (a decode step's 9-32 rows): the later
  // passes prefetch the next group. Not for more rows (prefill chunks): there the rows' own
  // stream through L2 (4 MiB for 2,048 rows of 1,024) evicts the prefetched group before its
  // turn, and a 2,048-row forward measured no faster with it (6.4-7.5 s against 6.3-6.9)
  const bool passes = m > kMaxRows && m <= 4 * kMaxRows;
  auto run = [&]() {
    int64_t task = next.fetch_add(1, std::memory_order_relaxed);
    while (task < tasks) {
      const int64_t begin = task * grain, end = std::min(panels, begin + grain);
      int64_t following = tasks;  // the task after this one, claimed at its last group
      // P panels at a time (single panels at a task's odd end), every block of rows over them
      // while they are in L1/L2: the weight is read from memory once whatever the number of rows.
      // The first block's pass streams the group in (prefetching kPrefetchBytes ahead); the
      // later blocks' passes run from L2 and prefetch the next group meanwhile (the next of this
      // task, or the first of the task claimed for after it), so memory keeps streaming while
      // they compute
      for (int64_t p = begin; p < end;) {
        const int64_t width = p + P <= end ? P : 1;
        int64_t ahead = kPrefetchBytes;
        if (passes) {
          int64_t upcoming = p + width;
          if (upcoming >= end) {
            following = next.fetch_add(1, std::memory_order_relaxed);
            upcoming = following < tasks ? following * grain : -1;
          }
          if (upcoming >= 0) ahead = (upcoming - p) * panel_bytes;
        }
        const BlockFn<E>* table = width == P ? wide : by1.data();
        for (int64_t r0 = 0; r0 < m; r0 += kMaxRows)
          table[std::min<int64_t>(kMaxRows, m - r0) - 1](xp + r0 * ldx, ldx, wp + p * panel_stride, panel_stride,
                                                        steps, bias, op + r0 * ldo, ldo, p * kPanel, n,
                                                        r0 == 0 ? kPrefetchBytes : ahead);
        p += width;
      }
      task = passes ? following : next.fetch_add(1, std::memory_order_relaxed);
    }
  };
  on_team(tasks, run);
}

#ifdef EPD_DECODE_AMX
// ---- AMX tiles (Intel Sapphire Rapids and later; the build is -march=native): bfloat16 products
// of 5 rows or more. A panel's bfloat16 layout [K/2][16][2] is a tile's B operand as it is: 16
// pairs of k for the panel's 16 columns are one 1 KiB tile, 64 bytes a row. TDPBF16PS sums
// bf16 x bf16 products in float32 like vdpbf16ps (results differ from the register path only by the
// order of the sums). Why: the register path's vdpbf16ps work caps it at ~200 GFLOP/s on two cores,
// below the memory's rate from 8 rows up and 13x below oneDNN's tiles at a 2,048-row prefill chunk;
// the tiles keep a decode step's 5-32 rows at the memory's rate and bring prefill chunks near
// oneDNN while the threads keep claiming tasks from a counter (docs/BENCHMARKS.md, "A CPU with
// AMX"). 1-4 rows stay on the register path, which already streams at the memory's rate.
constexpr int64_t kAmxMinRows = 5;
// rows of x a wide task reads: 1 MiB of them (L2), 512 rows of a 1,024-wide x, 128 of a 3,584-wide
// one (at 512 rows those were 3.5 MiB, read again from L3 for each pair of panels)
constexpr int64_t kAmxChunkBytes = 1 << 20;
constexpr int64_t kAmxGroupPanels = 8;  // panels a wide task multiplies them by

// Linux grants a process the tiles' state on request (5.16+); once per process. EPD_DECODE_AMX=0
// turns the paths off (the register path runs every row count, as on a CPU without AMX).
bool amx_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("EPD_DECODE_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return on;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 hold float32 sums, 4-5 rows of x, 6-7 the weight; sums and x tiles have `rows` rows.
inline void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12 does not count ldtilecfg as reading the struct and drops the stores above (the CPU then
  // faults on the half-written configuration): the barrier keeps them
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// `rows` rows of one tile's sums (16 columns of panel starting at `col`) plus the bias, stored.
template <typename E>
inline void store_sums(const float (*sums)[16], int64_t rows, const float* bias, typename E::O* out, int64_t ldo,
                       int64_t col, int64_t n) {
  const int64_t valid = std::min<int64_t>(kPanel, n - col);
  const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) E::store(out + r * ldo + col, _mm512_add_ps(_mm512_load_ps(sums[r]), b), mask);
}

// One claimant per thread of the team runs `run` (tiles configured for `rows`, released after).
template <typename F>
void on_team_with_tiles(int64_t tasks, int rows, F&& run) {
  on_team(tasks, [&]() {
    configure_tiles(rows);
    run();
    _tile_release();  // a thread holding tile state makes each of its context switches save 8 KiB
  });
}

// 5-16 rows: one x tile, four panels at a time (sums in tiles 0-3, the weight through tiles 6 and
// 7 in turn), tasks of >= 64 KiB of weight claimed from a counter as the register path's, each
// weight line prefetched kPrefetchBytes ahead into L2.
template <typename E>
void linear_amx_few(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n, at::Tensor& out) {
  using T = typename E::T;
  const int64_t m = x.size(0), panels = packed.size(0), k = packed.size(1) * 2;
  const int64_t panel_stride = k * kPanel, panel_bytes = panel_stride * static_cast<int64_t>(sizeof(T));
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  typename E::O* op = out.data_ptr<typename E::O>();
  const int64_t ldx_bytes = x.stride(0) * static_cast<int64_t>(sizeof(T)), ldo = out.stride(0);
  const int64_t grain = std::max<int64_t>(4, (64 << 10) / panel_bytes);
  const int64_t tasks = (panels + grain - 1) / grain;
  std::atomic<int64_t> next{0};
  on_team_with_tiles(tasks, static_cast<int>(m), [&]() {
    alignas(64) float sums[4][16][16];
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t end = std::min(panels, (task + 1) * grain);
      for (int64_t p = task * grain; p < end; p += 4) {
        const int64_t width = std::min<int64_t>(4, end - p);
        const T* w = wp + p * panel_stride;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < k / 32; ++s) {
          const T* b = w + s * 512;  // this k step's tile of each panel: 16 pairs x 16 columns
          for (int64_t j = 0; j < width; ++j)
            for (int64_t line = 0; line < 16; ++line)
              _mm_prefetch(reinterpret_cast<const char*>(b + j * panel_stride + line * 32) + kPrefetchBytes,
                           _MM_HINT_T1);
          _tile_loadd(4, xp + s * 32, ldx_bytes);
          _tile_loadd(6, b, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (width > 1) {
            _tile_loadd(7, b + panel_stride, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (width > 2) {
            _tile_loadd(6, b + 2 * panel_stride, 64);
            _tile_dpbf16ps(2, 4, 6);
          }
          if (width > 3) {
            _tile_loadd(7, b + 3 * panel_stride, 64);
            _tile_dpbf16ps(3, 4, 7);
          }
        }
        _tile_stored(0, sums[0], 64);
        if (width > 1) _tile_stored(1, sums[1], 64);
        if (width > 2) _tile_stored(2, sums[2], 64);
        if (width > 3) _tile_stored(3, sums[3], 64);
        for (int64_t j = 0; j < width; ++j) store_sums<E>(sums[j], m, bias, op, ldo, (p + j) * kPanel, n);
      }
    }
  });
}

// 17 rows or more (prefill chunks): tasks of (kAmxChunkBytes of rows, kAmxGroupPanels panels),
// row-chunk-major, each 32 rows x 2 panels at a time (2 x tiles, 2 weight tiles, 4 sums). A last
// block of fewer than 32 rows reads them from a zero-padded copy (tile loads read whole rows).
template <typename E>
void linear_amx_wide(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n, at::Tensor& out) {
  using T = typename E::T;
  const int64_t m = x.size(0), panels = packed.size(0), k = packed.size(1) * 2;
  const int64_t panel_stride = k * kPanel;
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  typename E::O* op = out.data_ptr<typename E::O>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const int64_t full = m / 32 * 32;
  std::vector<T> tail;  // the last m - full rows, zero-padded to 32
  if (full < m) {
    tail.assign(32 * k, T(0.f));
    for (int64_t r = full; r < m; ++r) std::memcpy(tail.data() + (r - full) * k, xp + r * ldx, k * sizeof(T));
  }
  const int64_t blocks = (m + 31) / 32;
  const int64_t chunk_blocks = std::max<int64_t>(1, kAmxChunkBytes / (32 * k * static_cast<int64_t>(sizeof(T))));
  const int64_t chunks = (blocks + chunk_blocks - 1) / chunk_blocks;
  const int64_t groups = (panels + kAmxGroupPanels - 1) / kAmxGroupPanels;
  const int64_t tasks = chunks * groups;
  std::atomic<int64_t> next{0};
  on_team_with_tiles(tasks, 16, [&]() {
    alignas(64) float sums[4][16][16];
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t chunk = task / groups, group = task % groups;
      const int64_t block_end = std::min(blocks, (chunk + 1) * chunk_blocks);
      const int64_t panel_end = std::min(panels, (group + 1) * kAmxGroupPanels);
      for (int64_t p = group * kAmxGroupPanels; p < panel_end; p += 2) {
        const bool pair = p + 1 < panel_end;
        const T* w0 = wp + p * panel_stride;
        const T* w1 = w0 + panel_stride;
        for (int64_t block = chunk * chunk_blocks; block < block_end; ++block) {
          const int64_t r0 = block * 32;
          const bool padded = r0 >= full;
          const T* a0 = padded ? tail.data() : xp + r0 * ldx;
          const int64_t lda_bytes = (padded ? k : ldx) * static_cast<int64_t>(sizeof(T));
          const T* a1 = a0 + 16 * (padded ? k : ldx);
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          // each tile is loaded just before its first product, so the next step's first loads
          // overlap this step's last products (a tile is read by its products in flight)
          for (int64_t s = 0; s < k / 32; ++s) {
            _tile_loadd(4, a0 + s * 32, lda_bytes);
            _tile_loadd(6, w0 + s * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (pair) {
              _tile_loadd(7, w1 + s * 512, 64);
              _tile_dpbf16ps(1, 4, 7);
            }
            _tile_loadd(5, a1 + s * 32, lda_bytes);
            _tile_dpbf16ps(2, 5, 6);
            if (pair) _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, sums[0], 64);
          _tile_stored(2, sums[2], 64);
          if (pair) {
            _tile_stored(1, sums[1], 64);
            _tile_stored(3, sums[3], 64);
          }
          const int64_t rows = std::min<int64_t>(32, m - r0);
          for (int64_t j = 0; j < (pair ? 2 : 1); ++j) {
            const int64_t col = (p + j) * kPanel;
            store_sums<E>(sums[j], std::min<int64_t>(16, rows), bias, op + r0 * ldo, ldo, col, n);
            if (rows > 16) store_sums<E>(sums[2 + j], rows - 16, bias, op + (r0 + 16) * ldo, ldo, col, n);
          }
        }
      }
    }
  });
}

// Whether the tiles take this bfloat16 product: enough rows, whole 32-wide k steps, tiles granted.
inline bool amx_takes(const at::Tensor& x, const at::Tensor& packed) {
  return x.size(0) >= kAmxMinRows && packed.size(1) % 16 == 0 && amx_enabled();
}

#endif  // EPD_DECODE_AMX

#include "greedy_screen.h"

// A bfloat16 product: on the tiles where they take it, otherwise on the registers.
template <typename E>
void linear_bf16(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n, at::Tensor& out) {
#ifdef EPD_DECODE_AMX
  if (amx_takes(x, packed)) {
    if (x.size(0) <= 16)
      linear_amx_few<E>(x, packed, bias, n, out);
    else
      linear_amx_wide<E>(x, packed, bias, n, out);
    return;
  }
#endif
  linear_impl<E>(x, packed, bias, n, out);
}

#endif  // EPD_DECODE_AVX512

#ifdef EPD_DECODE_AVX2
// ---- AVX2 + FMA: the same packed layout, the weights widened to float32 in registers. A block is
// up to 4 rows over one panel (8 float32 accumulators, 4 widened weight vectors, 2 broadcasts of
// the 16 registers); more rows take more blocks over the panel while it is in L1/L2. (Tried: 8
// rows over 8-column panels in one pass, and later blocks prefetching the next panel; neither
// was faster on a batch-8 step of the 0.8b, docs/BENCHMARKS.md.)

constexpr int64_t kRowsAvx2 = 4;

inline void widen_pairs(__m256i v, __m256& even, __m256& odd) {
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// R float32 rows x (ldx apart) times one panel (16 columns, k inputs): sums[r][0..15]. With one or
// two rows each output vector keeps two accumulators (even and odd k), so that FMA latency does
// not bound the few rows' step.
template <bool kBf16, int R>
inline void panel_block(const float* x, int64_t ldx, const void* panel, int64_t k, float (*sums)[kPanel]) {
  constexpr int S = R <= 2 ? 2 : 1;
  __m256 acc[R][2][S];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      for (int a = 0; a < S; ++a) acc[r][h][a] = _mm256_setzero_ps();
  if constexpr (kBf16) {
    const uint16_t* w = static_cast<const uint16_t*>(panel);
    for (int64_t s = 0; s < k / 2; ++s) {
      const uint16_t* src = w + s * 2 * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T1);
      __m256 e0, o0, e1, o1;
      widen_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), e0, o0);
      widen_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kPanel)), e1, o1);
      for (int r = 0; r < R; ++r) {
        const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * s);
        const __m256 xo = _mm256_broadcast_ss(x + r * ldx + 2 * s + 1);
        acc[r][0][0] = _mm256_fmadd_ps(e0, xe, acc[r][0][0]);
        acc[r][1][0] = _mm256_fmadd_ps(e1, xe, acc[r][1][0]);
        acc[r][0][S - 1] = _mm256_fmadd_ps(o0, xo, acc[r][0][S - 1]);
        acc[r][1][S - 1] = _mm256_fmadd_ps(o1, xo, acc[r][1][S - 1]);
      }
    }
  } else {
    const float* w = static_cast<const float*>(panel);
    int64_t kk = 0;
    for (; kk + 2 <= k; kk += 2) {
      const float* src = w + kk * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes + 64, _MM_HINT_T1);
      const __m256 a0 = _mm256_loadu_ps(src), a1 = _mm256_loadu_ps(src + 8);
      const __m256 b0 = _mm256_loadu_ps(src + kPanel), b1 = _mm256_loadu_ps(src + kPanel + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xa = _mm256_broadcast_ss(x + r * ldx + kk), xb = _mm256_broadcast_ss(x + r * ldx + kk + 1);
        acc[r][0][0] = _mm256_fmadd_ps(a0, xa, acc[r][0][0]);
        acc[r][1][0] = _mm256_fmadd_ps(a1, xa, acc[r][1][0]);
        acc[r][0][S - 1] = _mm256_fmadd_ps(b0, xb, acc[r][0][S - 1]);
        acc[r][1][S - 1] = _mm256_fmadd_ps(b1, xb, acc[r][1][S - 1]);
      }
    }
    for (; kk < k; ++kk) {
      const __m256 a0 = _mm256_loadu_ps(w + kk * kPanel), a1 = _mm256_loadu_ps(w + kk * kPanel + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xa = _mm256_broadcast_ss(x + r * ldx + kk);
        acc[r][0][0] = _mm256_fmadd_ps(a0, xa, acc[r][0][0]);
        acc[r][1][0] = _mm256_fmadd_ps(a1, xa, acc[r][1][0]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(sums[r] + 8 * h, S == 2 ? _mm256_add_ps(acc[r][h][0], acc[r][h][S - 1]) : acc[r][h][0]);
}

template <bool kBf16>
using PanelFn = void (*)(const float*, int64_t, const void*, int64_t, float (*)[kPanel]);

template <typename T>
void linear_avx2(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n, at::Tensor& out) {
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  static constexpr PanelFn<kBf16> blocks[kRowsAvx2] = {&panel_block<kBf16, 1>, &panel_block<kBf16, 2>,
                                                       &panel_block<kBf16, 3>, &panel_block<kBf16, 4>};
  // x's rows as contiguous float32, widened once (a view when they already are float32)
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  const int64_t panel_elems = packed.size(1) * packed.size(2);
  const float* xp = xf.data_ptr<float>();
  const int64_t ldx = xf.stride(0), ldo = out.stride(0);
  const T* wp = packed.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (panel_elems * static_cast<int64_t>(sizeof(T))));
  const int64_t tasks = (panels + grain - 1) / grain;
  std::atomic<int64_t> next{0};  // tasks claimed from a shared counter, as the AVX-512 path's
  auto run = [&]() {
    float sums[kRowsAvx2][kPanel];
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t end = std::min(panels, (task + 1) * grain);
      for (int64_t p = task * grain; p < end; ++p) {
        const int64_t col = p * kPanel, valid = std::min<int64_t>(kPanel, n - col);
        for (int64_t r0 = 0; r0 < m; r0 += kRowsAvx2) {  // every row block over the panel while it is in L1/L2
          const int64_t rows = std::min<int64_t>(kRowsAvx2, m - r0);
          blocks[rows - 1](xp + r0 * ldx, ldx, wp + p * panel_elems, k, sums);
          for (int64_t r = 0; r < rows; ++r) {
            T* o = op + (r0 + r) * ldo + col;
            for (int64_t c = 0; c < valid; ++c) o[c] = static_cast<T>(sums[r][c] + (bias ? bias[col + c] : 0.f));
          }
        }
      }
    }
  };
  on_team(tasks, run);
}
#endif  // EPD_DECODE_AVX2

// ---- many rows (prefill chunks, the vision tower): the weight widened to float32 a block of
// panels at a time ([K, 16 x panels], a few MiB: it stays in cache for the product) and
// multiplied by ATen's float32 GEMM, then rounded to x's dtype once. Any instruction set.

// panels [p0, p1) of a packed weight -> float32 dst [k, (p1 - p0) * 16] (row-major)
template <typename T>
void widen_panels(const T* packed, int64_t panel_elems, int64_t k, int64_t p0, int64_t p1, float* dst) {
  const int64_t width = (p1 - p0) * kPanel;
  constexpr int64_t step = std::is_same_v<T, c10::BFloat16> ? 2 : 1;
  at::parallel_for(0, k / step, 64, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t p = p0; p < p1; ++p) {
        const T* src = packed + p * panel_elems + s * kPanel * step;
        float* row = dst + s * step * width + (p - p0) * kPanel;
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t lane = 0; lane < step; ++lane) row[lane * width + c] = static_cast<float>(src[c * step + lane]);
      }
  });
}

template <typename T>
void linear_wide_impl(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n, at::Tensor& out) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t k = x.size(1), panels = packed.size(0), panel_elems = packed.size(1) * packed.size(2);
  const int64_t block = std::max<int64_t>(1, (4 << 20) / (k * kPanel * static_cast<int64_t>(sizeof(float))));
  at::Tensor buffer = at::empty({k * std::min(block, panels) * kPanel}, x.options().dtype(at::kFloat));
  for (int64_t p0 = 0; p0 < panels; p0 += block) {
    const int64_t p1 = std::min(panels, p0 + block), col = p0 * kPanel;
    const int64_t valid = std::min<int64_t>((p1 - p0) * kPanel, n - col);
    at::Tensor w = buffer.narrow(0, 0, k * (p1 - p0) * kPanel).view({k, (p1 - p0) * kPanel});
    widen_panels<T>(packed.data_ptr<T>(), panel_elems, k, p0, p1, w.data_ptr<float>());
    at::Tensor part = at::mm(xf, w).narrow(1, 0, valid);
    if (bias.has_value()) part.add_(bias->narrow(0, col, valid));
    out.narrow(1, col, valid).copy_(part);
  }
}

// W [N, K] -> panels: bfloat16 [ceil(N/16), ceil(K/2), 32], float32 [ceil(N/16), K, 16]; padding zero.
// With `rows` (int64 [R]), W's rows `rows` in that order, as pack(W[rows]) without the copy (the
// greedy screen's gather of the columns it leaves).
at::Tensor pack(const at::Tensor& weight, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "epd_decode.pack: a 2-D CPU weight");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "epd_decode.pack: bfloat16 or float32, got ", dtype);
  const int64_t k = weight.size(1), step = dtype == at::kBFloat16 ? 2 : 1;
  const int64_t* index = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous(),
                "epd_decode.pack: rows must be a contiguous int64 vector");
    index = rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < rows->numel(); ++i)
      TORCH_CHECK(index[i] >= 0 && index[i] < weight.size(0), "epd_decode.pack: row ", index[i], " out of range");
  }
  const int64_t n = index ? rows->numel() : weight.size(0);
  const int64_t panels = (n + kPanel - 1) / kPanel, steps = (k + step - 1) / step;
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({panels, steps, kPanel * step}, weight.options());
  const int64_t elem = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  // a step's elements are 4 bytes either way (a bfloat16 pair, one float32), moved as one; an odd
  // bfloat16 width's last pair holds one element
  const int64_t whole = k / step;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t width = std::min<int64_t>(kPanel, n - p * kPanel);
      const char* from[kPanel];
      for (int64_t c = 0; c < width; ++c) {
        const int64_t i = p * kPanel + c;
        from[c] = src + (index ? index[i] : i) * k * elem;
      }
      char* out = dst + p * steps * kPanel * 4;
      // a cache line of each row at a time (16 steps), the line after next prefetched: the rows
      // stream side by side and each line of the panel is written whole (a gather's rows are cold)
      for (int64_t s0 = 0; s0 < whole; s0 += 16) {
        const int64_t s1 = std::min<int64_t>(whole, s0 + 16);
        for (int64_t c = 0; c < width; ++c) {
          _mm_prefetch(from[c] + (s0 + 32) * 4, _MM_HINT_T0);
          for (int64_t s = s0; s < s1; ++s) std::memcpy(out + (s * kPanel + c) * 4, from[c] + s * 4, 4);
        }
      }
      if (whole < steps)
        for (int64_t c = 0; c < width; ++c) std::memcpy(out + (whole * kPanel + c) * 4, from[c] + whole * 4, elem);
    }
  });
  return packed;
}

// The checks every product of a packed weight makes; the bias as a pointer (or null).
const float* check_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "epd_decode.linear: bfloat16 or float32, got ", dtype);
  TORCH_CHECK(packed.scalar_type() == dtype && packed.dim() == 3 && packed.is_contiguous(),
              "epd_decode.linear: the packed weight must be a contiguous [panels, steps, lanes] tensor of ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.stride(1) == 1, "epd_decode.linear: x must be 2-D, rows contiguous");
  const int64_t step = dtype == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(x.size(1) == packed.size(1) * step, "epd_decode.linear: x has ", x.size(1), " features, the weight ",
              packed.size(1) * step, " (odd bfloat16 widths are not packed)");
  TORCH_CHECK(n > (packed.size(0) - 1) * kPanel && n <= packed.size(0) * kPanel, "epd_decode.linear: bad n");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              "epd_decode.linear: bias must be contiguous float32 [n]");
  return bias->data_ptr<float>();
}

// x [M, K] times the packed W [N, K] through the float32 GEMM (``linear`` for many rows on AVX2;
// an op of its own so that tests and benchmarks reach it at any M).
at::Tensor linear_wide(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  check_linear(x, packed, n, bias);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kBFloat16)
    linear_wide_impl<c10::BFloat16>(x, packed, bias, n, out);
  else
    linear_wide_impl<float>(x, packed, bias, n, out);
  return out;
}

#ifdef EPD_DECODE_AVX2
// Rows above which AVX2's ``linear`` widens the weight for the float32 GEMM rather than running
// the register kernel (docs/BENCHMARKS.md, "bfloat16 on a CPU without AVX-512").
constexpr int64_t kFewRows = 48;
#endif

// x [M, K] (rows of any stride, each contiguous) times the packed W [N, K] -> [M, N] in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  const float* b = check_linear(x, packed, n, bias);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
#ifdef EPD_DECODE_AVX512
  if (bf16)
    linear_bf16<BF16>(x, packed, b, n, out);
  else
    linear_impl<F32>(x, packed, b, n, out);
#else
  if (x.size(0) > kFewRows) {
    if (bf16)
      linear_wide_impl<c10::BFloat16>(x, packed, bias, n, out);
    else
      linear_wide_impl<float>(x, packed, bias, n, out);
  } else if (bf16) {
    linear_avx2<c10::BFloat16>(x, packed, b, n, out);
  } else {
    linear_avx2<float>(x, packed, b, n, out);
  }
#endif
  return out;
}

// x [M, K] (bfloat16 or float32) -> float32 [M, n]: linear()'s values (in bfloat16, rounded to it
// as the bfloat16 product rounds) as float32, written in one pass where the product and a
// .float() copy would write and read the output twice (the LM head: 16 x 248,320 logits a step)
at::Tensor linear_float(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
#ifdef EPD_DECODE_AVX512
  if (x.scalar_type() == at::kBFloat16) {
    const float* b = check_linear(x, packed, n, bias);
    at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
    if (x.size(0) > 0) linear_bf16<BF16ToF32>(x, packed, b, n, out);
    return out;
  }
#endif
  return linear(x, packed, n, bias).to(at::kFloat);
}

// ---- the decoder layers' RMSNorm with the residual add before it (Qwen3.5's: float32 math,
// weight applied as (1 + w), rounded to the model dtype once at the end)

using epd_vec::round_to;
using epd_vec::to_float;

// residual <- residual + x (rounded to T, as torch's add in T), out <- norm(residual) * (1 + w).
// With x empty only the norm of residual (which is left as it is).
template <typename T>
void add_rms_norm_impl(const T* x, int64_t ldx, T* residual, int64_t ldr, const T* weight, float eps, T* out,
                       int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * ldr;
      float* s = sum.data();
      float squares = 0.f;
      int64_t i = 0;
#ifdef __AVX512F__
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= dim; i += 16) {
        __m512 v = epd_vec::vload(res + i);
        if (x) {
          v = _mm512_add_ps(v, epd_vec::vload(x + r * ldx + i));
          if constexpr (!std::is_same_v<T, float>) v = epd_vec::vround_bf16(v);
          epd_vec::vstore(res + i, v);
        }
        _mm512_storeu_ps(s + i, v);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      squares = _mm512_reduce_add_ps(acc);
#endif
      for (; i < dim; ++i) {
        if (x) res[i] = static_cast<T>(to_float(res[i]) + to_float(x[r * ldx + i]));
        s[i] = to_float(res[i]);
        squares += s[i] * s[i];
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      i = 0;
#ifdef __AVX512F__
      const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
      for (; i + 16 <= dim; i += 16)
        epd_vec::vstore(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(s + i), vinv),
                                             _mm512_add_ps(one, epd_vec::vload(weight + i))));
#endif
      for (; i < dim; ++i) o[i] = static_cast<T>(s[i] * inv * (1.f + to_float(weight[i])));
    }
  });
}

// (x, residual, weight, eps) -> the normed rows; residual is updated in place to residual + x.
at::Tensor add_rms_norm(const c10::optional<at::Tensor>& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  const auto dtype = residual.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "epd_decode.add_rms_norm: bfloat16 or float32, got ",
              dtype);
  TORCH_CHECK(residual.dim() == 2 && residual.stride(1) == 1 && residual.device().is_cpu(),
              "epd_decode.add_rms_norm: residual must be 2-D, rows contiguous");
  const int64_t rows = residual.size(0), dim = residual.size(1);
  TORCH_CHECK(weight.scalar_type() == dtype && weight.is_contiguous() && weight.numel() == dim,
              "epd_decode.add_rms_norm: weight must be contiguous [dim] of the residual's dtype");
  if (x.has_value())
    TORCH_CHECK(x->scalar_type() == dtype && x->dim() == 2 && x->size(0) == rows && x->size(1) == dim &&
                    x->stride(1) == 1, "epd_decode.add_rms_norm: x must match the residual");
  at::Tensor out = at::empty({rows, dim}, residual.options());
  if (dtype == at::kFloat)
    add_rms_norm_impl<float>(x.has_value() ? x->data_ptr<float>() : nullptr, x.has_value() ? x->stride(0) : 0,
                             residual.data_ptr<float>(), residual.stride(0), weight.data_ptr<float>(),
                             static_cast<float>(eps), out.data_ptr<float>(), rows, dim);
  else
    add_rms_norm_impl<c10::BFloat16>(x.has_value() ? x->data_ptr<c10::BFloat16>() : nullptr,
                                     x.has_value() ? x->stride(0) : 0, residual.data_ptr<c10::BFloat16>(),
                                     residual.stride(0), weight.data_ptr<c10::BFloat16>(), static_cast<float>(eps),
                                     out.data_ptr<c10::BFloat16>(), rows, dim);
  return out;
}

// ---- a gated MLP's activation: silu(gate) * up (transformers' Qwen3_5MLP), one pass

// out <- silu(gate) rounded to T, times up, rounded to T: what act_fn(gate) * up computes in T
// (ATen's SiLU works in float32 and rounds once; the product of two T values rounds once).
template <typename T>
void silu_mul_impl(const T* gate, int64_t ld_gate, const T* up, int64_t ld_up, T* out, int64_t rows, int64_t dim) {
  const int64_t blocks = (dim + 255) / 256;  // units of 256 columns: rows x blocks of work for the team
  at::parallel_for(0, rows * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / blocks, c0 = (unit % blocks) * 256, c1 = std::min(dim, c0 + 256);
      const T* g = gate + r * ld_gate;
      const T* u = up + r * ld_up;
      T* o = out + r * dim;
      int64_t i = c0;
#ifdef __AVX512F__
      for (; i + 16 <= c1; i += 16) {
        __m512 act = epd_vec::vsilu(epd_vec::vload(g + i));
        if constexpr (!std::is_same_v<T, float>) act = epd_vec::vround_bf16(act);
        epd_vec::vstore(o + i, _mm512_mul_ps(act, epd_vec::vload(u + i)));
      }
#endif
      for (; i < c1; ++i) o[i] = static_cast<T>(round_to<T>(epd_vec::silu(to_float(g[i]))) * to_float(u[i]));
    }
  });
}

// (gate, up) [rows, dim] (rows strided, columns contiguous) -> silu(gate) * up [rows, dim]
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const auto dtype = gate.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "epd_decode.silu_mul: bfloat16 or float32, got ", dtype);
  TORCH_CHECK(gate.dim() == 2 && up.dim() == 2 && gate.sizes() == up.sizes() && up.scalar_type() == dtype &&
                  gate.stride(1) == 1 && up.stride(1) == 1 && gate.device().is_cpu() && up.device().is_cpu(),
              "epd_decode.silu_mul: gate and up must be CPU [rows, dim] of one dtype with contiguous columns");
  const int64_t rows = gate.size(0), dim = gate.size(1);
  at::Tensor out = at::empty({rows, dim}, gate.options());
  if (dtype == at::kFloat)
    silu_mul_impl<float>(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0),
                         out.data_ptr<float>(), rows, dim);
  else
    silu_mul_impl<c10::BFloat16>(gate.data_ptr<c10::BFloat16>(), gate.stride(0), up.data_ptr<c10::BFloat16>(),
                                 up.stride(0), out.data_ptr<c10::BFloat16>(), rows, dim);
  return out;
}

// ---- a full-attention layer's decode inputs: q/k RMSNorm, partial rotary, K/V into the pool

// Per slot s and head: Qwen3.5's per-head RMSNorm ((1 + w), float32 math, rounded to T), then the
// rotary embedding of the first `rot` dims as transformers' apply_rotary_pos_emb computes it in T
// (x cos and rotate_half(x) sin each rounded, their sum rounded; the rest passes). Queries go to
// `query` [B, H, D]; keys and values are written to the pools' rows write[s].
template <typename T>
void attention_inputs_impl(const T* qg, int64_t ld_qg, const T* k, int64_t ld_k, const T* v, int64_t ld_v,
                           const T* q_w, const T* k_w, float eps, const T* cos, const T* sin, int64_t ld_cs,
                           int64_t rot, T* keys, T* values, const int64_t* write, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t dim, T* query) {
  const int64_t units = batch * (heads + kv_heads);
  at::parallel_for(0, units, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / (heads + kv_heads), h = unit % (heads + kv_heads);
      const bool is_query = h < heads;
      const T* src = is_query ? qg + s * ld_qg + h * 2 * dim : k + s * ld_k + (h - heads) * dim;
      const T* w = is_query ? q_w : k_w;
      T* dst = is_query ? query + (s * heads + h) * dim : keys + (write[s] * kv_heads + (h - heads)) * dim;
      epd_vec::load_as<T>(x.data(), src, dim);
      const float inv = 1.f / std::sqrt(epd_vec::sum_squares(x.data(), dim) / static_cast<float>(dim) + eps);
      // the same float32 products in the same order in 16 lanes as one at a time, each rounded to T
      // where the torch path rounds (vround_bf16 is the scalar conversion's round-to-nearest-even)
      int64_t i = 0;
#ifdef __AVX512F__
      const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
      for (; i + 16 <= dim; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x.data() + i), vinv),
                                 _mm512_add_ps(one, epd_vec::vload(w + i)));
        if constexpr (!std::is_same_v<T, float>) y = epd_vec::vround_bf16(y);
        _mm512_storeu_ps(x.data() + i, y);
      }
#endif
      for (; i < dim; ++i) x[i] = round_to<T>(x[i] * inv * (1.f + to_float(w[i])));
      const T* c = cos + s * ld_cs;
      const T* sn = sin + s * ld_cs;
      const int64_t half = rot / 2;
      i = 0;
#ifdef __AVX512F__
      if (half % 16 == 0 && rot == 2 * half) {  // whole 16-lane blocks in each half
        const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
        for (; i < rot; i += 16) {
          const __m512 turned = i < half ? _mm512_xor_ps(_mm512_loadu_ps(x.data() + i + half), sign)
                                         : _mm512_loadu_ps(x.data() + i - half);
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x.data() + i), epd_vec::vload(c + i));
          __m512 b = _mm512_mul_ps(turned, epd_vec::vload(sn + i));
          if constexpr (!std::is_same_v<T, float>) {
            a = epd_vec::vround_bf16(a);
            b = epd_vec::vround_bf16(b);
          }
          epd_vec::vstore(dst + i, _mm512_add_ps(a, b));
        }
      }
#endif
      for (; i < rot; ++i) {
        const float turned = i < half ? -x[i + half] : x[i - half];
        dst[i] = static_cast<T>(round_to<T>(x[i] * to_float(c[i])) + round_to<T>(turned * to_float(sn[i])));
      }
      epd_vec::store_as<T>(dst + rot, x.data() + rot, dim - rot);
      if (!is_query) std::memcpy(values + (write[s] * kv_heads + (h - heads)) * dim, v + s * ld_v + (h - heads) * dim,
                                 sizeof(T) * dim);
    }
  });
}

at::Tensor attention_inputs(const at::Tensor& query_gate, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& q_weight, const at::Tensor& k_weight, double eps, const at::Tensor& cos,
                            const at::Tensor& sin, at::Tensor keys, at::Tensor values, const at::Tensor& write) {
  const auto dtype = query_gate.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "epd_decode.attention_inputs: bfloat16 or float32");
  for (const at::Tensor* t : {&query_gate, &key, &value, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 2 && t->stride(1) == 1 && t->device().is_cpu(),
                "epd_decode.attention_inputs: 2-D inputs with contiguous rows, of the query's dtype");
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous() &&
                  keys.scalar_type() == dtype && values.scalar_type() == dtype,
              "epd_decode.attention_inputs: pools [rows, kv_heads, dim] of the query's dtype");
  const int64_t batch = query_gate.size(0), kv_heads = keys.size(1), dim = keys.size(2);
  const int64_t heads = query_gate.size(1) / (2 * dim), rot = cos.size(1);
  TORCH_CHECK(query_gate.size(1) == heads * 2 * dim && key.size(0) == batch && key.size(1) == kv_heads * dim &&
                  value.size(0) == batch && value.size(1) == kv_heads * dim && cos.size(0) == batch &&
                  sin.sizes() == cos.sizes() && sin.stride(0) == cos.stride(0) && rot % 2 == 0 && rot <= dim,
              "epd_decode.attention_inputs: shapes");
  TORCH_CHECK(q_weight.scalar_type() == dtype && k_weight.scalar_type() == dtype && q_weight.is_contiguous() &&
                  k_weight.is_contiguous() && q_weight.numel() == dim && k_weight.numel() == dim,
              "epd_decode.attention_inputs: norm weights [dim]");
  TORCH_CHECK(write.scalar_type() == at::kLong && write.is_contiguous() && write.numel() == batch,
              "epd_decode.attention_inputs: write rows [B] int64");
  const int64_t* rows = write.data_ptr<int64_t>();
  for (int64_t s = 0; s < batch; ++s)
    TORCH_CHECK(0 <= rows[s] && rows[s] < keys.size(0), "epd_decode.attention_inputs: a write row outside the pool");
  at::Tensor query = at::empty({batch, heads, dim}, query_gate.options());
  if (dtype == at::kFloat)
    attention_inputs_impl<float>(query_gate.data_ptr<float>(), query_gate.stride(0), key.data_ptr<float>(),
                                 key.stride(0), value.data_ptr<float>(), value.stride(0), q_weight.data_ptr<float>(),
                                 k_weight.data_ptr<float>(), static_cast<float>(eps), cos.data_ptr<float>(),
                                 sin.data_ptr<float>(), cos.stride(0), rot, keys.data_ptr<float>(),
                                 values.data_ptr<float>(), rows, batch, heads, kv_heads, dim,
                                 query.data_ptr<float>());
  else
    attention_inputs_impl<c10::BFloat16>(
        query_gate.data_ptr<c10::BFloat16>(), query_gate.stride(0), key.data_ptr<c10::BFloat16>(), key.stride(0),
        value.data_ptr<c10::BFloat16>(), value.stride(0), q_weight.data_ptr<c10::BFloat16>(),
        k_weight.data_ptr<c10::BFloat16>(), static_cast<float>(eps), cos.data_ptr<c10::BFloat16>(),
        sin.data_ptr<c10::BFloat16>(), cos.stride(0), rot, keys.data_ptr<c10::BFloat16>(),
        values.data_ptr<c10::BFloat16>(), rows, batch, heads, kv_heads, dim, query.data_ptr<c10::BFloat16>());
  return query;
}

// ---- decode attention over the paged K/V pool: every slot's query rows against its own tokens

// float32 vectors for the attention: 16 lanes with AVX-512, 8 with AVX2 (head dims are multiples of 16)
#ifdef EPD_DECODE_AVX512
struct Vec {
  using R = __m512;
  static constexpr int64_t kLanes = 16;
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const c10::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R exp(R x) { return epd_vec::vexp(x); }
  static float sum(R v) { return _mm512_reduce_add_ps(v); }
};
#else
struct Vec {
  using R = __m256;
  static constexpr int64_t kLanes = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R exp(R x) { return epd_vec::vexp8(x); }
  static float sum(R v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
};
#endif

// The pool row `ahead` rows after `row` of run r along the slot's runs, or -1 past its last.
inline int64_t row_ahead(const int64_t* runs, int64_t r, int64_t last_run, int64_t row, int64_t ahead) {
  int64_t target = row + ahead;
  while (target >= runs[2 * r + 1]) {
    const int64_t over = target - runs[2 * r + 1];
    if (++r >= last_run) return -1;
    target = runs[2 * r] + over;
  }
  return target;
}

// The bytes of one head's row of a pool into the caches ahead of their use: the rows are in DRAM
// by the time attention runs (the step's weight stream evicts them), and the hardware prefetchers
// do not run far enough ahead of 512-byte pieces strided by the other heads' (cold pool, 16 slots x
// 300 tokens, one layer on two threads: 1.22 ms, against 0.55 ms with the pool in the caches).
template <typename T>
inline void prefetch_row(const T* row, int64_t dim, bool near) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) {
    if (near) __builtin_prefetch(p + off, 0, 3);
    else __builtin_prefetch(p + off, 0, 2);
  }
}

constexpr int64_t kRowsAhead = 8;  // K rows prefetched ahead of the scores

// Scores of up to 4 query heads of one group (G of them, q: G rows of dim floats) against each of
// a slot's K rows: scores[g * tokens + t] = scale * q_g . k_t. Each K row is read (and converted)
// once for the G heads; each head's sum is the same chain of fused multiply-adds over the dim's
// vectors as one head alone would make, so the scores do not depend on G. K rows are prefetched
// kRowsAhead ahead, and with `values` each V row of the head toward the outer caches for the
// products that follow (a unit's K and V rows fit in L2).
template <int G, typename T>
inline void group_scores(const float* q, int64_t dim, const T* keys, const T* values, int64_t row_stride,
                         const int64_t* runs, int64_t first_run, int64_t last_run, float scale, float* scores,
                         int64_t tokens) {
  int64_t t = 0;
  for (int64_t r = first_run; r < last_run; ++r)
    for (int64_t row = runs[2 * r]; row < runs[2 * r + 1]; ++row, ++t) {
      const int64_t next = row_ahead(runs, r, last_run, row, kRowsAhead);
      if (next >= 0) prefetch_row(keys + next * row_stride, dim, true);
      if (values) prefetch_row(values + row * row_stride, dim, false);
      const T* k = keys + row * row_stride;
      Vec::R sum[G];
      for (int g = 0; g < G; ++g) sum[g] = Vec::zero();
      for (int64_t i = 0; i < dim; i += Vec::kLanes) {
        const Vec::R kv = Vec::load(k + i);
        for (int g = 0; g < G; ++g) sum[g] = Vec::fmadd(Vec::load(q + g * dim + i), kv, sum[g]);
      }
      for (int g = 0; g < G; ++g) scores[g * tokens + t] = Vec::sum(sum[g]) * scale;
    }
}

// acc[g][c0 .. c0 + NB vectors) = sum over the slot's V rows t of p[g, t] v_t, for G heads of one
// group: the G x NB sums stay in registers while the rows stream by, in row order, so each sum is
// the same chain of fused multiply-adds as one accumulated in memory row by row.
template <int G, int NB, typename T>
inline void group_values(const float* probs, int64_t tokens, const T* values, int64_t row_stride, int64_t c0,
                         const int64_t* runs, int64_t first_run, int64_t last_run, float* acc, int64_t dim) {
  Vec::R sum[G][NB];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NB; ++c) sum[g][c] = Vec::zero();
  int64_t t = 0;
  for (int64_t r = first_run; r < last_run; ++r)
    for (int64_t row = runs[2 * r]; row < runs[2 * r + 1]; ++row, ++t) {
      const T* v = values + row * row_stride + c0;
      Vec::R vv[NB];
      for (int c = 0; c < NB; ++c) vv[c] = Vec::load(v + c * Vec::kLanes);
      for (int g = 0; g < G; ++g) {
        const Vec::R p = Vec::set1(probs[g * tokens + t]);
        for (int c = 0; c < NB; ++c) sum[g][c] = Vec::fmadd(p, vv[c], sum[g][c]);
      }
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NB; ++c) Vec::store(acc + g * dim + c0 + c * Vec::kLanes, sum[g][c]);
}

// PV for G heads over the whole dim, in blocks of as many vectors as the registers hold
template <int G, typename T>
inline void group_values_all(const float* probs, int64_t tokens, const T* values, int64_t row_stride,
                             const int64_t* runs, int64_t first_run, int64_t last_run, float* acc, int64_t dim) {
#ifdef EPD_DECODE_AVX512
  constexpr int kBlock = G <= 2 ? 8 : 4;  // G x kBlock sums + kBlock rows in 32 zmm
#else
  constexpr int kBlock = G <= 2 ? 4 : 2;  // ... in 16 ymm
#endif
  int64_t c0 = 0;
  for (; c0 + kBlock * Vec::kLanes <= dim; c0 += kBlock * Vec::kLanes)
    group_values<G, kBlock>(probs, tokens, values, row_stride, c0, runs, first_run, last_run, acc, dim);
  for (; c0 < dim; c0 += Vec::kLanes)
    group_values<G, 1>(probs, tokens, values, row_stride, c0, runs, first_run, last_run, acc, dim);
}

template <typename T>
inline void scores_for(int g_count, const float* q, int64_t dim, const T* keys, const T* values, int64_t row_stride,
                       const int64_t* runs, int64_t first_run, int64_t last_run, float scale, float* scores,
                       int64_t tokens) {
  switch (g_count) {
    case 1: return group_scores<1>(q, dim, keys, values, row_stride, runs, first_run, last_run, scale, scores, tokens);
    case 2: return group_scores<2>(q, dim, keys, values, row_stride, runs, first_run, last_run, scale, scores, tokens);
    case 3: return group_scores<3>(q, dim, keys, values, row_stride, runs, first_run, last_run, scale, scores, tokens);
    default: return group_scores<4>(q, dim, keys, values, row_stride, runs, first_run, last_run, scale, scores,
                                    tokens);
  }
}

template <typename T>
inline void values_for(int g_count, const float* probs, int64_t tokens, const T* values, int64_t row_stride,
                       const int64_t* runs, int64_t first_run, int64_t last_run, float* acc, int64_t dim) {
  switch (g_count) {
    case 1: return group_values_all<1>(probs, tokens, values, row_stride, runs, first_run, last_run, acc, dim);
    case 2: return group_values_all<2>(probs, tokens, values, row_stride, runs, first_run, last_run, acc, dim);
    case 3: return group_values_all<3>(probs, tokens, values, row_stride, runs, first_run, last_run, acc, dim);
    default: return group_values_all<4>(probs, tokens, values, row_stride, runs, first_run, last_run, acc, dim);
  }
}

// out[s, h] = softmax(scale q[s, h] K_s^T) V_s for each slot s and query head h, where K_s / V_s are
// the pool rows runs[offsets[s]..offsets[s+1]) name, kv head h / (heads / kv_heads). float32 math.
// One (slot, kv head) is a unit of work: its query heads share each K and V row read, four at a
// time. The team takes units from a shared counter rather than in fixed shares, so a thread that
// lost its core for a while, or drew the longer slots, does not hold up the others.
template <typename T>
void attend_impl(const T* query, const T* keys, const T* values, const int64_t* runs, const int64_t* offsets,
                 int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, float scale, const T* gate,
                 int64_t ld_gate, T* out) {
  const int64_t group = heads / kv_heads, units = batch * kv_heads, row_stride = kv_heads * dim;
  std::atomic<int64_t> next{0};
  on_team(units, [&]() {
    std::vector<float> q(group * dim), acc(group * dim), scores, total(group);
    for (int64_t unit = next.fetch_add(1); unit < units; unit = next.fetch_add(1)) {
      const int64_t s = unit / kv_heads, kh = unit % kv_heads;
      const int64_t first_run = offsets[s], last_run = offsets[s + 1];
      int64_t tokens = 0;
      for (int64_t r = first_run; r < last_run; ++r) tokens += runs[2 * r + 1] - runs[2 * r];
      scores.resize(group * tokens);
      for (int64_t g = 0; g < group; ++g)
        epd_vec::load_as(q.data() + g * dim, query + (s * heads + kh * group + g) * dim, dim);
      const T* k_head = keys + kh * dim;
      const T* v_head = values + kh * dim;
      for (int64_t g0 = 0; g0 < group; g0 += 4)
        scores_for(static_cast<int>(std::min<int64_t>(4, group - g0)), q.data() + g0 * dim, dim, k_head,
                   g0 == 0 ? v_head : nullptr, row_stride, runs, first_run, last_run, scale,
                   scores.data() + g0 * tokens, tokens);
      for (int64_t g = 0; g < group; ++g) {  // softmax numerators, in place
        float* sc = scores.data() + g * tokens;
        const float top = *std::max_element(sc, sc + tokens);
        Vec::R vsum = Vec::zero();
        int64_t i = 0;
        for (; i + Vec::kLanes <= tokens; i += Vec::kLanes) {
          const Vec::R e = Vec::exp(Vec::sub(Vec::load(sc + i), Vec::set1(top)));
          Vec::store(sc + i, e);
          vsum = Vec::add(vsum, e);
        }
        float sum = Vec::sum(vsum);
        for (; i < tokens; ++i) sum += (sc[i] = std::exp(sc[i] - top));
        total[g] = sum;
      }
      for (int64_t g0 = 0; g0 < group; g0 += 4)
        values_for(static_cast<int>(std::min<int64_t>(4, group - g0)), scores.data() + g0 * tokens, tokens, v_head,
                   row_stride, runs, first_run, last_run, acc.data() + g0 * dim, dim);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kh * group + g;
        T* o = out + (s * heads + h) * dim;
        const float inv = 1.f / total[g];
        const float* a = acc.data() + g * dim;
        int64_t i = 0;
        if (gate) {  // out * sigmoid(gate), each rounded to T as torch's ops in T round
          const T* gt = gate + s * ld_gate + h * 2 * dim + dim;
#ifdef __AVX512F__
          // bfloat16 (the performance mode) in 16 lanes: the sigmoid's exp is vec_math's (float32
          // results within an ulp of std::exp's, then rounded to bfloat16 as before). float32 keeps
          // std::exp, bit for bit what the parity tests ran: a scalar exp a value was a fifth of a
          // 16-row step's gated attention (docs/BENCHMARKS.md, "The decode attention's gate in 16 lanes")
          if constexpr (!std::is_same_v<T, float>) {
            const __m512 one = _mm512_set1_ps(1.f), scale_by = _mm512_set1_ps(inv);
            const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
            for (; i + 16 <= dim; i += 16) {
              const __m512 minus = _mm512_xor_ps(epd_vec::vload(gt + i), sign);  // -x, as the scalar path negates
              const __m512 sig = epd_vec::vround_bf16(_mm512_div_ps(one, _mm512_add_ps(one, epd_vec::vexp(minus))));
              const __m512 val = epd_vec::vround_bf16(_mm512_mul_ps(_mm512_loadu_ps(a + i), scale_by));
              epd_vec::vstore(o + i, _mm512_mul_ps(val, sig));
            }
          }
#endif
          for (; i < dim; ++i) {
            const float sig = round_to<T>(1.f / (1.f + std::exp(-to_float(gt[i]))));
            o[i] = static_cast<T>(round_to<T>(a[i] * inv) * sig);
          }
        } else {
#ifdef __AVX512F__
          const __m512 scale_by = _mm512_set1_ps(inv);
          for (; i + 16 <= dim; i += 16) epd_vec::vstore(o + i, _mm512_mul_ps(_mm512_loadu_ps(a + i), scale_by));
#endif
          for (; i < dim; ++i) o[i] = static_cast<T>(a[i] * inv);
        }
      }
    }
  });
}

// query [B, heads, dim]; keys, values [rows, kv_heads, dim] (the pool); runs [R, 2] int64 row ranges,
// slot s owning runs offsets[s]..offsets[s+1]-1 -> [B, heads, dim] in the query's dtype.
// With gate ([B, heads * 2 * dim] rows: each head's query then its gate, the merged projection's
// query part) the output is out * sigmoid(gate), [B, heads * dim]: the o_proj input.
at::Tensor attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& runs,
                  const at::Tensor& offsets, double scale, const c10::optional<at::Tensor>& gate) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "epd_decode.attend: bfloat16 or float32, got ", dtype);
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && keys.dim() == 3 && keys.is_contiguous() &&
                  values.sizes() == keys.sizes() && values.is_contiguous() && keys.scalar_type() == dtype &&
                  values.scalar_type() == dtype, "epd_decode.attend: contiguous query [B, H, D] and pools [rows, kvh, D]");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(2) == dim && dim % 16 == 0 && heads % kv_heads == 0, "epd_decode.attend: head dims");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && runs.dim() == 2 && runs.size(1) == 2 &&
                  offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() == batch + 1,
              "epd_decode.attend: runs [R, 2] and offsets [B + 1], int64");
  const int64_t* r = runs.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[batch] == runs.size(0), "epd_decode.attend: offsets do not cover the runs");
  for (int64_t s = 0; s < batch; ++s) TORCH_CHECK(o[s] < o[s + 1], "epd_decode.attend: a slot without tokens");
  for (int64_t i = 0; i < runs.size(0); ++i)
    TORCH_CHECK(0 <= r[2 * i] && r[2 * i] < r[2 * i + 1] && r[2 * i + 1] <= keys.size(0),
                "epd_decode.attend: a run outside the pool");
  if (gate.has_value())
    TORCH_CHECK(gate->scalar_type() == dtype && gate->dim() == 2 && gate->size(0) == batch &&
                    gate->size(1) == heads * 2 * dim && gate->stride(1) == 1,
                "epd_decode.attend: gate must be [B, heads * 2 * dim] rows of the query's dtype");
  at::Tensor out = gate.has_value() ? at::empty({batch, heads * dim}, query.options())
                                    : at::empty({batch, heads, dim}, query.options());
  const int64_t ld_gate = gate.has_value() ? gate->stride(0) : 0;
  if (dtype == at::kFloat)
    attend_impl<float>(query.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), r, o, batch, heads,
                       kv_heads, dim, static_cast<float>(scale), gate.has_value() ? gate->data_ptr<float>() : nullptr,
                       ld_gate, out.data_ptr<float>());
  else
    attend_impl<c10::BFloat16>(query.data_ptr<c10::BFloat16>(), keys.data_ptr<c10::BFloat16>(),
                               values.data_ptr<c10::BFloat16>(), r, o, batch, heads, kv_heads, dim,
                               static_cast<float>(scale),
                               gate.has_value() ? gate->data_ptr<c10::BFloat16>() : nullptr, ld_gate,
                               out.data_ptr<c10::BFloat16>());
  return out;
}

// ---- a decode step's logits, read once: each row's first maximum and whether every value is finite

// logits [B, V] float32 -> (argmax [B] int64, finite [B] bool). A row's argmax is the first index
// of its largest value, as torch.argmax picks it for finite rows (a row with a NaN or an infinity
// is reported not finite, and its argmax is not to be used). One pass per row at memory speed,
// where amin, amax and argmax apart read the 16 x 248,320 logits of a step three times and ATen's
// argmax is not vectorized (1.65 ms of them on 2 cores).
std::tuple<at::Tensor, at::Tensor> greedy_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "epd_decode.greedy_rows: float32 logits [B, V] with contiguous rows");
  const int64_t batch = logits.size(0), vocab = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "epd_decode.greedy_rows: 1 to 2^31 - 1 columns");
  at::Tensor index = at::empty({batch}, logits.options().dtype(at::kLong));
  at::Tensor finite = at::empty({batch}, logits.options().dtype(at::kBool));
  const float* x = logits.data_ptr<float>();
  int64_t* out_index = index.data_ptr<int64_t>();
  bool* out_finite = finite.data_ptr<bool>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * ld;
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_at = 0;
      bool ok = true;
      int64_t i = 0;
#ifdef EPD_DECODE_AVX512
      if (vocab >= 16) {
        __m512 vbest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        __m512i vat = _mm512_setzero_si512(), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        const __m512 zero = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (; i + 16 <= vocab; i += 16) {
          const __m512 v = _mm512_loadu_ps(row + i);
          const __mmask16 more = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // strictly: a lane keeps its first
          vbest = _mm512_mask_blend_ps(more, vbest, v);
          vat = _mm512_mask_blend_epi32(more, vat, lane);
          bad |= _mm512_cmp_ps_mask(_mm512_mul_ps(v, zero), zero, _CMP_NEQ_UQ);  // x * 0 is 0 for finite x only
          lane = _mm512_add_epi32(lane, step);
        }
        alignas(64) float lane_best[16];
        alignas(64) int32_t lane_at[16];
        _mm512_store_ps(lane_best, vbest);
        _mm512_store_si512(reinterpret_cast<__m512i*>(lane_at), vat);
        ok = bad == 0;
        best = lane_best[0];
        best_at = lane_at[0];
        for (int l = 1; l < 16; ++l)  // the largest lane; of equal ones the first index
          if (lane_best[l] > best || (lane_best[l] == best && lane_at[l] < best_at)) {
            best = lane_best[l];
            best_at = lane_at[l];
          }
      }
#else
      if (vocab >= 8) {
        __m256 vbest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        __m256 vat = _mm256_castsi256_ps(_mm256_setzero_si256());
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(8);
        const __m256 zero = _mm256_setzero_ps();
        __m256 bad = _mm256_setzero_ps();
        for (; i + 8 <= vocab; i += 8) {
          const __m256 v = _mm256_loadu_ps(row + i);
          const __m256 more = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
          vbest = _mm256_blendv_ps(vbest, v, more);
          vat = _mm256_blendv_ps(vat, _mm256_castsi256_ps(lane), more);
          bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_mul_ps(v, zero), zero, _CMP_NEQ_UQ));
          lane = _mm256_add_epi32(lane, step);
        }
        alignas(32) float lane_best[8];
        alignas(32) int32_t lane_at[8];
        _mm256_store_ps(lane_best, vbest);
        _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), _mm256_castps_si256(vat));
        ok = _mm256_movemask_ps(bad) == 0;
        best = lane_best[0];
        best_at = lane_at[0];
        for (int l = 1; l < 8; ++l)
          if (lane_best[l] > best || (lane_best[l] == best && lane_at[l] < best_at)) {
            best = lane_best[l];
            best_at = lane_at[l];
          }
      }
#endif
      for (; i < vocab; ++i) {  // the tail comes after every vectorized column: only a larger value wins
        const float v = row[i];
        ok = ok && std::isfinite(v);
        if (v > best) {  // from -inf at index 0: a row of -inf alone answers 0, as torch.argmax
          best = v;
          best_at = i;
        }
      }
      out_index[r] = best_at;
      out_finite[r] = ok;
    }
  });
  return {index, finite};
}

// ---- a run of a decode step's layers in one call (lm._DecodePlan)

// The ops above in the order lm._DecodePlan's layers call them, over a run of layers whose
// weights, widths and constants come as three flat lists (written by _DecodePlan._encode, read
// here in the same order), and this step's buffers as a fourth (per layer its conv window and
// recurrent state, or its K/V pools). Why one call: from Python the same ~10 calls a layer are
// ~200 a step, and each gives the GIL up and takes it back; on a served replica other Python
// threads (the gRPC loop making the tokens' messages, watches) hold it at times, and every
// hand-over then waits for them (docs/BENCHMARKS.md). The values are those of the calls from
// Python, bit for bit (tests/test_decode_kernels.py).
class LayerReader {
 public:
  LayerReader(const c10::List<c10::optional<at::Tensor>>& tensors, at::IntArrayRef ints, at::ArrayRef<double> reals)
      : tensors_(tensors), ints_(ints), reals_(reals) {}
  c10::optional<at::Tensor> maybe() {
    TORCH_CHECK(t_ < tensors_.size(), "epd_decode.decode_layers: the weight list ends early");
    return tensors_.get(t_++);
  }
  at::Tensor tensor() {
    c10::optional<at::Tensor> t = maybe();
    TORCH_CHECK(t.has_value(), "epd_decode.decode_layers: a missing weight");
    return *t;
  }
  int64_t integer() {
    TORCH_CHECK(i_ < ints_.size(), "epd_decode.decode_layers: the int list ends early");
    return ints_[i_++];
  }
  double real() {
    TORCH_CHECK(r_ < reals_.size(), "epd_decode.decode_layers: the float list ends early");
    return reals_[r_++];
  }
  bool done() const { return t_ == tensors_.size() && i_ == ints_.size() && r_ == reals_.size(); }
  // a few-row linear layer: (packed weight, bias?) and its output width
  at::Tensor linear(const at::Tensor& x) {
    at::Tensor packed = tensor();
    c10::optional<at::Tensor> bias = maybe();
    return ::linear(x, packed, integer(), bias);
  }

 private:
  const c10::List<c10::optional<at::Tensor>>& tensors_;
  at::IntArrayRef ints_;
  at::ArrayRef<double> reals_;
  size_t t_ = 0, i_ = 0, r_ = 0;
};

at::Tensor gdn_decode_step(const at::Tensor& mixed, const at::Tensor& window, const at::Tensor& taps,
                           const c10::optional<at::Tensor>& conv_bias, const at::Tensor& a, const at::Tensor& b,
                           const at::Tensor& neg_a_exp, const at::Tensor& dt_bias, const at::Tensor& z,
                           const at::Tensor& norm_weight, double norm_eps, const at::Tensor& state, int64_t k_heads,
                           int64_t k_dim, int64_t v_dim) {
  // epd_gdn.decode_step lives in the other library (epd/csrc/gdn_decode.cpp), loaded first
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("epd_gdn::decode_step", "");
  torch::jit::Stack stack{mixed, window, taps, conv_bias, a, b, neg_a_exp, dt_bias, z, norm_weight, norm_eps,
                          state, k_heads, k_dim, v_dim};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// Layers of one decode step over residual [B, hidden] (updated in place): `out` is the previous
// layer's MLP output (None before the first layer); returns the last layer's, not yet added to
// the residual. `state` holds per layer its buffers at full capacity (the step's rows are the
// leading B): a Gated DeltaNet layer's conv window and recurrent state, an attention layer's K
// and V pools; write/runs/offsets are the step's paged-attention rows (for attention layers).
at::Tensor decode_layers(const c10::optional<at::Tensor>& out_in, at::Tensor residual, const at::Tensor& cos,
                         const at::Tensor& sin, const c10::List<c10::optional<at::Tensor>>& weights,
                         at::IntArrayRef ints, at::ArrayRef<double> reals, const c10::List<at::Tensor>& state,
                         const c10::optional<at::Tensor>& write, const c10::optional<at::Tensor>& runs,
                         const c10::optional<at::Tensor>& offsets) {
  const int64_t size = residual.size(0);
  LayerReader layer(weights, ints, reals);
  c10::optional<at::Tensor> out = out_in;
  size_t buffer = 0;
  auto next_buffer = [&]() -> at::Tensor {
    TORCH_CHECK(buffer < state.size(), "epd_decode.decode_layers: the buffer list ends early");
    return state.get(buffer++);
  };
  while (!layer.done()) {
    const at::Tensor w1 = layer.tensor(), w2 = layer.tensor();
    const double eps1 = layer.real(), eps2 = layer.real();
    const int64_t kind = layer.integer();
    at::Tensor normed = add_rms_norm(out, residual, w1, eps1), core;
    if (kind == 0) {  // Gated DeltaNet
      const at::Tensor proj = layer.linear(normed);
      const int64_t s0 = layer.integer(), s1 = layer.integer(), s2 = layer.integer(), s3 = layer.integer();
      TORCH_CHECK(proj.size(1) == s0 + s1 + s2 + s3, "epd_decode.decode_layers: in_proj's parts");
      const at::Tensor taps = layer.tensor();
      const c10::optional<at::Tensor> conv_bias = layer.maybe();
      const at::Tensor neg_a_exp = layer.tensor(), dt_bias = layer.tensor(), norm_weight = layer.tensor();
      const double norm_eps = layer.real();
      const int64_t k_heads = layer.integer(), k_dim = layer.integer(), v_dim = layer.integer();
      const at::Tensor window = next_buffer().narrow(0, 0, size), recurrent = next_buffer().narrow(0, 0, size);
      core = gdn_decode_step(proj.narrow(1, 0, s0), window, taps, conv_bias, proj.narrow(1, s0 + s1 + s2, s3),
                             proj.narrow(1, s0 + s1, s2), neg_a_exp, dt_bias, proj.narrow(1, s0, s1), norm_weight,
                             norm_eps, recurrent, k_heads, k_dim, v_dim);
    } else {  // full attention
      TORCH_CHECK(kind == 1, "epd_decode.decode_layers: a layer of unknown kind ", kind);
      TORCH_CHECK(write.has_value() && runs.has_value() && offsets.has_value(),
                  "epd_decode.decode_layers: an attention layer without the step's rows");
      const at::Tensor proj = layer.linear(normed);
      const int64_t s0 = layer.integer(), s1 = layer.integer(), s2 = layer.integer();
      TORCH_CHECK(proj.size(1) == s0 + s1 + s2, "epd_decode.decode_layers: qkv_proj's parts");
      const at::Tensor q_weight = layer.tensor(), k_weight = layer.tensor();
      const double eps = layer.real(), scale = layer.real();
      const at::Tensor keys = next_buffer(), values = next_buffer();
      const at::Tensor query_gate = proj.narrow(1, 0, s0);
      const at::Tensor query = attention_inputs(query_gate, proj.narrow(1, s0, s1), proj.narrow(1, s0 + s1, s2),
                                                q_weight, k_weight, eps, cos, sin, keys, values, *write);
      core = attend(query, keys, values, *runs, *offsets, scale, query_gate);
    }
    normed = add_rms_norm(layer.linear(core), residual, w2, eps2);
    const at::Tensor gate_up = layer.linear(normed);
    const int64_t gate = layer.integer(), up = layer.integer();
    TORCH_CHECK(gate_up.size(1) == gate + up, "epd_decode.decode_layers: gate_up_proj's parts");
    out = layer.linear(silu_mul(gate_up.narrow(1, 0, gate), gate_up.narrow(1, gate, up)));
  }
  TORCH_CHECK(buffer == state.size(), "epd_decode.decode_layers: more buffers than layers");
  TORCH_CHECK(out.has_value(), "epd_decode.decode_layers: no layers");
  return *out;
}

}  // namespace

// Whether bfloat16 products of 5 rows or more run on AMX tiles in this build and process.
bool tiles() {
#ifdef EPD_DECODE_AMX
  return amx_enabled();
#else
  return false;
#endif
}

// How greedy rows' LM head can be screened on int8 (greedy_screen.h) in this build and process:
// 1 on AMX-INT8 tiles (two levels of the rows, few columns left), 2 on AVX-512 VNNI registers (one
// level, a few thousand columns left, gathered by the caller), 0 not at all.
int64_t screens() {
#ifdef EPD_DECODE_SCREEN_TILES
  if (amx_enabled()) return 1;
#endif
#ifdef EPD_DECODE_SCREEN_VECTOR
  return 2;
#else
  return 0;
#endif
}

TORCH_LIBRARY(epd_decode, m) {
  m.def("tiles() -> bool", &tiles);
  m.def("pack(Tensor weight, Tensor? rows=None) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("linear_wide(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("linear_float(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("add_rms_norm(Tensor? x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("attend(Tensor query, Tensor keys, Tensor values, Tensor runs, Tensor offsets, float scale, Tensor? gate) -> Tensor");
  m.def("attention_inputs(Tensor query_gate, Tensor key, Tensor value, Tensor q_weight, Tensor k_weight, float eps, "
        "Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, Tensor write) -> Tensor");
  m.def("decode_layers(Tensor? out, Tensor(a!) residual, Tensor cos, Tensor sin, Tensor?[] weights, int[] ints, "
        "float[] reals, Tensor[] state, Tensor? write, Tensor? runs, Tensor? offsets) -> Tensor");
  m.def("greedy_rows(Tensor logits) -> (Tensor, Tensor)");
  m.def("screens() -> int", &screens);
#ifdef EPD_DECODE_SCREEN
  m.def("pack_i8(Tensor weight, bool offset) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
#endif
#ifdef EPD_DECODE_SCREEN_TILES
  m.def("screen(Tensor x, Tensor packed, Tensor scale, Tensor l1, int n, bool bf16_logits) -> Tensor");
#endif
#ifdef EPD_DECODE_SCREEN_VECTOR
  m.def("screen_vector(Tensor x, Tensor packed, Tensor scale, Tensor l1, Tensor l2, Tensor rounding, int n, "
        "bool bf16_logits) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(epd_decode, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("linear_wide", &linear_wide);
  m.impl("linear_float", &linear_float);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("attend", &attend);
  m.impl("attention_inputs", &attention_inputs);
  m.impl("decode_layers", &decode_layers);
  m.impl("greedy_rows", &greedy_rows);
#ifdef EPD_DECODE_SCREEN
  m.impl("pack_i8", &pack_i8);
#endif
#ifdef EPD_DECODE_SCREEN_TILES
  m.impl("screen", &screen);
#endif
#ifdef EPD_DECODE_SCREEN_VECTOR
  m.impl("screen_vector", &screen_vector);
#endif
}
