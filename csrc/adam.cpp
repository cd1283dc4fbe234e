// Scalar Adam kernel, the per-step coefficients and the group entry point.
//
// GCC contracts a * b + c into an fma whenever the target has one, even in
// ISO mode; the kernels must round each operation as torch does, so every
// Adam translation unit turns contraction off before any code.
#pragma GCC optimize("fp-contract=off")

#include "adam.h"

#include <cmath>

#include "multi_tensor.h"
#include "vec_scalar.h"

#include "adam_body.h"

namespace rp {

AdamCoeffs adam_coeffs(const AdamOptions& o, double step) {
  // torch: bias_correction1 = 1 - beta1 ** step, step_size = lr / bias_correction1,
  // bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5, all in double; each
  // scalar is rounded to fp32 where it meets the fp32 tensor.
  const double bc1 = 1.0 - std::pow(o.beta1, step);
  const double bc2 = 1.0 - std::pow(o.beta2, step);
  AdamCoeffs c{};
  c.grad_mul = static_cast<float>(o.grad_mul);
  c.maximize = o.maximize;
  c.l2 = o.weight_decay != 0.0 && !o.decoupled;
  c.decay_weight = o.weight_decay != 0.0 && o.decoupled;
  c.l2_decay = static_cast<float>(o.weight_decay);
  c.weight_scale = static_cast<float>(1.0 - o.lr * o.weight_decay);
  c.lerp_w = static_cast<float>(1.0 - o.beta1);
  c.lerp_w_m1 = c.lerp_w - 1.0f;
  c.lerp_small = std::fabs(c.lerp_w) < 0.5f;
  c.beta2 = static_cast<float>(o.beta2);
  c.sq_w = static_cast<float>(1.0 - o.beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  c.neg_step = static_cast<float>(-(o.lr / bc1));
  c.eps = static_cast<float>(o.eps);
  c.amsgrad = o.amsgrad;
  c.predict = static_cast<float>(o.predict);
  c.predicting = o.predict != 0.0;
  return c;
}

void adam_range_scalar(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end) {
  adam_dispatch<BF16K>(t, c, begin, end);
}

void adam_step(const AdamTensor* tensors, size_t count, const AdamOptions& opt) {
  step_group<AdamTensor, AdamCoeffs>(tensors, count, [&](const AdamTensor& t) { return adam_coeffs(opt, t.step); },
                                     adam_range_scalar, adam_range_avx2, adam_range_avx512);
}

}  // namespace rp
