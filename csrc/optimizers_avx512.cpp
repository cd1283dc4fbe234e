// AVX-512 SGD / Adagrad / Lion kernel (see optimizers.h for the arithmetic).
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "optimizers.h"

#if defined(__x86_64__)
#include "vec_avx512.h"

#include "optimizers_body.h"

void rp::optim_range_avx512(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end) {
  // The bf16 shadow's store kind (vec_avx512.h): vcvtneps2bf16 and streaming where possible.
  with_bf16_store(t.shadow, t.shadow_dtype == DType::BF16, begin,
                  [&](auto out) { optim_dispatch<decltype(out)>(t, c, begin, end); });
}
#else  // not x86-64: never selected at run time, present only to link
void rp::optim_range_avx512(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end) {
  optim_range_scalar(t, c, begin, end);
}
#endif
