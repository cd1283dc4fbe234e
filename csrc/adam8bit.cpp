// Scalar 8-bit Adam kernel, the per-step coefficients and the group entry point.
#pragma GCC optimize("fp-contract=off")  // each operation rounds once, as torch's: see adam.cpp

#include "adam8bit.h"

#include <cmath>

#include "multi_tensor.h"
#include "vec_scalar.h"

#include "adam8bit_body.h"

namespace rp {

Adam8bitCoeffs adam8bit_coeffs(const AdamOptions& o, double step, const Adam8bitTables& tables) {
  // bitsandbytes: correction1 = 1 - beta1 ** step, correction2 = math.sqrt(1 - beta2 ** step),
  // step size -lr / correction1, in double; each rounded to fp32 where it meets a tensor.
  Adam8bitCoeffs c{};
  c.grad_mul = static_cast<float>(o.grad_mul);
  c.maximize = o.maximize;
  c.l2 = o.weight_decay != 0.0 && !o.decoupled;
  c.decay_weight = o.weight_decay != 0.0 && o.decoupled;
  c.l2_decay = static_cast<float>(o.weight_decay);
  c.weight_scale = static_cast<float>(1.0 - o.lr * o.weight_decay);
  c.beta1 = static_cast<float>(o.beta1);
  c.lerp_w = static_cast<float>(1.0 - o.beta1);
  c.beta2 = static_cast<float>(o.beta2);
  c.sq_w = static_cast<float>(1.0 - o.beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, step)));
  c.neg_step = static_cast<float>(-o.lr / (1.0 - std::pow(o.beta1, step)));
  c.eps = static_cast<float>(o.eps);
  c.predict = static_cast<float>(o.predict);
  c.predicting = o.predict != 0.0;
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
