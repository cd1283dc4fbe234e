// Body of one SIMD level's SGD / Adagrad / Lion kernels (arithmetic: see
// optimizers.h).  Included by exactly one translation unit per level after
// that level's vec_<level>.h; defines, in an anonymous namespace,
// optim_dispatch<BF16Out>(tensor, coeffs, begin, end), where BF16Out is the
// element kind used to store a bf16 shadow.
#pragma once

#include <cstring>

#include "kind_dispatch.h"
#include "optimizers.h"

namespace {

// The coefficients broadcast once per call, not per vector.
struct OptimVecs {
  explicit OptimVecs(const rp::OptimCoeffs& c)
      : grad_mul(vset(c.grad_mul)), weight_decay(vset(c.weight_decay)), weight_scale(vset(c.weight_scale)),
        neg_lr(vset(c.neg_lr)), eps(vset(c.eps)), a(vset(c.a)), b(vset(c.b)), c(vset(c.c)), d(vset(c.d)),
        minus_one(vset(-1.0f)), predict(vset(c.predict)), maximize(c.maximize), decay(c.decay),
        momentum(c.momentum), first(c.first), nesterov(c.nesterov), predicting(c.predicting) {}
  Vec grad_mul, weight_decay, weight_scale, neg_lr, eps, a, b, c, d, minus_one, predict;
  bool maximize, decay, momentum, first, nesterov, predicting;

  // What the shadow receives: the new weight, or with predict the predicted next one.
  Vec shadow(Vec before, Vec after) const {
    return predicting ? vfma(vsub(after, before), predict, after) : after;
  }

  template <class GK>
  Vec grad(const typename GK::T* g) const {
    const Vec x = vmul(GK::load(g), grad_mul);
    return maximize ? vmul(x, minus_one) : x;
  }

  // The gradient with weight decay as an L2 term (SGD, Adagrad): fma(p, wd, g).
  template <class GK>
  Vec l2_grad(const typename GK::T* g, Vec param) const {
    const Vec x = grad<GK>(g);
    return decay ? vfma(param, weight_decay, x) : x;
  }
};

// Each kind's update of one vector: weight p (master kind MK: fp32 or a rounded bf16,
// kind_dispatch.h; i its element index, key its rounding key), gradient g, state st (a
// valid buffer even where the kind keeps none), shadow s (receives the weight as stored).
struct SgdOp {
  template <class MK, class GK, class SK>
  static void vector(const OptimVecs& k, uint64_t key, size_t i, typename MK::T* p, const typename GK::T* g,
                     float* st, typename SK::T* s) {
    const Vec before = MK::load(p);
    Vec grad = k.l2_grad<GK>(g, before);
    if (k.momentum) {
      const Vec buf = k.first ? grad : vfma(grad, k.b, vmul(F32K::load(st), k.a));
      F32K::store(st, buf);
      grad = k.nesterov ? vfma(buf, k.a, grad) : buf;
    }
    const Vec param = MK::store(p, vfma(grad, k.neg_lr, before), key, i);
    SK::store(s, k.shadow(before, param));
  }
};

struct AdagradOp {
  template <class MK, class GK, class SK>
  static void vector(const OptimVecs& k, uint64_t key, size_t i, typename MK::T* p, const typename GK::T* g,
                     float* st, typename SK::T* s) {
    const Vec before = MK::load(p);
    const Vec grad = k.l2_grad<GK>(g, before);
    const Vec sum = vfma(grad, grad, F32K::load(st));
    F32K::store(st, sum);
    const Vec param = MK::store(p, vadd(before, vdiv(vmul(k.neg_lr, grad), vadd(vsqrt(sum), k.eps))), key, i);
    SK::store(s, k.shadow(before, param));
  }
};

struct LionOp {
  template <class MK, class GK, class SK>
  static void vector(const OptimVecs& k, uint64_t key, size_t i, typename MK::T* p, const typename GK::T* g,
                     float* st, typename SK::T* s) {
    const Vec grad = k.grad<GK>(g);
    const Vec before = MK::load(p);
    Vec param = k.decay ? vmul(before, k.weight_scale) : before;
    const Vec m = F32K::load(st);
    param = MK::store(p, vfma(vsign(vfma(grad, k.b, vmul(m, k.a))), k.neg_lr, param), key, i);
    F32K::store(st, vfma(grad, k.d, vmul(m, k.c)));
    SK::store(s, k.shadow(before, param));
  }
};

template <class Op, class MK, class GK, class SK>
void optim_typed(const rp::OptimTensor& t, const rp::OptimCoeffs& c, size_t begin, size_t end) {
  using P = typename MK::T;
  using G = typename GK::T;
  using S = typename SK::T;
  const OptimVecs k(c);
  const uint64_t key = t.round_key;
  P* p = static_cast<P*>(t.param);
  const G* g = static_cast<const G*>(t.grad);
  float* st = t.state;
  S* s = static_cast<S*>(t.shadow);
  size_t i = begin;
  for (; i + kWidth <= end; i += kWidth)
    Op::template vector<MK, GK, SK>(k, key, i, p + i, g + i, st ? st + i : nullptr, s ? s + i : nullptr);
  if (i == end) return;
  // Tail: the same vector code on a zero-padded copy (zero lanes are dropped;
  // Adagrad's 0 / (0 + 0) NaN there is harmless).  Aligned, because a shadow
  // kind may use streaming stores, which fault on unaligned addresses.
  const size_t r = end - i;
  alignas(64) P tp[kWidth] = {};
  alignas(64) float tst[kWidth] = {};
  alignas(64) G tg[kWidth] = {};
  alignas(64) S ts[kWidth] = {};
  std::memcpy(tp, p + i, r * sizeof(P));
  std::memcpy(tg, g + i, r * sizeof(G));
  if (st) std::memcpy(tst, st + i, r * sizeof(float));
  Op::template vector<MK, GK, SK>(k, key, i, tp, tg, tst, ts);
  std::memcpy(p + i, tp, r * sizeof(P));
  if (st) std::memcpy(st + i, tst, r * sizeof(float));
  if (s) std::memcpy(s + i, ts, r * sizeof(S));
}

template <class BF16Out>
void optim_dispatch(const rp::OptimTensor& t, const rp::OptimCoeffs& c, size_t begin, size_t end) {
  with_master_kinds<BF16Out>(t.param_dtype, t.stochastic, t.grad_dtype, t.shadow, t.shadow_dtype,
                             [&](auto mk, auto gk, auto sk) {
    using MK = decltype(mk);
    using GK = decltype(gk);
    using SK = decltype(sk);
    switch (c.kind) {
      case rp::OptimKind::Sgd: return optim_typed<SgdOp, MK, GK, SK>(t, c, begin, end);
      case rp::OptimKind::Adagrad: return optim_typed<AdagradOp, MK, GK, SK>(t, c, begin, end);
      case rp::OptimKind::Lion: return optim_typed<LionOp, MK, GK, SK>(t, c, begin, end);
    }
  });
}

}  // namespace
