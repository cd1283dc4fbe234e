// Scalar SGD / Adagrad / Lion kernel, the per-step coefficients and the group
// entry point.
#pragma GCC optimize("fp-contract=off")  // each operation rounds once, as torch's: see adam.cpp

#include "optimizers.h"

#include "multi_tensor.h"
#include "vec_scalar.h"

#include "optimizers_body.h"

namespace rp {

OptimCoeffs optim_coeffs(const OptimOptions& o, const OptimTensor& t) {
  OptimCoeffs c{};
  c.kind = o.kind;
  c.grad_mul = static_cast<float>(o.grad_mul);
  c.maximize = o.maximize;
  c.decay = o.weight_decay != 0.0;
  c.weight_decay = static_cast<float>(o.weight_decay);
  c.weight_scale = static_cast<float>(1.0 - o.lr * o.weight_decay);
  c.neg_lr = static_cast<float>(-o.lr);
  c.predict = static_cast<float>(o.predict);
  c.predicting = o.predict != 0.0;
  switch (o.kind) {
    case OptimKind::Sgd:
      c.momentum = o.momentum != 0.0;
      c.first = t.first;
      c.nesterov = o.nesterov;
      c.a = static_cast<float>(o.momentum);
      c.b = static_cast<float>(1.0 - o.dampening);
      break;
    case OptimKind::Adagrad:
      // torch: clr = lr / (1 + (step - 1) * lr_decay) in double, rounded where it meets the tensor.
      c.neg_lr = static_cast<float>(-(o.lr / (1.0 + (t.step - 1.0) * o.lr_decay)));
      c.eps = static_cast<float>(o.eps);
      break;
    case OptimKind::Lion:
      c.a = static_cast<float>(o.beta1);
      c.b = static_cast<float>(1.0 - o.beta1);
      c.c = static_cast<float>(o.beta2);
      c.d = static_cast<float>(1.0 - o.beta2);
      break;
  }
  return c;
}

void optim_range_scalar(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end) {
  optim_dispatch<BF16K>(t, c, begin, end);
}

void optim_step(const OptimTensor* tensors, size_t count, const OptimOptions& opt) {
  step_group<OptimTensor, OptimCoeffs>(tensors, count, [&](const OptimTensor& t) { return optim_coeffs(opt, t); },
                                       optim_range_scalar, optim_range_avx2, optim_range_avx512);
}

}  // namespace rp
