// Hand-written CUDA C AdamW (fp32), the bandwidth baseline for `shardkit bench optim` on CUDA.
//
// Loaded with cupy.RawModule (NVRTC) by perf/optim.py; compiled to PTX without a
// device by tests/benchmarks/test_bench_smoke.py. Plain C: no headers, no templates, extern "C" names.
//
// Math, per element, fp32 (the same as shardkit.kernels.adam's Triton kernel, decoupled decay):
//     w = w * (1 - lr * wd)
//     m = b1 * m + (1 - b1) * g
//     v = b2 * v + (1 - b2) * g^2
//     w = w - step_size * m / (sqrt(v) / bc2_sqrt + eps)
// with step_size = lr / (1 - b1^t) and bc2_sqrt = sqrt(1 - b2^t) computed on the host.
//
// Bytes moved: read w, g, m, v (16 B) + write w, m, v (12 B) = 28 B per element, the lower
// bound for any fused AdamW (shared/REFERENCE.md), so GB/s = 28 * n / time.
//
// Layout contract: one flat buffer per role (the ideal case a multi-tensor kernel approaches).
// `adamw_fp32_vec4` takes float4 views (16-byte aligned, n4 = n / 4 vectors) and issues 128-bit
// loads/stores; `adamw_fp32` handles any tail (n % 4 elements) or unaligned buffers. Grid-stride
// loops with 64-bit indices, so any n and any grid size are correct.

__device__ __forceinline__ void adamw_update(
    float& w, float g, float& m, float& v,
    float beta1, float beta2, float eps, float decay, float step_size, float bc2_sqrt) {
  w = w * decay;
  m = fmaf(beta1, m, (1.0f - beta1) * g);
  v = fmaf(beta2, v, (1.0f - beta2) * g * g);
  w = w - step_size * m / (sqrtf(v) / bc2_sqrt + eps);
}

extern "C" __global__ void adamw_fp32_vec4(
    float4* __restrict__ p,        // params, n4 float4s, updated in place
    const float4* __restrict__ g,  // grads
    float4* __restrict__ m,        // exp_avg, updated in place
    float4* __restrict__ v,        // exp_avg_sq, updated in place
    long long n4,                  // number of float4 vectors
    float lr, float beta1, float beta2, float eps, float weight_decay,
    float step_size,               // lr / (1 - beta1^t)
    float bc2_sqrt) {              // sqrt(1 - beta2^t)
  const float decay = 1.0f - lr * weight_decay;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
    float4 w4 = p[i];
    const float4 g4 = g[i];
    float4 m4 = m[i];
    float4 v4 = v[i];
    adamw_update(w4.x, g4.x, m4.x, v4.x, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    adamw_update(w4.y, g4.y, m4.y, v4.y, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    adamw_update(w4.z, g4.z, m4.z, v4.z, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    adamw_update(w4.w, g4.w, m4.w, v4.w, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    p[i] = w4;
    m[i] = m4;
    v[i] = v4;
  }
}

extern "C" __global__ void adamw_fp32(
    float* __restrict__ p,
    const float* __restrict__ g,
    float* __restrict__ m,
    float* __restrict__ v,
    long long n,                   // number of elements
    float lr, float beta1, float beta2, float eps, float weight_decay,
    float step_size, float bc2_sqrt) {
  const float decay = 1.0f - lr * weight_decay;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float w = p[i], mi = m[i], vi = v[i];
    adamw_update(w, g[i], mi, vi, beta1, beta2, eps, decay, step_size, bc2_sqrt);
    p[i] = w;
    m[i] = mi;
    v[i] = vi;
  }
}
