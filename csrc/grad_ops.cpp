// Scalar gradient kernels and the multi-threaded, level-dispatched entry points.
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "grad_ops.h"

#include <vector>

#include "cpu_features.h"
#include "multi_tensor.h"
#include "parallel.h"
#include "vec_scalar.h"

namespace {

struct Sq16 {
  double lane[16] = {};
  void add(size_t j, Vec x) {
    const double d = x;
    lane[j] = lane[j] + d * d;
  }
  void get(double* out) const {
    for (size_t j = 0; j < 16; ++j) out[j] = lane[j];
  }
};

}  // namespace

#include "grad_ops_body.h"

namespace rp {

double sumsq_range_scalar(const void* src, DType dt, size_t n) { return sumsq_dispatch(src, dt, n); }

void accumulate_range_scalar(float* dst, const void* src, DType dt, size_t n) {
  accumulate_dispatch(dst, src, dt, n);
}

double grad_sumsq(const GradRef* grads, size_t count) {
  using Fn = double (*)(const void*, DType, size_t);
  Fn fn = sumsq_range_scalar;
  switch (simd_level()) {
    case SimdLevel::Avx512: fn = sumsq_range_avx512; break;
    case SimdLevel::Avx2: fn = sumsq_range_avx2; break;
    default: break;
  }
  std::vector<size_t> sizes(count);
  for (size_t k = 0; k < count; ++k) sizes[k] = grads[k].n;
  TensorRanges ranges(sizes.data(), count, 32, size_t{1} << 16);
  // One partial per thread, each summed in tensor order, then added in thread
  // order: deterministic for a given thread count.
  std::vector<double> partial(static_cast<size_t>(ranges.threads()), 0.0);
  ranges.run([&](int t, size_t k, size_t b, size_t e) {
    const char* base = static_cast<const char*>(grads[k].data) + b * dtype_size(grads[k].dtype);
    partial[static_cast<size_t>(t)] += fn(base, grads[k].dtype, e - b);
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

void accumulate(float* dst, const void* src, DType src_dtype, size_t n) {
  using Fn = void (*)(float*, const void*, DType, size_t);
  Fn fn = accumulate_range_scalar;
  switch (simd_level()) {
    case SimdLevel::Avx512: fn = accumulate_range_avx512; break;
    case SimdLevel::Avx2: fn = accumulate_range_avx2; break;
    default: break;
  }
  const size_t ss = dtype_size(src_dtype);
  parallel_ranges(n, 32, size_t{1} << 16, [&](size_t b, size_t e) {
    fn(dst + b, static_cast<const char*>(src) + b * ss, src_dtype, e - b);
  });
}

}  // namespace rp
