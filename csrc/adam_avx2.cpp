// AVX2 + FMA + F16C Adam kernel (see adam_body.h for the arithmetic).
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "adam.h"

#if defined(__x86_64__)
#include "vec_avx2.h"

#include "adam_body.h"

void rp::adam_range_avx2(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end) {
  adam_dispatch<BF16K>(t, c, begin, end);
}
#else  // not x86-64: never selected at run time, present only to link
void rp::adam_range_avx2(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end) {
  adam_range_scalar(t, c, begin, end);
}
#endif
