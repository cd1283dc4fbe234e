// Fused SGD, Adagrad and Lion steps over a group of fp32 master tensors.
//
// The three optimizers beyond Adam that keep (at most) one fp32 state buffer
// per parameter: SGD's momentum buffer, Adagrad's sum of squares, Lion's
// exp_avg.  As in adam.h, one sweep per element reads the gradient in its own
// dtype (fp32, bf16 or fp16), multiplies it by grad_mul (clip_coef /
// loss_scale), updates the fp32 weight and state, and optionally writes the
// weight's low-precision upload ("shadow") copy: 20 bytes per parameter with
// bf16 gradient and shadow (12 for SGD without momentum).
//
// Arithmetic, each step one fp32 rounding (fma: one rounding for a * b + c):
//   all      g = load(grad) * grad_mul;  maximize: g = g * -1
//   SGD      wd: g = fma(p, wd, g)
//            momentum: buf = first ? g : fma(g, 1 - dampening, buf * momentum)
//                      g = nesterov ? fma(buf, momentum, g) : buf
//            p = fma(g, -lr, p)
//   Adagrad  wd: g = fma(p, wd, g);  sum = fma(g, g, sum)
//            p = p + (-clr * g) / (sqrt(sum) + eps),  clr = lr / (1 + (step - 1) * lr_decay)
//   Lion     wd: p = p * (1 - lr * wd)
//            p = fma(sign(fma(g, 1 - beta1, m * beta1)), -lr, p)
//            m = fma(g, 1 - beta2, m * beta2)
// SGD equals torch.optim.SGD (single-tensor, foreach and fused alike) bit for
// bit, Adagrad torch.optim.Adagrad(fused=True) (its single-tensor path takes
// MKL's sqrt, an ulp off for some inputs); Lion is Chen et al. 2023's
// Algorithm 2 with decoupled weight decay.  All SIMD levels are bit-identical
// (tails run through the vector body on a zero-padded copy, as in Adam).
//
// Nothing here validates: the bindings check dtypes, sizes, null pointers and
// overlaps before calling.
#pragma once

#include <cstddef>
#include <cstdint>

#include "convert.h"
#include "step_tensor.h"

namespace rp {

enum class OptimKind : int { Sgd = 0, Adagrad = 1, Lion = 2 };

// Options shared by every tensor of a group, as given by the user.  Fields an
// optimizer does not have are ignored (SGD: momentum, dampening, nesterov;
// Adagrad: lr_decay, eps; Lion: beta1, beta2).
struct OptimOptions {
  OptimKind kind = OptimKind::Sgd;
  double lr = 1e-3;
  double weight_decay = 0.0;   // SGD/Adagrad: L2 term in the gradient; Lion: decoupled
  double momentum = 0.0, dampening = 0.0;
  bool nesterov = false;
  double lr_decay = 0.0, eps = 1e-10;
  double beta1 = 0.9, beta2 = 0.99;
  bool maximize = false;
  double grad_mul = 1.0;       // gradient multiplier: clip_coef / loss_scale
  double predict = 0.0;        // shadow = p + predict * (p - p_before): predicted next weights (0: p)
};

// One tensor of a group.  state is the momentum buffer (null for SGD without
// momentum), the sum or exp_avg; shadow may be null.  step: Adagrad's step
// number after this update (1 for the first); first: SGD's momentum buffer is
// new and takes the gradient as it is.
struct OptimTensor : StepTensor {
  float* state = nullptr;
  double step = 1;
  bool first = false;
};

// The per-tensor fp32 constants of one step, rounded from the double options
// where torch rounds its scalars.  a, b: SGD momentum and 1 - dampening; Lion
// beta1 and 1 - beta1 (c, d: beta2 and 1 - beta2).
struct OptimCoeffs {
  OptimKind kind;
  float grad_mul, weight_decay, weight_scale, neg_lr, eps, a, b, c, d, predict;
  bool maximize, decay, momentum, first, nesterov, predicting;
};

OptimCoeffs optim_coeffs(const OptimOptions& opt, const OptimTensor& t);

// Updates every tensor of the group in one OpenMP region (multi_tensor.h).
void optim_step(const OptimTensor* tensors, size_t count, const OptimOptions& opt);

// Per-level kernels: elements [begin, end) of one tensor, single-threaded.
void optim_range_scalar(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end);
void optim_range_avx2(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end);
void optim_range_avx512(const OptimTensor& t, const OptimCoeffs& c, size_t begin, size_t end);

}  // namespace rp
