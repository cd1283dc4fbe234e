// Gradient passes the engine runs around the optimizer step.
//
//  * grad_sumsq: the sum of squares over all gradients of a group, read in the
//    dtype they were downloaded in, for global-norm clipping.  Each element is
//    squared exactly in double and summed in 16 fixed lanes, so the result is
//    the same at every SIMD level (for a given thread count), and it is finite
//    if and only if every gradient element is: one read pass gives both the
//    norm and the inf/NaN check that decides whether a loss-scaled step runs.
//  * accumulate: dst (fp32) += src (fp32, bf16 or fp16), for gradient
//    accumulation across micro-batches into an fp32 buffer.
#pragma once

#include <cstddef>

#include "convert.h"

namespace rp {

struct GradRef {
  const void* data = nullptr;
  DType dtype = DType::F32;
  size_t n = 0;
};

double grad_sumsq(const GradRef* grads, size_t count);
void accumulate(float* dst, const void* src, DType src_dtype, size_t n);

// Per-level kernels, single-threaded.  sumsq returns the lane-reduced sum of
// one range; its 16 lanes are indexed from the range start.
double sumsq_range_scalar(const void* src, DType dt, size_t n);
double sumsq_range_avx2(const void* src, DType dt, size_t n);
double sumsq_range_avx512(const void* src, DType dt, size_t n);
void accumulate_range_scalar(float* dst, const void* src, DType dt, size_t n);
void accumulate_range_avx2(float* dst, const void* src, DType dt, size_t n);
void accumulate_range_avx512(float* dst, const void* src, DType dt, size_t n);

}  // namespace rp
