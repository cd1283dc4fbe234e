// Body of one SIMD level's Adam kernel.  Included by exactly one translation
// unit per level after that level's vec_<level>.h; defines, in an anonymous
// namespace, adam_dispatch<BF16Out>(tensor, coeffs, begin, end), where
// BF16Out is the element kind used to store a bf16 shadow.
//
// Per element, in torch's fused CPU AdamW order (every step one fp32 rounding):
//   g  = load(grad) * grad_mul;  g = maximize ? g * -1 : g
//   Adam:  g = fma(p, wd, g)     AdamW: p = p * (1 - lr * wd)
//   m  = fma(w, g - m, m)  (w = 1 - beta1 < 0.5; else fma(w - 1, g - m, g))
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   vmax = max(vmax, v) (amsgrad; the denominator then uses vmax)
//   p  = p + ((-lr / bc1) * m) / (sqrt(v) / sqrt(bc2) + eps);   shadow = p
//   (a bf16 master: p loaded from bf16, the new p rounded to bf16 as stored, and the shadow
//   receives the rounded value, kind_dispatch.h)
//   (with predict: shadow = fma(p - p_before, predict, p), the predicted next weights)
#pragma once

#include <cstring>

#include "adam.h"
#include "kind_dispatch.h"

namespace {

// The coefficients broadcast once per call, not per vector (and copied out of
// the struct so stores through the float pointers cannot force reloads).
struct AdamVecs {
  explicit AdamVecs(const rp::AdamCoeffs& c)
      : grad_mul(vset(c.grad_mul)), l2_decay(vset(c.l2_decay)), weight_scale(vset(c.weight_scale)),
        lerp_w(vset(c.lerp_small ? c.lerp_w : c.lerp_w_m1)), beta2(vset(c.beta2)), sq_w(vset(c.sq_w)),
        bc2_sqrt(vset(c.bc2_sqrt)), neg_step(vset(c.neg_step)), eps(vset(c.eps)), minus_one(vset(-1.0f)),
        predict(vset(c.predict)), maximize(c.maximize), l2(c.l2), decay_weight(c.decay_weight),
        lerp_small(c.lerp_small), amsgrad(c.amsgrad), predicting(c.predicting) {}
  Vec grad_mul, l2_decay, weight_scale, lerp_w, beta2, sq_w, bc2_sqrt, neg_step, eps, minus_one, predict;
  bool maximize, l2, decay_weight, lerp_small, amsgrad, predicting;
};

template <class MK, class GK, class SK>
inline void adam_vector(const AdamVecs& k, uint64_t key, size_t i, typename MK::T* p, const typename GK::T* g,
                        float* m, float* v, float* vmax, typename SK::T* s) {
  Vec grad = vmul(GK::load(g), k.grad_mul);
  if (k.maximize) grad = vmul(grad, k.minus_one);
  const Vec before = MK::load(p);
  Vec param = before;
  if (k.l2) grad = vfma(param, k.l2_decay, grad);
  if (k.decay_weight) param = vmul(param, k.weight_scale);
  const Vec m_old = F32K::load(m);
  const Vec m_new = vfma(k.lerp_w, vsub(grad, m_old), k.lerp_small ? m_old : grad);
  Vec v_new = vfma(vmul(k.sq_w, grad), grad, vmul(F32K::load(v), k.beta2));
  F32K::store(m, m_new);
  F32K::store(v, v_new);
  if (k.amsgrad) {
    v_new = vmax_nan(F32K::load(vmax), v_new);
    F32K::store(vmax, v_new);
  }
  const Vec denom = vadd(vdiv(vsqrt(v_new), k.bc2_sqrt), k.eps);
  param = MK::store(p, vadd(param, vdiv(vmul(k.neg_step, m_new), denom)), key, i);
  SK::store(s, k.predicting ? vfma(vsub(param, before), k.predict, param) : param);
}

template <class MK, class GK, class SK>
void adam_typed(const rp::AdamTensor& t, const rp::AdamCoeffs& c, size_t begin, size_t end) {
  using P = typename MK::T;
  using G = typename GK::T;
  using S = typename SK::T;
  const AdamVecs k(c);
  const uint64_t key = t.round_key;
  P* p = static_cast<P*>(t.param);
  const G* g = static_cast<const G*>(t.grad);
  float* m = t.exp_avg;
  float* v = t.exp_avg_sq;
  float* vmax = t.max_exp_avg_sq;
  S* s = static_cast<S*>(t.shadow);
  size_t i = begin;
  for (; i + kWidth <= end; i += kWidth)
    adam_vector<MK, GK, SK>(k, key, i, p + i, g + i, m + i, v + i, k.amsgrad ? vmax + i : nullptr, s ? s + i : nullptr);
  if (i == end) return;
  // Tail: the same vector code on a zero-padded copy (zero lanes are harmless:
  // sqrt(0) / bc2 + eps > 0).  Aligned, because a shadow kind may use
  // streaming stores, which fault on unaligned addresses.
  const size_t r = end - i;
  alignas(64) P tp[kWidth] = {};
  alignas(64) float tm[kWidth] = {}, tv[kWidth] = {}, tx[kWidth] = {};
  alignas(64) G tg[kWidth] = {};
  alignas(64) S ts[kWidth] = {};
  std::memcpy(tp, p + i, r * sizeof(P));
  std::memcpy(tg, g + i, r * sizeof(G));
  std::memcpy(tm, m + i, r * sizeof(float));
  std::memcpy(tv, v + i, r * sizeof(float));
  if (k.amsgrad) std::memcpy(tx, vmax + i, r * sizeof(float));
  adam_vector<MK, GK, SK>(k, key, i, tp, tg, tm, tv, tx, ts);
  std::memcpy(p + i, tp, r * sizeof(P));
  std::memcpy(m + i, tm, r * sizeof(float));
  std::memcpy(v + i, tv, r * sizeof(float));
  if (k.amsgrad) std::memcpy(vmax + i, tx, r * sizeof(float));
  if (s) std::memcpy(s + i, ts, r * sizeof(S));
}

template <class BF16Out>
void adam_dispatch(const rp::AdamTensor& t, const rp::AdamCoeffs& c, size_t begin, size_t end) {
  with_master_kinds<BF16Out>(t.param_dtype, t.stochastic, t.grad_dtype, t.shadow, t.shadow_dtype,
                             [&](auto mk, auto gk, auto sk) {
                               adam_typed<decltype(mk), decltype(gk), decltype(sk)>(t, c, begin, end);
                             });
}

}  // namespace
