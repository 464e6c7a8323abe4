// Element conversions shared by the CUDA kernels: float32 maths on float32/bfloat16/float16 data.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace te {

template <typename T>
__device__ __forceinline__ float ToF(T v);
template <>
__device__ __forceinline__ float ToF<float>(float v) { return v; }
template <>
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float ToF<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromF(float v);
template <>
__device__ __forceinline__ float FromF<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half FromF<__half>(float v) { return __float2half(v); }

}  // namespace te
