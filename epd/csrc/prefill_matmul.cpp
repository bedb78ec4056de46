// epd's prefill matrix products on a CPU: float32 (and bfloat16) batched matmul through oneDNN.
//
// Why: ATen's float32 CPU bmm goes to MKL, which on this project's AMD CPUs runs the Gated
// DeltaNet chunk products ([heads, 32, 128] x [heads, 128, 128]) at ~95 GFLOP/s on one core;
// oneDNN, already inside libtorch_cpu, runs the same products ~2x faster with bit-identical
// results (docs/BENCHMARKS.md, "Prefill and vision CPU cost"). ATen only routes float32 matmuls
// to oneDNN when reduced-precision fp32 math (bf32/tf32) is allowed; the function it calls,
// at::native::mkldnn_matmul, is exported by libtorch_cpu and computes in strict float32 unless
// that mode is set. Built at first use by epd/kernels_prefill.py; registered as
// torch.ops.epd_prefill.bmm_out (no pybind: the build includes only ATen's and the op
// registry's headers).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace at {
namespace native {
void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result, float beta, float alpha);
}  // namespace native
}  // namespace at

namespace {

// out = beta * out + alpha * (a @ b), a [batch, M, K], b [batch, K, N], out [batch, M, N]
// (any strides oneDNN accepts; the caller checks shapes and dtypes)
void bmm_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, double beta, double alpha) {
  at::native::mkldnn_matmul(a, b, out, static_cast<float>(beta), static_cast<float>(alpha));
}

}  // namespace

TORCH_LIBRARY(epd_prefill, m) {
  m.def("bmm_out(Tensor a, Tensor b, Tensor(a!) out, float beta, float alpha) -> ()");
}

TORCH_LIBRARY_IMPL(epd_prefill, CPU, m) {
  m.impl("bmm_out", &bmm_out);
}
