// Element-wise dtype conversion between fp32, bf16 and fp16 host buffers.
//
// The fused optimizer writes its low-precision upload copy and reads downloaded
// gradients with exactly these conversions; they are exposed on their own as
// the extension's smallest SIMD primitive (and tested bit-exact across levels).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rp {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);

// Converts n elements; multi-threaded with OpenMP above a size threshold.
// src and dst must not overlap unless they are the same dtype and pointer.
void convert(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n);

// Per-level single-threaded kernels (one translation unit each).
void convert_range_scalar(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n);
void convert_range_avx2(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n);
void convert_range_avx512(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n);

}  // namespace rp
