// One decode token of a Qwen3.5 Gated DeltaNet layer for a batch of slots, fused on a CPU.
//
// What epd/lm.py's torch path (_linear_attention_step) does between the input projections and
// out_proj, in one call: the depthwise causal-conv step on the time-major window (updated in
// place) and its SiLU, the split into q/k/v, the L2 norm of q and k and the 1/sqrt(k_dim) query
// scale, beta = sigmoid(b), the decay g = -exp(A_log) * softplus(a + dt_bias), the recurrent
// state update (float32, in place) and read-out, and the gated RMSNorm. Each slot's state
// [v_heads, k_dim, v_dim] is read from memory once and written once (the torch path needs three
// reads and two writes, and ~30 small ops around them): per (slot, head) one pass computes
// k^T S, a second pass (from L2: a head's state is 64 KiB) writes S' = d S + k delta^T and
// accumulates q^T S' as transformers' recurrent rule reads it out.
//
// Rounding mirrors the torch path: the conv output, beta, the core output and the normalised
// output are rounded to the model dtype where the torch path rounds them, and everything else is
// float32. In float32 the only differences are the order of float32 sums.
//
// Registered as torch.ops.epd_gdn.decode_step (TORCH_LIBRARY, no pybind11: shorter builds).
// Built at first use by epd/fused.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "elementwise.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace {

using epd_vec::round_inplace;
using epd_vec::round_to;
using epd_vec::silu_inplace;
using epd_vec::store_as;
using epd_vec::to_float;

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

// One head's state update and read-out: ks = k^T S, delta = beta (v - decay ks),
// S <- decay S + k delta^T (in place), core = q^T S (the new state, as transformers reads it out).
// ``ks`` is scratch of v_dim floats; ``core`` receives v_dim floats.
inline void update_head_scalar(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                               int64_t k_dim, int64_t v_dim, float* ks, float* core) {
  std::fill(ks, ks + v_dim, 0.f);
  for (int64_t i = 0; i < k_dim; ++i) {
    const float ki = k[i];
    const float* row = S + i * v_dim;
    for (int64_t j = 0; j < v_dim; ++j) ks[j] += ki * row[j];
  }
  for (int64_t j = 0; j < v_dim; ++j) {
    ks[j] = (v[j] - decay * ks[j]) * beta;  // delta, in place of ks
    core[j] = 0.f;
  }
  for (int64_t i = 0; i < k_dim; ++i) {
    const float ki = k[i], qi = q[i];
    float* row = S + i * v_dim;
    for (int64_t j = 0; j < v_dim; ++j) {
      const float updated = decay * row[j] + ki * ks[j];
      row[j] = updated;
      core[j] += qi * updated;
    }
  }
}

#ifdef __AVX512F__
// The same for a v_dim that is a multiple of 16 * NB: columns in blocks of NB vectors of 16 floats,
// each block's sums kept in registers over all k_dim rows (NB = 8 covers a 128-wide head at once).
template <int NB>
inline void update_head_avx512(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                               int64_t k_dim, int64_t v_dim, float* core) {
  const __m512 vdecay = _mm512_set1_ps(decay), vbeta = _mm512_set1_ps(beta);
  for (int64_t j0 = 0; j0 < v_dim; j0 += 16 * NB) {
    __m512 acc[NB], delta[NB];
    for (int n = 0; n < NB; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k_dim; ++i) {
      const __m512 ki = _mm512_set1_ps(k[i]);
      const float* row = S + i * v_dim + j0;
      for (int n = 0; n < NB; ++n) acc[n] = _mm512_fmadd_ps(ki, _mm512_loadu_ps(row + 16 * n), acc[n]);
    }
    for (int n = 0; n < NB; ++n) {
      const __m512 vv = _mm512_loadu_ps(v + j0 + 16 * n);
      delta[n] = _mm512_mul_ps(_mm512_sub_ps(vv, _mm512_mul_ps(vdecay, acc[n])), vbeta);
      acc[n] = _mm512_setzero_ps();  // now the read-out
    }
    for (int64_t i = 0; i < k_dim; ++i) {
      const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
      float* row = S + i * v_dim + j0;
      for (int n = 0; n < NB; ++n) {
        const __m512 updated = _mm512_fmadd_ps(ki, delta[n], _mm512_mul_ps(vdecay, _mm512_loadu_ps(row + 16 * n)));
        _mm512_storeu_ps(row + 16 * n, updated);
        acc[n] = _mm512_fmadd_ps(qi, updated, acc[n]);
      }
    }
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(core + j0 + 16 * n, acc[n]);
  }
}
#endif

inline void update_head(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                        int64_t k_dim, int64_t v_dim, float* ks, float* core) {
#ifdef __AVX512F__
  if (v_dim % 128 == 0) return update_head_avx512<8>(S, q, k, v, decay, beta, k_dim, v_dim, core);
  if (v_dim % 64 == 0) return update_head_avx512<4>(S, q, k, v, decay, beta, k_dim, v_dim, core);
  if (v_dim % 16 == 0) return update_head_avx512<1>(S, q, k, v, decay, beta, k_dim, v_dim, core);
#endif
  update_head_scalar(S, q, k, v, decay, beta, k_dim, v_dim, ks, core);
}

template <typename T>
void decode_step_impl(const at::Tensor& mixed, at::Tensor& window, const at::Tensor& conv_taps,
                      const c10::optional<at::Tensor>& conv_bias, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& neg_a_exp, const at::Tensor& dt_bias, const at::Tensor& z,
                      const at::Tensor& norm_weight, double norm_eps, at::Tensor& state, int64_t k_heads,
                      int64_t k_dim, int64_t v_dim, at::Tensor& out) {
  const int64_t batch = mixed.size(0), channels = mixed.size(1), kernel = window.size(1);
  const int64_t v_heads = state.size(1), key_dim = k_heads * k_dim, group = v_heads / k_heads;
  // mixed, a, b and z may be row views of one merged projection's output: rows strided, each contiguous
  const T* x = mixed.data_ptr<T>();
  const int64_t ld_x = mixed.stride(0), ld_a = a.stride(0), ld_b = b.stride(0), ld_z = z.stride(0);
  T* win = window.data_ptr<T>();
  const float* taps = conv_taps.data_ptr<float>();  // [kernel, channels]
  const float* bias = conv_bias.has_value() ? conv_bias->data_ptr<float>() : nullptr;
  const T* a_ptr = a.data_ptr<T>();
  const T* b_ptr = b.data_ptr<T>();
  const float* neg_a = neg_a_exp.data_ptr<float>();
  const float* dt = dt_bias.data_ptr<float>();
  const T* z_ptr = z.data_ptr<T>();
  const T* norm_w = norm_weight.data_ptr<T>();
  float* s_ptr = state.data_ptr<float>();
  T* o_ptr = out.data_ptr<T>();

  // Phase 1, per slot: conv step + SiLU (rounded to T as the torch path's output), the window
  // shifted by one token, q and k L2-normalised (q also scaled by 1/sqrt(k_dim)).
  at::Tensor scratch = at::empty({batch, channels}, mixed.options().dtype(at::kFloat));
  float* qkv = scratch.data_ptr<float>();
  const float q_scale = 1.f / std::sqrt(static_cast<float>(k_dim));
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      T* w = win + s * kernel * channels;  // row t: the input kernel-1-t tokens back
      const T* xs = x + s * ld_x;
      float* o = qkv + s * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] = to_float(w[channels + c]) * taps[c];
      for (int64_t t = 1; t < kernel - 1; ++t) {
        const T* row = w + (t + 1) * channels;
        const float* tap = taps + t * channels;
        for (int64_t c = 0; c < channels; ++c) o[c] += to_float(row[c]) * tap[c];
      }
      const float* last = taps + (kernel - 1) * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] += to_float(xs[c]) * last[c];
      if (bias)
        for (int64_t c = 0; c < channels; ++c) o[c] += bias[c];
      silu_inplace(o, channels);
      round_inplace<T>(o, channels);
      std::memmove(w, w + channels, sizeof(T) * (kernel - 1) * channels);
      std::memcpy(w + (kernel - 1) * channels, xs, sizeof(T) * channels);
      for (int64_t h = 0; h < 2 * k_heads; ++h) {  // q heads, then k heads
        float* v = o + h * k_dim;
        float scale = 1.f / std::sqrt(epd_vec::sum_squares(v, k_dim) + 1e-6f);  // transformers' l2norm: eps inside the root
        if (h < k_heads) scale *= q_scale;
        for (int64_t i = 0; i < k_dim; ++i) v[i] *= scale;
      }
    }
  });

  // Phase 2, per (slot, value head): the state update, the read-out and the gated RMSNorm.
  at::parallel_for(0, batch * v_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ks(v_dim), core(v_dim), gate(v_dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / v_heads, h = unit % v_heads, kh = h / group;
      const float* q = qkv + s * channels + kh * k_dim;
      const float* k = qkv + s * channels + key_dim + kh * k_dim;
      const float* v = qkv + s * channels + 2 * key_dim + h * v_dim;
      const float beta = round_to<T>(1.f / (1.f + std::exp(-to_float(b_ptr[s * ld_b + h]))));
      const float decay = std::exp(neg_a[h] * softplus(to_float(a_ptr[s * ld_a + h]) + dt[h]));
      float* S = s_ptr + unit * k_dim * v_dim;
      update_head(S, q, k, v, decay, beta, k_dim, v_dim, ks.data(), core.data());
      // gated RMSNorm: weight * norm(core) * silu(z), rounded where the torch path rounds
      round_inplace<T>(core.data(), v_dim);
      const float inv = 1.f / std::sqrt(epd_vec::sum_squares(core.data(), v_dim) / static_cast<float>(v_dim) +
                                        static_cast<float>(norm_eps));
      for (int64_t j = 0; j < v_dim; ++j) core[j] *= inv;
      round_inplace<T>(core.data(), v_dim);
      for (int64_t j = 0; j < v_dim; ++j) core[j] *= to_float(norm_w[j]);
      round_inplace<T>(core.data(), v_dim);
      const T* zs = z_ptr + s * ld_z + h * v_dim;
      for (int64_t j = 0; j < v_dim; ++j) gate[j] = to_float(zs[j]);
      silu_inplace(gate.data(), v_dim);
      for (int64_t j = 0; j < v_dim; ++j) core[j] *= gate[j];
      store_as<T>(o_ptr + unit * v_dim, core.data(), v_dim);
    }
  });
}

at::Tensor decode_step(const at::Tensor& mixed, at::Tensor window, const at::Tensor& conv_taps,
                       const c10::optional<at::Tensor>& conv_bias, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& neg_a_exp, const at::Tensor& dt_bias, const at::Tensor& z,
                       const at::Tensor& norm_weight, double norm_eps, at::Tensor state, int64_t k_heads,
                       int64_t k_dim, int64_t v_dim) {
  const auto dtype = mixed.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "epd_gdn.decode_step: float32 or bfloat16, got ",
              dtype);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&window, &norm_weight}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->device().is_cpu(),
                "epd_gdn.decode_step: the window and norm weight must be contiguous CPU tensors of ", dtype);
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&mixed, &a, &b, &z}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 2 && t->stride(1) == 1 && t->device().is_cpu(),
                "epd_gdn.decode_step: mixed, a, b and z must be 2-D CPU tensors of ", dtype,
                " with contiguous rows");
  }
  TORCH_CHECK(conv_taps.scalar_type() == at::kFloat && conv_taps.is_contiguous() && conv_taps.dim() == 2 &&
                  conv_taps.size(0) == window.size(1) && conv_taps.size(1) == mixed.size(1),
              "epd_gdn.decode_step: conv_taps must be contiguous float32 [kernel, conv_dim]");
  if (conv_bias.has_value())
    TORCH_CHECK(conv_bias->scalar_type() == at::kFloat && conv_bias->is_contiguous() &&
                conv_bias->numel() == mixed.size(1), "epd_gdn.decode_step: conv_bias must be float32 [conv_dim]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4,
              "epd_gdn.decode_step: the state must be contiguous float32 [batch, v_heads, k_dim, v_dim]");
  TORCH_CHECK(neg_a_exp.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat &&
              neg_a_exp.is_contiguous() && dt_bias.is_contiguous());
  const int64_t batch = mixed.size(0), v_heads = state.size(1);
  TORCH_CHECK(mixed.dim() == 2 && window.dim() == 3 && window.size(0) == batch && window.size(2) == mixed.size(1));
  TORCH_CHECK(state.size(0) == batch && state.size(2) == k_dim && state.size(3) == v_dim);
  TORCH_CHECK(v_heads % k_heads == 0 && mixed.size(1) == 2 * k_heads * k_dim + v_heads * v_dim);
  TORCH_CHECK(a.size(0) == batch && a.size(1) == v_heads && b.size(0) == batch && b.size(1) == v_heads &&
              z.size(0) == batch && z.size(1) == v_heads * v_dim);
  TORCH_CHECK(neg_a_exp.numel() == v_heads && dt_bias.numel() == v_heads && norm_weight.numel() == v_dim);
  at::Tensor out = at::empty({batch, v_heads * v_dim}, mixed.options());
  if (dtype == at::kFloat) {
    decode_step_impl<float>(mixed, window, conv_taps, conv_bias, a, b, neg_a_exp, dt_bias, z, norm_weight,
                            norm_eps, state, k_heads, k_dim, v_dim, out);
  } else {
    decode_step_impl<c10::BFloat16>(mixed, window, conv_taps, conv_bias, a, b, neg_a_exp, dt_bias, z,
                                    norm_weight, norm_eps, state, k_heads, k_dim, v_dim, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(epd_gdn, m) {
  m.def(
      "decode_step(Tensor mixed, Tensor(a!) window, Tensor conv_taps, Tensor? conv_bias, Tensor a, Tensor b, "
      "Tensor neg_a_exp, Tensor dt_bias, Tensor z, Tensor norm_weight, float norm_eps, Tensor(b!) state, "
      "int k_heads, int k_dim, int v_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(epd_gdn, CPU, m) { m.impl("decode_step", &decode_step); }
