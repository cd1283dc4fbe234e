// Scalar 8-bit Adam kernel, the per-step coefficients and the group entry point.
#pragma GCC optimize("fp-contract=off")  // each operation rounds once, as torch's: see adam.cpp

#include "adam8bit.h"

#include <cmath>

#include "multi_tensor.h"
#include "vec_scalar.h"

#include "adam8bit_body.h"

namespace rp {

Adam8bitCoeffs adam8bit_coeffs(const AdamOptions& o, double step, const Adam8bitTables& tables) {
  Adam8bitCoeffs c{};
  c.adam = adam_coeffs(o, step);   // -lr / (1 - beta1 ** step), 1 - beta1, 1 - beta2, ... as bitsandbytes rounds them
  c.adam.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, step)));  // math.sqrt, not ** 0.5
  c.beta1 = static_cast<float>(o.beta1);
  c.tables = tables;
  return c;
}

void adam8bit_range_scalar(const Adam8bitTensor& t, const Adam8bitCoeffs& c, size_t begin, size_t end) {
  adam8bit_dispatch<BF16K>(t, c, begin, end);
}

void adam8bit_step(const Adam8bitTensor* tensors, size_t count, const AdamOptions& opt,
                   const Adam8bitTables& tables) {
  step_group<Adam8bitTensor, Adam8bitCoeffs>(
      tensors, count, [&](const Adam8bitTensor& t) { return adam8bit_coeffs(opt, t.step, tables); },
      adam8bit_range_scalar, adam8bit_range_avx2, adam8bit_range_avx512, kQuantBlock);
}

}  // namespace rp
