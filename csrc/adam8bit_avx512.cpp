// AVX-512 8-bit Adam kernel (see adam8bit_body.h for the arithmetic).
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "adam8bit.h"

#if defined(__x86_64__)
#include "vec_avx512.h"

#include "adam8bit_body.h"

void rp::adam8bit_range_avx512(const Adam8bitTensor& t, const Adam8bitCoeffs& c, size_t begin, size_t end) {
  // The bf16 shadow's store kind (vec_avx512.h): vcvtneps2bf16 and streaming where possible.
  with_bf16_store(t.shadow, t.shadow_dtype == DType::BF16, begin,
                  [&](auto out) { adam8bit_dispatch<decltype(out)>(t, c, begin, end); });
}
#else  // not x86-64: never selected at run time, present only to link
void rp::adam8bit_range_avx512(const Adam8bitTensor& t, const Adam8bitCoeffs& c, size_t begin, size_t end) {
  adam8bit_range_scalar(t, c, begin, end);
}
#endif
