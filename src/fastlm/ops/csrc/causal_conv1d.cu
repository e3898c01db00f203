// Depthwise causal conv1d forward over channels-last u (B, L, D), weight (D, K), optional bias (D,),
// optional SiLU: the CUDA C++ counterpart of fastlm/ops/causal_conv1d.py's Triton forward.
//
// One thread owns one channel d of one batch row and a chunk of kRows consecutive positions. It
// keeps the last K inputs of its channel in a register window, so every u element is read from
// global memory once per chunk (plus K - 1 halo rows); consecutive threads take consecutive
// channels, so each warp's loads and stores of a row are coalesced.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace {

constexpr int kRows = 64;     // positions per thread
constexpr int kThreads = 128; // channels per block

// at::Half and at::BFloat16 convert to and from float on the device
template <typename T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename T, int K>
__global__ void causal_conv1d_forward_kernel(const T* __restrict__ u, const T* __restrict__ weight,
                                             const T* __restrict__ bias, T* __restrict__ out, int64_t length,
                                             int64_t channels, bool silu) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (d >= channels) return;
  const int64_t start = static_cast<int64_t>(blockIdx.y) * kRows;
  const int64_t batch = blockIdx.z;
  const T* u_channel = u + batch * length * channels + d;
  T* out_channel = out + batch * length * channels + d;

  float w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = to_float(weight[d * K + k]);
  const float b = bias != nullptr ? to_float(bias[d]) : 0.0f;

  // window[k] holds u[l - (K - 1) + k]; positions before 0 are the zero padding
  float window[K];
#pragma unroll
  for (int k = 0; k < K - 1; ++k) {
    const int64_t l = start - (K - 1) + k;
    window[k] = l >= 0 ? to_float(u_channel[l * channels]) : 0.0f;
  }
  const int64_t end = start + kRows < length ? start + kRows : length;
  for (int64_t l = start; l < end; ++l) {
    window[K - 1] = to_float(u_channel[l * channels]);
    float z = b;
#pragma unroll
    for (int k = 0; k < K; ++k) z += w[k] * window[k];
    if (silu) z = z / (1.0f + __expf(-z));
    out_channel[l * channels] = static_cast<T>(z);
#pragma unroll
    for (int k = 0; k < K - 1; ++k) window[k] = window[k + 1];
  }
}

template <typename T, int K>
void launch(const torch::Tensor& u, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
            torch::Tensor& out, bool silu) {
  const int64_t batch = u.size(0), length = u.size(1), channels = u.size(2);
  const dim3 grid((channels + kThreads - 1) / kThreads, (length + kRows - 1) / kRows, batch);
  const T* bias_ptr = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  causal_conv1d_forward_kernel<T, K><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      u.data_ptr<T>(), weight.data_ptr<T>(), bias_ptr, out.data_ptr<T>(), length, channels, silu);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_kernel_size(const torch::Tensor& u, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias, torch::Tensor& out, bool silu) {
  switch (weight.size(1)) {
    case 1: return launch<T, 1>(u, weight, bias, out, silu);
    case 2: return launch<T, 2>(u, weight, bias, out, silu);
    case 3: return launch<T, 3>(u, weight, bias, out, silu);
    case 4: return launch<T, 4>(u, weight, bias, out, silu);
    case 5: return launch<T, 5>(u, weight, bias, out, silu);
    case 6: return launch<T, 6>(u, weight, bias, out, silu);
    case 7: return launch<T, 7>(u, weight, bias, out, silu);
    case 8: return launch<T, 8>(u, weight, bias, out, silu);
    default: TORCH_CHECK(false, "causal_conv1d: kernel size must be 1 to 8, got ", weight.size(1));
  }
}

}  // namespace

torch::Tensor forward(torch::Tensor u, torch::Tensor weight, c10::optional<torch::Tensor> bias, bool silu) {
  TORCH_CHECK(u.is_cuda() && u.dim() == 3 && u.is_contiguous(), "u must be a contiguous CUDA tensor (B, L, D)");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == u.size(2) && weight.is_contiguous(),
              "weight must be a contiguous (D, K) tensor");
  TORCH_CHECK(weight.scalar_type() == u.scalar_type(), "weight must have u's dtype");
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == u.size(2) && bias->scalar_type() == u.scalar_type() && bias->is_contiguous(),
                "bias must be a contiguous (D,) tensor of u's dtype");
  }
  TORCH_CHECK(u.size(0) <= 65535 && (u.size(1) + kRows - 1) / kRows <= 65535,
              "causal_conv1d (cuda): at most 65535 sequences of at most ", 65535 * kRows, " positions");
  const c10::cuda::OptionalCUDAGuard guard(u.device());  // launch on u's GPU, not the current one
  auto out = torch::empty_like(u);
  if (u.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, u.scalar_type(),
                                  "causal_conv1d_forward",
                                  [&] { dispatch_kernel_size<scalar_t>(u, weight, bias, out, silu); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "depthwise causal conv1d forward (B, L, D) x (D, K)");
}
