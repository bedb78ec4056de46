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

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline float round_to(float x) {  // x rounded to T and back (identity for float)
  return static_cast<float>(static_cast<T>(x));
}

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

template <typename T>
void decode_step_impl(const at::Tensor& mixed, at::Tensor& window, const at::Tensor& conv_weight,
                      const c10::optional<at::Tensor>& conv_bias, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& neg_a_exp, const at::Tensor& dt_bias, const at::Tensor& z,
                      const at::Tensor& norm_weight, double norm_eps, at::Tensor& state, int64_t k_heads,
                      int64_t k_dim, int64_t v_dim, at::Tensor& out) {
  const int64_t batch = mixed.size(0), channels = mixed.size(1), kernel = window.size(1);
  const int64_t v_heads = state.size(1), key_dim = k_heads * k_dim, group = v_heads / k_heads;
  const T* x = mixed.data_ptr<T>();
  T* win = window.data_ptr<T>();
  const T* weight = conv_weight.data_ptr<T>();  // [channels, kernel]
  const T* bias = conv_bias.has_value() ? conv_bias->data_ptr<T>() : nullptr;
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
    std::vector<float> taps(kernel * channels);  // [kernel, channels], float32 as the torch path's
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t t = 0; t < kernel; ++t) taps[t * channels + c] = to_float(weight[c * kernel + t]);
    for (int64_t s = begin; s < end; ++s) {
      T* w = win + s * kernel * channels;  // row t: the input kernel-1-t tokens back
      const T* xs = x + s * channels;
      float* o = qkv + s * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] = to_float(w[channels + c]) * taps[c];
      for (int64_t t = 1; t < kernel - 1; ++t) {
        const T* row = w + (t + 1) * channels;
        const float* tap = taps.data() + t * channels;
        for (int64_t c = 0; c < channels; ++c) o[c] += to_float(row[c]) * tap[c];
      }
      const float* last = taps.data() + (kernel - 1) * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] += to_float(xs[c]) * last[c];
      if (bias)
        for (int64_t c = 0; c < channels; ++c) o[c] += to_float(bias[c]);
      for (int64_t c = 0; c < channels; ++c) o[c] = round_to<T>(o[c] / (1.f + std::exp(-o[c])));
      std::memmove(w, w + channels, sizeof(T) * (kernel - 1) * channels);
      std::memcpy(w + (kernel - 1) * channels, xs, sizeof(T) * channels);
      for (int64_t h = 0; h < 2 * k_heads; ++h) {  // q heads, then k heads
        float* v = o + h * k_dim;
        float sum = 0.f;
        for (int64_t i = 0; i < k_dim; ++i) sum += v[i] * v[i];
        float scale = 1.f / std::sqrt(sum + 1e-6f);  // transformers' l2norm: eps inside the root
        if (h < k_heads) scale *= q_scale;
        for (int64_t i = 0; i < k_dim; ++i) v[i] *= scale;
      }
    }
  });

  // Phase 2, per (slot, value head): the state update, the read-out and the gated RMSNorm.
  at::parallel_for(0, batch * v_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ks(v_dim), delta(v_dim), core(v_dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / v_heads, h = unit % v_heads, kh = h / group;
      const float* q = qkv + s * channels + kh * k_dim;
      const float* k = qkv + s * channels + key_dim + kh * k_dim;
      const float* v = qkv + s * channels + 2 * key_dim + h * v_dim;
      const float beta = round_to<T>(1.f / (1.f + std::exp(-to_float(b_ptr[s * v_heads + h]))));
      const float decay = std::exp(neg_a[h] * softplus(to_float(a_ptr[s * v_heads + h]) + dt[h]));
      float* S = s_ptr + unit * k_dim * v_dim;
      std::fill(ks.begin(), ks.end(), 0.f);
      for (int64_t i = 0; i < k_dim; ++i) {
        const float ki = k[i];
        const float* row = S + i * v_dim;
        for (int64_t j = 0; j < v_dim; ++j) ks[j] += ki * row[j];
      }
      for (int64_t j = 0; j < v_dim; ++j) {
        delta[j] = (v[j] - decay * ks[j]) * beta;
        core[j] = 0.f;
      }
      for (int64_t i = 0; i < k_dim; ++i) {
        const float ki = k[i], qi = q[i];
        float* row = S + i * v_dim;
        for (int64_t j = 0; j < v_dim; ++j) {
          const float updated = decay * row[j] + ki * delta[j];
          row[j] = updated;
          core[j] += qi * updated;
        }
      }
      // gated RMSNorm: weight * norm(core) * silu(z), rounded where the torch path rounds
      float sum = 0.f;
      for (int64_t j = 0; j < v_dim; ++j) {
        core[j] = round_to<T>(core[j]);
        sum += core[j] * core[j];
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(v_dim) + static_cast<float>(norm_eps));
      const T* zs = z_ptr + unit * v_dim;
      T* os = o_ptr + unit * v_dim;
      for (int64_t j = 0; j < v_dim; ++j) {
        const float normed = round_to<T>(round_to<T>(core[j] * inv) * to_float(norm_w[j]));
        const float gate = to_float(zs[j]);
        os[j] = static_cast<T>(normed * (gate / (1.f + std::exp(-gate))));
      }
    }
  });
}

at::Tensor decode_step(const at::Tensor& mixed, at::Tensor window, const at::Tensor& conv_weight,
                       const c10::optional<at::Tensor>& conv_bias, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& neg_a_exp, const at::Tensor& dt_bias, const at::Tensor& z,
                       const at::Tensor& norm_weight, double norm_eps, at::Tensor state, int64_t k_heads,
                       int64_t k_dim, int64_t v_dim) {
  const auto dtype = mixed.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "epd_gdn.decode_step: float32 or bfloat16, got ",
              dtype);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&mixed, &window, &conv_weight, &a, &b, &z, &norm_weight}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->device().is_cpu(),
                "epd_gdn.decode_step: every model-dtype input must be a contiguous CPU tensor of ", dtype);
  }
  if (conv_bias.has_value()) TORCH_CHECK(conv_bias->scalar_type() == dtype && conv_bias->is_contiguous());
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4,
              "epd_gdn.decode_step: the state must be contiguous float32 [batch, v_heads, k_dim, v_dim]");
  TORCH_CHECK(neg_a_exp.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat &&
              neg_a_exp.is_contiguous() && dt_bias.is_contiguous());
  const int64_t batch = mixed.size(0), v_heads = state.size(1);
  TORCH_CHECK(mixed.dim() == 2 && window.dim() == 3 && window.size(0) == batch && window.size(2) == mixed.size(1));
  TORCH_CHECK(state.size(0) == batch && state.size(2) == k_dim && state.size(3) == v_dim);
  TORCH_CHECK(v_heads % k_heads == 0 && mixed.size(1) == 2 * k_heads * k_dim + v_heads * v_dim);
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == mixed.size(1) && conv_weight.size(1) == window.size(1));
  TORCH_CHECK(a.numel() == batch * v_heads && b.numel() == batch * v_heads && z.numel() == batch * v_heads * v_dim);
  TORCH_CHECK(neg_a_exp.numel() == v_heads && dt_bias.numel() == v_heads && norm_weight.numel() == v_dim);
  at::Tensor out = at::empty({batch, v_heads * v_dim}, mixed.options());
  if (dtype == at::kFloat) {
    decode_step_impl<float>(mixed, window, conv_weight, conv_bias, a, b, neg_a_exp, dt_bias, z, norm_weight,
                            norm_eps, state, k_heads, k_dim, v_dim, out);
  } else {
    decode_step_impl<c10::BFloat16>(mixed, window, conv_weight, conv_bias, a, b, neg_a_exp, dt_bias, z,
                                    norm_weight, norm_eps, state, k_heads, k_dim, v_dim, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(epd_gdn, m) {
  m.def(
      "decode_step(Tensor mixed, Tensor(a!) window, Tensor conv_weight, Tensor? conv_bias, Tensor a, Tensor b, "
      "Tensor neg_a_exp, Tensor dt_bias, Tensor z, Tensor norm_weight, float norm_eps, Tensor(b!) state, "
      "int k_heads, int k_dim, int v_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(epd_gdn, CPU, m) { m.impl("decode_step", &decode_step); }
