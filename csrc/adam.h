// Fused Adam / AdamW step over a group of fp32 master tensors.
//
// One sweep per element reads the gradient in the dtype it was downloaded in
// (fp32, bf16 or fp16), scales it (inverse loss scale x clipping factor),
// updates the fp32 weight and both moments, and optionally writes the weight's
// low-precision "shadow" copy that the next upload reads: 28 bytes per
// parameter with bf16 gradient and shadow, against ~3x that for the torch
// sequence upcast -> unscale -> AdamW(fused) -> downcast.
//
// Arithmetic follows torch's fused CPU AdamW operation by operation (same
// fp32 roundings, same fma in the first-moment lerp), so fp32 results equal
// torch.optim.AdamW(fused=True) bit for bit.  All SIMD levels are
// bit-identical: a tail shorter than a vector is run through the vector body
// on a zero-padded copy instead of a separate scalar loop.
//
// Nothing here validates: the bindings check dtypes, sizes, null pointers and
// overlaps before calling.
#pragma once

#include <cstddef>
#include <cstdint>

#include "convert.h"
#include "step_tensor.h"

namespace rp {

// Options shared by every tensor of a group, as given by the user (doubles,
// rounded to fp32 where torch rounds them).
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;   // AdamW (decay the weight) vs Adam (L2 term in the gradient)
  bool amsgrad = false;
  bool maximize = false;
  double grad_mul = 1.0;   // gradient multiplier: clip_coef / loss_scale
  double predict = 0.0;    // shadow = p + predict * (p - p_before): predicted next weights (0: p)
};

// One tensor of a group.  max_exp_avg_sq is used only with amsgrad; shadow
// may be null (no low-precision copy).  step is the step number after this
// update (1 for the first), for bias correction.
struct AdamTensor : StepTensor {
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;
  double step = 1;
};

// The per-tensor fp32 constants of one step, derived from AdamOptions and the
// step number exactly as torch derives them (double math, then one rounding).
struct AdamCoeffs {
  float grad_mul, l2_decay, weight_scale, lerp_w, lerp_w_m1, beta2, sq_w, bc2_sqrt, neg_step, eps, predict;
  bool maximize, l2, decay_weight, lerp_small, amsgrad, predicting;
};

AdamCoeffs adam_coeffs(const AdamOptions& opt, double step);

// Updates every tensor of the group in one OpenMP region whose ranges are
// cache-line aligned and cut across tensor boundaries.
void adam_step(const AdamTensor* tensors, size_t count, const AdamOptions& opt);

// Per-level kernels: elements [begin, end) of one tensor, single-threaded.
void adam_range_scalar(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end);
void adam_range_avx2(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end);
void adam_range_avx512(const AdamTensor& t, const AdamCoeffs& c, size_t begin, size_t end);

}  // namespace rp
