// AVX2 + FMA + F16C SGD / Adagrad / Lion kernel (see optimizers.h for the arithmetic).
#pragma GCC optimize("fp-contract=off")  // see adam.cpp

#include "optimizers.h"

#if defined(__x86_64__)
#include "vec_avx2.h"

#include "optimizers_body.h"

void rp::optim_range_avx2(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end) {
  optim_dispatch<BF16K>(t, c, begin, end);
}
#else  // not x86-64: never selected at run time, present only to link
void rp::optim_range_avx2(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end) {
  optim_range_scalar(t, c, begin, end);
}
#endif
