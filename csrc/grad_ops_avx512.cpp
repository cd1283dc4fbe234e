// AVX-512 gradient kernels (see grad_ops_body.h).
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "grad_ops.h"

#if defined(__x86_64__)
#include "vec_avx512.h"

namespace {

struct Sq16 {
  __m512d lane[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
  void add(size_t, Vec x) {  // one vector fills all 16 lanes, so j is always 0
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lane[0] = _mm512_add_pd(lane[0], _mm512_mul_pd(lo, lo));
    lane[1] = _mm512_add_pd(lane[1], _mm512_mul_pd(hi, hi));
  }
  void get(double* out) const {
    _mm512_storeu_pd(out, lane[0]);
    _mm512_storeu_pd(out + 8, lane[1]);
  }
};

}  // namespace

#include "grad_ops_body.h"

double rp::sumsq_range_avx512(const void* src, DType dt, size_t n) { return sumsq_dispatch(src, dt, n); }
void rp::accumulate_range_avx512(float* dst, const void* src, DType dt, size_t n) {
  accumulate_dispatch(dst, src, dt, n);
}
#else  // not x86-64: never selected at run time, present only to link
double rp::sumsq_range_avx512(const void* src, DType dt, size_t n) { return sumsq_range_scalar(src, dt, n); }
void rp::accumulate_range_avx512(float* dst, const void* src, DType dt, size_t n) {
  accumulate_range_scalar(dst, src, dt, n);
}
#endif
