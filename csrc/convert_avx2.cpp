// AVX2 + FMA + F16C conversion kernel (built with -mavx2 -mfma -mf16c).
#include "convert.h"
#include "half.h"

#if defined(__x86_64__)
#include "vec_avx2.h"

#include "convert_body.h"

void rp::convert_range_avx2(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_dispatch(src, src_dt, dst, dst_dt, n);
}
#else  // not x86-64: never selected at run time, present only to link
void rp::convert_range_avx2(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_range_scalar(src, src_dt, dst, dst_dt, n);
}
#endif
