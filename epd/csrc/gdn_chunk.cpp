// The chunked gated delta rule of a Qwen3.5 Gated DeltaNet layer (prefill), fused on a CPU.
//
// What epd/kernels.py's chunk_gated_delta_rule computes (the same chunking, the same algebra),
// in one call per sequence: per (batch, value head), chunk after chunk, it loads the chunk's
// q/k/v rows straight from the conv output's strided views (bfloat16 or float32), L2-normalises
// q and k, builds the decay matrix exp(cum_i - cum_j), inverts the unit lower-triangular UT
// system by forward substitution, forms u = T diag(beta) v and w = T diag(beta e^cum) k, the
// causal intra-chunk scores, and then runs the state recurrence on the head's float32 state
// [k_dim, v_dim] (in place): v_new = u - w S, o = (q e^cum) S + intra v_new,
// S <- e^cum_last S + (k e^(cum_last - cum))^T v_new. Every intermediate lives in a per-thread
// workspace of a few hundred KiB (L2), so the torch path's passes over whole-prompt
// [heads, chunks, 32, 128] float32 tensors (transposing copies, decay masks, scaled copies, the
// per-chunk slices) are gone; the matrix products are small register-blocked AVX-512 loops.
//
// Rounding: float32 throughout (as the torch path), the output rounded once to the input dtype.
// In float32 the results differ from the torch path only by the order of float32 sums, by
// exp's last bit (Cephes' polynomial against Sleef's), and by subnormal values (below ~1.2e-38)
// taken as zero: each thread runs its heads with the CPU's flush-to-zero and denormals-are-zero
// modes on (FlushSubnormals). A strong decay makes e^cum subnormal within a chunk, and Intel
// cores take a microcode assist on every such operand: the rule took 80 ms a layer for a
// 247-token prompt on a Xeon with them against 5.5 ms for inputs without (docs/BENCHMARKS.md,
// "A CPU with AMX"). Such a value is ~2^-126 of its normal-sized neighbours, far below any
// output's last bit, so nothing a token depends on moves.
//
// The library also holds prefill's other Gated DeltaNet passes and the vision tower's rotary
// embedding, each one pass over the rows where the torch path made several: conv (the depthwise
// causal conv of a chunk on top of its window, with SiLU), gated_norm (the gated RMSNorm after the
// rule), rotary (apply_rotary_pos_emb_vision); each says how it rounds.
//
// Registered as torch.ops.epd_gdn_chunk.{chunk_rule, conv, gated_norm, rotary, vision_attention}
// (vision_attention.h: where the CPU has AVX-512 BF16) (TORCH_LIBRARY, no
// pybind11). Built at first use by epd/kernels_prefill.py through epd/fused.py's compile_library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "elementwise.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr float kL2Eps = 1e-6f;  // transformers' l2norm epsilon

using epd_vec::to_float;

#ifdef __AVX512F__
using epd_vec::vexp;  // exp for float32 (vec_math.h)

// C[MR, 16 NV] = beta C + A[MR, K] B[K, 16 NV] (beta 0: C is not read). A's element (m, k) is at
// A[m * am + k * ak] (broadcast one at a time, so A may be transposed); B and C are row-major.
template <int MR, int NV>
inline void tile(int64_t K, const float* A, int64_t am, int64_t ak, const float* B, int64_t ldb, float* C,
                 int64_t ldc, float beta) {
  __m512 c[MR][NV];
  const __m512 vbeta = _mm512_set1_ps(beta);
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      c[r][v] = beta == 0.f ? _mm512_setzero_ps() : _mm512_mul_ps(vbeta, _mm512_loadu_ps(C + r * ldc + 16 * v));
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(B + k * ldb + 16 * v);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * am + k * ak]);
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
}

template <int NV>
inline void tile_rows(int64_t M, int64_t K, const float* A, int64_t am, int64_t ak, const float* B, int64_t ldb,
                      float* C, int64_t ldc, float beta) {
  constexpr int MR = NV >= 4 ? 6 : 8;  // accumulators + B's vectors within the 32 registers
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, NV>(K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc, beta);
  for (; m < M; ++m) tile<1, NV>(K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc, beta);
}
#endif

// C[M, N] = beta C + A[M, K] B[K, N], float32 (beta 0: C is only written); A as in ``tile``.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t am, int64_t ak, const float* B, int64_t ldb,
          float* C, int64_t ldc, float beta) {
  int64_t n = 0;
#ifdef __AVX512F__
  for (; n + 64 <= N; n += 64) tile_rows<4>(M, K, A, am, ak, B + n, ldb, C + n, ldc, beta);
  for (; n + 32 <= N; n += 32) tile_rows<2>(M, K, A, am, ak, B + n, ldb, C + n, ldc, beta);
  for (; n + 16 <= N; n += 16) tile_rows<1>(M, K, A, am, ak, B + n, ldb, C + n, ldc, beta);
#endif
  if (n == N) return;
  for (int64_t m = 0; m < M; ++m) {
    float* row = C + m * ldc;
    for (int64_t j = n; j < N; ++j) row[j] = beta == 0.f ? 0.f : beta * row[j];
    for (int64_t k = 0; k < K; ++k) {
      const float a = A[m * am + k * ak];
      const float* brow = B + k * ldb;
      for (int64_t j = n; j < N; ++j) row[j] += a * brow[j];
    }
  }
}

// out[j] = exp(from - x[j]) for j < n
inline void exp_from(float from, const float* x, float* out, int64_t n) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 f = _mm512_set1_ps(from);
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, vexp(_mm512_sub_ps(f, _mm512_loadu_ps(x + j))));
#endif
  for (; j < n; ++j) out[j] = std::exp(from - x[j]);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= n; j += 16) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
      _mm512_storeu_ps(dst + j, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
    }
#endif
    for (; j < n; ++j) dst[j] = to_float(src[j]);
  }
}

inline void scale_row(float* x, float factor, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

// 1 / sqrt(|x|^2 + eps): transformers' l2norm factor
inline float inverse_norm(const float* x, int64_t n) {
  float sum = 0.f;
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();  // 16 partial sums: a scalar sum would be one 4-cycle chain per element
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) sum += x[j] * x[j];
  return 1.f / std::sqrt(sum + kL2Eps);
}

struct Shapes {
  int64_t length, v_heads, k_heads, k_dim, v_dim, chunk;
  bool l2norm;
};

// Strided views, in elements: [batch, T, heads, dim] with a unit last stride.
struct View {
  int64_t b, t, h;
};

// Per-thread scratch for one (batch, head)'s chunks: a few hundred KiB, reused across chunks.
struct Workspace {
  std::vector<float> q, k, v, u, w, o, kt, qk, kk, decay, inverse, cum, beta;
  explicit Workspace(const Shapes& s)
      : q(s.chunk * s.k_dim), k(s.chunk * s.k_dim), v(s.chunk * s.v_dim), u(s.chunk * s.v_dim),
        w(s.chunk * s.k_dim), o(s.chunk * s.v_dim), kt(s.k_dim * s.chunk), qk(s.chunk * s.chunk),
        kk(s.chunk * s.chunk), decay(s.chunk * s.chunk), inverse(s.chunk * s.chunk), cum(s.chunk), beta(s.chunk) {}
};

template <typename T, typename B>
void run_head(const T* query, const T* key, const T* value, const float* g, const B* beta, T* out, float* state,
              const View& qv, const View& kv, const View& vv, const View& gv, const View& bv, const View& ov,
              const Shapes& s, int64_t batch, int64_t head, Workspace& ws) {
  const int64_t C = s.chunk, dk = s.k_dim, dv = s.v_dim;
  const int64_t k_head = head / (s.v_heads / s.k_heads);  // GQA: consecutive value heads share a key head
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  float* q = ws.q.data();
  float* k = ws.k.data();
  float* v = ws.v.data();
  float* u = ws.u.data();
  float* w = ws.w.data();
  float* o = ws.o.data();
  float* kt = ws.kt.data();
  float* qk = ws.qk.data();
  float* kk = ws.kk.data();
  float* decay = ws.decay.data();
  float* inv = ws.inverse.data();
  float* cum = ws.cum.data();
  float* bt = ws.beta.data();
  for (int64_t start = 0; start < s.length; start += C) {
    const int64_t n = std::min(C, s.length - start);
    // the chunk's rows, float32: q and k normalised (q also scaled), the decay cumulated from the chunk start
    float running = 0.f;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = start + r;
      load_row(query + batch * qv.b + t * qv.t + k_head * qv.h, q + r * dk, dk);
      load_row(key + batch * kv.b + t * kv.t + k_head * kv.h, k + r * dk, dk);
      load_row(value + batch * vv.b + t * vv.t + head * vv.h, v + r * dv, dv);
      float qf = q_scale, kf = 1.f;
      if (s.l2norm) {
        qf *= inverse_norm(q + r * dk, dk);
        kf = inverse_norm(k + r * dk, dk);
      }
      scale_row(q + r * dk, qf, dk);
      if (s.l2norm) scale_row(k + r * dk, kf, dk);
      running += g[batch * gv.b + t * gv.t + head * gv.h];
      cum[r] = running;
      bt[r] = to_float(beta[batch * bv.b + t * bv.t + head * bv.h]);
      for (int64_t i = 0; i < dk; ++i) kt[i * C + r] = k[r * dk + i];
    }
    // decay[i, j] = exp(cum_i - cum_j) for j <= i (0 above: never read)
    for (int64_t i = 0; i < n; ++i) exp_from(cum[i], cum, decay + i * C, i + 1);
    gemm(n, n, dk, k, dk, 1, kt, C, kk, C, 0.f);  // k k^T
    gemm(n, n, dk, q, dk, 1, kt, C, qk, C, 0.f);  // q k^T
    // T = (I + strictly_lower(diag(beta) k k^T * decay))^-1 by forward substitution, then times diag(beta)
    for (int64_t i = 0; i < n; ++i) {
      float* row = inv + i * C;
      std::fill(row, row + n, 0.f);
      row[i] = 1.f;
      for (int64_t j = 0; j < i; ++j) {
        const float a = kk[i * C + j] * (decay[i * C + j] * bt[i]);
        const float* prev = inv + j * C;
        for (int64_t c = 0; c <= j; ++c) row[c] -= a * prev[c];
      }
    }
    const float last = cum[n - 1];
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) inv[i * C + j] *= bt[j];
    gemm(n, dv, n, inv, C, 1, v, dv, u, dv, 0.f);  // u = T diag(beta) v
    // T diag(beta) diag(e^cum), negated so that v_new = u + w' S below
    for (int64_t j = 0; j < n; ++j) {
      const float e = -std::exp(cum[j]);
      for (int64_t i = 0; i < n; ++i) inv[i * C + j] *= e;
    }
    gemm(n, dk, n, inv, C, 1, k, dk, w, dk, 0.f);  // -w
    // causal intra-chunk scores (q k^T * decay, j <= i); q scaled by e^cum; k by e^(last - cum)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j <= i; ++j) qk[i * C + j] *= decay[i * C + j];
      for (int64_t j = i + 1; j < n; ++j) qk[i * C + j] = 0.f;
      scale_row(q + i * dk, std::exp(cum[i]), dk);
      scale_row(k + i * dk, std::exp(last - cum[i]), dk);
    }
    gemm(n, dv, dk, w, dk, 1, state, dv, u, dv, 1.f);   // v_new = u - w S (in u)
    gemm(n, dv, dk, q, dk, 1, state, dv, o, dv, 0.f);   // (q e^cum) S
    gemm(n, dv, n, qk, C, 1, u, dv, o, dv, 1.f);        // + intra v_new
    gemm(dk, dv, n, k, 1, dk, u, dv, state, dv, std::exp(last));  // S <- e^last S + k'^T v_new
    for (int64_t r = 0; r < n; ++r) {
      T* dst = out + batch * ov.b + (start + r) * ov.t + head * ov.h;
      for (int64_t j = 0; j < dv; ++j) dst[j] = static_cast<T>(o[r * dv + j]);
    }
  }
}

View view_of(const at::Tensor& x) {  // [B, T, H(, D)]
  return {x.stride(0), x.stride(1), x.stride(2)};
}

// The calling thread's MXCSR with flush-to-zero (bit 15) and denormals-are-zero (bit 6) set for
// the guard's lifetime, then restored: the thread may be a torch worker that runs other code next.
struct FlushSubnormals {
#if defined(__x86_64__) || defined(__i386__)
  unsigned int saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

template <typename T, typename B>
void run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& g,
         const at::Tensor& beta, const at::Tensor& state, const at::Tensor& out, const Shapes& s) {
  const int64_t batch = query.size(0);
  const View qv = view_of(query), kv = view_of(key), vv = view_of(value), gv = view_of(g), bv = view_of(beta),
             ov = view_of(out);
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const float* gp = g.data_ptr<float>();
  const B* bp = beta.data_ptr<B>();
  T* op = out.data_ptr<T>();
  float* sp = state.data_ptr<float>();
  at::parallel_for(0, batch * s.v_heads, 1, [&](int64_t begin, int64_t end) {
    const FlushSubnormals flush;
    Workspace ws(s);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.v_heads, h = task % s.v_heads;
      run_head<T, B>(q, k, v, gp, bp, op, sp + task * s.k_dim * s.v_dim, qv, kv, vv, gv, bv, ov, s, b, h, ws);
    }
  });
}

// query/key [B, T, k_heads, k_dim], value [B, T, v_heads, v_dim] (bfloat16 or float32, last
// stride 1), g [B, T, v_heads] float32, beta [B, T, v_heads] (the value's dtype or float32),
// state [B, v_heads, k_dim, v_dim] float32 contiguous (updated in place). Returns the output
// [B, T, v_heads, v_dim] in the value's dtype.
at::Tensor chunk_rule(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& g,
                      const at::Tensor& beta, const at::Tensor& state, int64_t chunk, bool l2norm) {
  TORCH_CHECK(query.dim() == 4 && key.sizes() == query.sizes() && value.dim() == 4, "q/k/v must be [B, T, heads, dim]");
  TORCH_CHECK(query.size(0) == value.size(0) && query.size(1) == value.size(1), "q/k/v batch and length differ");
  TORCH_CHECK(query.scalar_type() == value.scalar_type() && key.scalar_type() == value.scalar_type(),
              "q/k/v dtypes differ");
  TORCH_CHECK(value.scalar_type() == at::kFloat || value.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "q/k/v need a unit last stride");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 3 && beta.dim() == 3, "g float32 [B, T, v_heads]");
  TORCH_CHECK(beta.scalar_type() == at::kFloat || beta.scalar_type() == value.scalar_type(), "beta's dtype");
  const int64_t v_heads = value.size(2), k_heads = query.size(2);
  TORCH_CHECK(k_heads > 0 && v_heads % k_heads == 0, "value heads must be a multiple of key heads");
  TORCH_CHECK(g.size(0) == value.size(0) && g.size(1) == value.size(1) && g.size(2) == v_heads, "g's shape");
  TORCH_CHECK(beta.sizes() == g.sizes(), "beta's shape");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(0) == value.size(0) && state.size(1) == v_heads && state.size(2) == query.size(3) &&
                  state.size(3) == value.size(3),
              "state must be float32 contiguous [B, v_heads, k_dim, v_dim]");
  TORCH_CHECK(chunk >= 1, "chunk must be positive");
  const Shapes s{value.size(1), v_heads, k_heads, query.size(3), value.size(3), chunk, l2norm};
  at::Tensor out = at::empty(value.sizes(), value.options().memory_format(at::MemoryFormat::Contiguous));
  if (s.length == 0) return out;
  const bool beta32 = beta.scalar_type() == at::kFloat;
  if (value.scalar_type() == at::kFloat) {
    run<float, float>(query, key, value, g, beta, state, out, s);
  } else if (beta32) {
    run<c10::BFloat16, float>(query, key, value, g, beta, state, out, s);
  } else {
    run<c10::BFloat16, c10::BFloat16>(query, key, value, g, beta, state, out, s);
  }
  return out;
}

// ---- the depthwise causal conv of a prefill chunk, and the gated RMSNorm after the rule

// out[b, t, c] = act(sum_k full[b, t + k, c] taps[k, c] + bias[c]) for full = [the window's last K-1
// inputs, x] (time-major), as epd/kernels.py's causal_conv1d computes it: float32, the taps summed
// first to last (the compiler may fuse a product into its add: last-bit differences in float32),
// the bias, SiLU, one rounding to T. The new window (the last K inputs, [B, C, K] as transformers
// keeps it) goes to new_win.
template <typename T>
void conv_impl(const T* x, int64_t xb, int64_t xt, const T* win, int64_t wb, int64_t wc, int64_t wk,
               const float* taps, const float* bias, bool act, int64_t batch, int64_t length, int64_t channels,
               int64_t kernel, T* out, T* new_win) {
  const int64_t carry = kernel - 1;
  std::vector<float> carried(batch * carry * channels, 0.f);  // [B, K-1, C] float32, zeros without a window
  if (win)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < carry; ++j)
        for (int64_t c = 0; c < channels; ++c)
          carried[(b * carry + j) * channels + c] = to_float(win[b * wb + c * wc + (j + 1) * wk]);
  // full index j of batch b, channels from c
  const auto row_f = [&](int64_t b, int64_t j) { return carried.data() + (b * carry + j) * channels; };
  const auto row_x = [&](int64_t b, int64_t j) { return x + b * xb + (j - carry) * xt; };
  constexpr int64_t kTokens = 16, kChannels = 512;
  const int64_t t_blocks = (length + kTokens - 1) / kTokens, c_blocks = (channels + kChannels - 1) / kChannels;
  at::parallel_for(0, batch * t_blocks * c_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (t_blocks * c_blocks), tb = (unit / c_blocks) % t_blocks, cb = unit % c_blocks;
      const int64_t t1 = std::min(length, (tb + 1) * kTokens), c0 = cb * kChannels;
      const int64_t c1 = std::min(channels, c0 + kChannels);
      for (int64_t t = tb * kTokens; t < t1; ++t) {
        T* o = out + (b * length + t) * channels;
        int64_t c = c0;
#ifdef __AVX512F__
        for (; c + 16 <= c1; c += 16) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t k = 0; k < kernel; ++k) {
            const int64_t j = t + k;
            const __m512 in = j < carry ? _mm512_loadu_ps(row_f(b, j) + c) : epd_vec::vload(row_x(b, j) + c);
            const __m512 product = _mm512_mul_ps(in, _mm512_loadu_ps(taps + k * channels + c));
            acc = k == 0 ? product : _mm512_add_ps(acc, product);
          }
          if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + c));
          if (act) acc = epd_vec::vsilu(acc);
          epd_vec::vstore(o + c, acc);
        }
#endif
        for (; c < c1; ++c) {
          float acc = 0.f;
          for (int64_t k = 0; k < kernel; ++k) {
            const int64_t j = t + k;
            const float in = j < carry ? row_f(b, j)[c] : to_float(row_x(b, j)[c]);
            const float product = in * taps[k * channels + c];
            acc = k == 0 ? product : acc + product;
          }
          if (bias) acc += bias[c];
          if (act) acc = epd_vec::silu(acc);
          o[c] = static_cast<T>(acc);
        }
      }
    }
  });
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t k = 0; k < kernel; ++k) {
      const int64_t j = length - 1 + k;  // the full index of the window's k-th input
      for (int64_t c = 0; c < channels; ++c)
        new_win[(b * channels + c) * kernel + k] = j < carry ? static_cast<T>(row_f(b, j)[c]) : row_x(b, j)[c];
    }
}

// (x [B, T, C] with contiguous channels, window [B, C, K] or none, taps [K, C] float32, bias [C]
// float32 or none, silu) -> (the activated output [B, T, C] in x's dtype, the new window [B, C, K])
std::tuple<at::Tensor, at::Tensor> conv(const at::Tensor& x, const c10::optional<at::Tensor>& window,
                                        const at::Tensor& taps, const c10::optional<at::Tensor>& bias, bool silu) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "epd_gdn_chunk.conv: float32 or bfloat16, got ", dtype);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(), "epd_gdn_chunk.conv: x must be [B, T, C], channels contiguous");
  const int64_t batch = x.size(0), length = x.size(1), channels = x.size(2), kernel = taps.size(0);
  TORCH_CHECK(taps.scalar_type() == at::kFloat && taps.is_contiguous() && taps.dim() == 2 && taps.size(1) == channels &&
                  kernel >= 1, "epd_gdn_chunk.conv: taps must be float32 contiguous [K, C]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == channels,
                "epd_gdn_chunk.conv: bias must be float32 contiguous [C]");
  if (window.has_value())
    TORCH_CHECK(window->scalar_type() == dtype && window->dim() == 3 && window->size(0) == batch &&
                    window->size(1) == channels && window->size(2) == kernel,
                "epd_gdn_chunk.conv: window must be [B, C, K] of x's dtype");
  at::Tensor out = at::empty({batch, length, channels}, x.options());
  at::Tensor new_window = at::empty({batch, channels, kernel}, x.options());
  TORCH_CHECK(length > 0, "epd_gdn_chunk.conv: an empty chunk");
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* w = window.has_value() ? window->data_ptr<T>() : nullptr;
    const int64_t wb = window.has_value() ? window->stride(0) : 0, wc = window.has_value() ? window->stride(1) : 0,
                  wk = window.has_value() ? window->stride(2) : 0;
    conv_impl<T>(x.data_ptr<T>(), x.stride(0), x.stride(1), w, wb, wc, wk, taps.data_ptr<float>(), b, silu, batch,
                 length, channels, kernel, out.data_ptr<T>(), new_window.data_ptr<T>());
  };
  if (dtype == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return {out, new_window};
}

// Qwen3.5's gated RMSNorm (transformers' Qwen3_5RMSNormGated) per head of `dim` values:
// weight * norm(x) * silu(z), float32 math rounded to T where the torch module rounds (the normed
// values, their product with the weight, the result).
template <typename T>
void gated_norm_impl(const T* core, int64_t ld_core, const T* z, int64_t ld_z, const T* weight, float eps, T* out,
                     int64_t rows, int64_t heads, int64_t dim) {
  at::parallel_for(0, rows * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim), gate(dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / heads, h = unit % heads;
      epd_vec::load_as<T>(x.data(), core + r * ld_core + h * dim, dim);
      const float inv = 1.f / std::sqrt(epd_vec::sum_squares(x.data(), dim) / static_cast<float>(dim) + eps);
      for (int64_t j = 0; j < dim; ++j) x[j] *= inv;
      epd_vec::round_inplace<T>(x.data(), dim);
      epd_vec::mul_by<T>(x.data(), weight, dim);
      epd_vec::round_inplace<T>(x.data(), dim);
      epd_vec::load_as<T>(gate.data(), z + r * ld_z + h * dim, dim);
      epd_vec::silu_inplace(gate.data(), dim);
      epd_vec::mul_by<float>(x.data(), gate.data(), dim);
      epd_vec::store_as<T>(out + r * heads * dim + h * dim, x.data(), dim);
    }
  });
}

// (core [N, H * D], z [N, H * D]: rows strided, columns contiguous; weight [D]) -> [N, H * D]
at::Tensor gated_norm(const at::Tensor& core, const at::Tensor& z, const at::Tensor& weight, double eps) {
  const auto dtype = core.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "epd_gdn_chunk.gated_norm: float32 or bfloat16, got ", dtype);
  TORCH_CHECK(core.dim() == 2 && z.dim() == 2 && core.sizes() == z.sizes() && z.scalar_type() == dtype &&
                  core.stride(1) == 1 && z.stride(1) == 1 && core.device().is_cpu() && z.device().is_cpu(),
              "epd_gdn_chunk.gated_norm: core and z must be CPU [N, H * D] of one dtype with contiguous columns");
  const int64_t dim = weight.numel();
  TORCH_CHECK(weight.scalar_type() == dtype && weight.is_contiguous() && dim > 0 && core.size(1) % dim == 0,
              "epd_gdn_chunk.gated_norm: weight must be contiguous [D] of core's dtype, D dividing its width");
  const int64_t rows = core.size(0), heads = core.size(1) / dim;
  at::Tensor out = at::empty({rows, heads * dim}, core.options());
  if (dtype == at::kFloat)
    gated_norm_impl<float>(core.data_ptr<float>(), core.stride(0), z.data_ptr<float>(), z.stride(0),
                           weight.data_ptr<float>(), static_cast<float>(eps), out.data_ptr<float>(), rows, heads, dim);
  else
    gated_norm_impl<c10::BFloat16>(core.data_ptr<c10::BFloat16>(), core.stride(0), z.data_ptr<c10::BFloat16>(),
                                   z.stride(0), weight.data_ptr<c10::BFloat16>(), static_cast<float>(eps),
                                   out.data_ptr<c10::BFloat16>(), rows, heads, dim);
  return out;
}

// ---- the vision tower's rotary embedding (transformers' apply_rotary_pos_emb_vision)

// Not contracted into FMAs: each product and the sum are rounded as torch's three float32 ops
// round them, so the output is bit-identical to transformers' in float32 and in bfloat16.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// out[l, h] = (x cos[l] + rotate_half(x) sin[l]) for x = in[l, h] in float32, rounded to T once
template <typename T>
void rotary_impl(const T* in, int64_t ld_l, int64_t ld_h, const float* cos, const float* sin, int64_t ld_cs,
                 T* out, int64_t length, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, length, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim), turned(dim), y(dim);
    for (int64_t l = begin; l < end; ++l) {
      const float* c = cos + l * ld_cs;
      const float* sn = sin + l * ld_cs;
      for (int64_t h = 0; h < heads; ++h) {
        epd_vec::load_as<T>(x.data(), in + l * ld_l + h * ld_h, dim);
        for (int64_t i = 0; i < half; ++i) {
          turned[i] = -x[i + half];
          turned[i + half] = x[i];
        }
        for (int64_t i = 0; i < dim; ++i) {
          const float a = x[i] * c[i];
          const float b = turned[i] * sn[i];
          y[i] = a + b;
        }
        epd_vec::store_as<T>(out + (l * heads + h) * dim, y.data(), dim);
      }
    }
  });
}
#pragma GCC pop_options

// (x [L, H, D] with contiguous D, cos and sin [L, D] float32) -> the rotated x [L, H, D] in x's dtype
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "epd_gdn_chunk.rotary: float32 or bfloat16, got ", dtype);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu() && x.size(2) % 2 == 0,
              "epd_gdn_chunk.rotary: x must be [L, H, D] with contiguous D, D even");
  const int64_t length = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(0) == length && cos.size(1) == dim && cos.stride(1) == 1 &&
                  sin.stride(1) == 1 && cos.stride(0) == sin.stride(0),
              "epd_gdn_chunk.rotary: cos and sin must be float32 [L, D] with contiguous D");
  at::Tensor out = at::empty({length, heads, dim}, x.options());
  if (dtype == at::kFloat)
    rotary_impl<float>(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                       cos.stride(0), out.data_ptr<float>(), length, heads, dim);
  else
    rotary_impl<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1), cos.data_ptr<float>(),
                               sin.data_ptr<float>(), cos.stride(0), out.data_ptr<c10::BFloat16>(), length, heads, dim);
  return out;
}

#include "vision_attention.h"

}  // namespace

TORCH_LIBRARY(epd_gdn_chunk, m) {
  m.def("chunk_rule(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, Tensor(a!) state, int chunk, "
        "bool l2norm) -> Tensor");
  m.def("conv(Tensor x, Tensor? window, Tensor taps, Tensor? bias, bool silu) -> (Tensor, Tensor)");
  m.def("gated_norm(Tensor core, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
#ifdef EPD_VISION_ATTENTION
  m.def("vision_attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(epd_gdn_chunk, CPU, m) {
  m.impl("chunk_rule", &chunk_rule);
  m.impl("conv", &conv);
  m.impl("gated_norm", &gated_norm);
  m.impl("rotary", &rotary);
#ifdef EPD_VISION_ATTENTION
  m.impl("vision_attention", &vision_attention);
#endif
}
