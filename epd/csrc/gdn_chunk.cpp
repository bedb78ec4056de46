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
// Registered as torch.ops.epd_gdn_chunk.chunk_rule (TORCH_LIBRARY, no pybind11). Built at first
// use by epd/kernels_prefill.py through epd/fused.py's compile_library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr float kL2Eps = 1e-6f;  // transformers' l2norm epsilon

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

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

}  // namespace

TORCH_LIBRARY(epd_gdn_chunk, m) {
  m.def("chunk_rule(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, Tensor(a!) state, int chunk, "
        "bool l2norm) -> Tensor");
}

TORCH_LIBRARY_IMPL(epd_gdn_chunk, CPU, m) {
  m.impl("chunk_rule", &chunk_rule);
}
