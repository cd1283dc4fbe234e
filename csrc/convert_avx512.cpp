// AVX-512 F/BW/VL conversion kernel (built with -mavx512f -mavx512bw -mavx512vl
// -mavx2 -mfma -mf16c).  bf16 rounding is done with integer arithmetic, not
// vcvtneps2bf16: that instruction flushes fp32 denormals to zero, which would
// make this level differ bit-wise from the others and from torch.
#include "convert.h"
#include "half.h"

#if defined(__x86_64__)
#include "vec_avx512.h"

#include "convert_body.h"

void rp::convert_range_avx512(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_dispatch(src, src_dt, dst, dst_dt, n);
}
#else  // not x86-64: never selected at run time, present only to link
void rp::convert_range_avx512(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n) {
  convert_range_scalar(src, src_dt, dst, dst_dt, n);
}
#endif
