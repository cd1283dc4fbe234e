// AVX2 + FMA + F16C gradient kernels (see grad_ops_body.h).
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "grad_ops.h"

#if defined(__x86_64__)
#include "vec_avx2.h"

namespace {

struct Sq16 {
  __m256d lane[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  void add(size_t j, Vec x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lane[2 * j] = _mm256_add_pd(lane[2 * j], _mm256_mul_pd(lo, lo));
    lane[2 * j + 1] = _mm256_add_pd(lane[2 * j + 1], _mm256_mul_pd(hi, hi));
  }
  void get(double* out) const {
    for (size_t j = 0; j < 4; ++j) _mm256_storeu_pd(out + 4 * j, lane[j]);
  }
};

}  // namespace

#include "grad_ops_body.h"

double rp::sumsq_range_avx2(const void* src, DType dt, size_t n) { return sumsq_dispatch(src, dt, n); }
void rp::accumulate_range_avx2(float* dst, const void* src, DType dt, size_t n) { accumulate_dispatch(dst, src, dt, n); }
#else  // not x86-64: never selected at run time, present only to link
double rp::sumsq_range_avx2(const void* src, DType dt, size_t n) { return sumsq_range_scalar(src, dt, n); }
void rp::accumulate_range_avx2(float* dst, const void* src, DType dt, size_t n) {
  accumulate_range_scalar(dst, src, dt, n);
}
#endif
