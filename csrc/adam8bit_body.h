// Body of one SIMD level's 8-bit Adam kernel.  Included by exactly one
// translation unit per level after that level's vec_<level>.h; defines, in an
// anonymous namespace, adam8bit_dispatch<BF16Out>(tensor, coeffs, begin, end).
//
// Per block of kQuantBlock elements (adam8bit.h has the arithmetic):
//   1. decode the block's m and v codes to their map values, into two block buffers
//      (fp32, on the stack)
//   2. per vector: update m, v (map value * old absmax), the weight and the shadow;
//      the new m, v go back to the buffers; keep their running max |.|
//   3. absmax = that max (NaN ignored, as std::max in bitsandbytes)
//   4. per run of kEncodeRun vectors: code = LUT[int((clamp(x * (1 / absmax), -1, 1) + 1) * 0.5 * 65535 + 0.5)]
//      (NaN -> -1: vmax/vmin return their second operand for a NaN first one);
//      a block whose absmax is 0 gets all codes 0
// The level's Codes (vec_<level>.h) decode and encode: map and LUT reads (gathers at
// AVX2), or at AVX-512 permutes and adam8bit.h's search, with the same results.
// kQuantBlock is a multiple of every kEncodeRun * kWidth, so only a tensor's last, shorter
// block has a tail: it runs through the vector code on zero-padded copies.
#pragma once

#include <cstring>

#include "adam8bit.h"
#include "kind_dispatch.h"

namespace {

struct Adam8bitVecs {
  explicit Adam8bitVecs(const rp::Adam8bitCoeffs& c8)
      : Adam8bitVecs(c8.adam, c8) {}
  Adam8bitVecs(const rp::AdamCoeffs& c, const rp::Adam8bitCoeffs& c8)
      : grad_mul(vset(c.grad_mul)), l2_decay(vset(c.l2_decay)), weight_scale(vset(c.weight_scale)),
        beta1(vset(c8.beta1)), lerp_w(vset(c.lerp_w)), beta2(vset(c.beta2)), sq_w(vset(c.sq_w)),
        bc2_sqrt(vset(c.bc2_sqrt)), neg_step(vset(c.neg_step)), eps(vset(c.eps)), predict(vset(c.predict)),
        minus_one(vset(-1.0f)), one(vset(1.0f)), half(vset(0.5f)),
        last_bin(vset(static_cast<float>(rp::kQuantBins - 1))), maximize(c.maximize), l2(c.l2),
        decay_weight(c.decay_weight), predicting(c.predicting),
        codes1(c8.tables.code1, c8.tables.lut1, c8.tables.search1->tree, c8.tables.search1->top),
        codes2(c8.tables.code2, c8.tables.lut2, c8.tables.search2->tree, c8.tables.search2->top) {}
  Vec grad_mul, l2_decay, weight_scale, beta1, lerp_w, beta2, sq_w, bc2_sqrt, neg_step, eps, predict;
  Vec minus_one, one, half, last_bin;
  bool maximize, l2, decay_weight, predicting;
  Codes codes1, codes2;
};

// One vector: the weight and shadow updated in place; m and v hold the old codes' map values
// (decoded) and get the new m and v.
template <class MK, class GK, class SK>
inline void update_vector(const Adam8bitVecs& k, uint64_t key, size_t i, Vec absmax1, Vec absmax2,
                          typename MK::T* p, const typename GK::T* g, float* m, float* v, typename SK::T* s) {
  Vec grad = vmul(GK::load(g), k.grad_mul);
  if (k.maximize) grad = vmul(grad, k.minus_one);
  const Vec before = MK::load(p);
  Vec param = before;
  if (k.l2) grad = vfma(param, k.l2_decay, grad);
  const Vec m_old = vmul(F32K::load(m), absmax1);
  const Vec v_old = vmul(F32K::load(v), absmax2);
  const Vec m_new = vfma(grad, k.lerp_w, vmul(m_old, k.beta1));
  const Vec v_new = vfma(vmul(k.sq_w, grad), grad, vmul(v_old, k.beta2));
  const Vec denom = vadd(vdiv(vsqrt(v_new), k.bc2_sqrt), k.eps);
  if (k.decay_weight) param = vmul(param, k.weight_scale);
  param = MK::store(p, vadd(param, vdiv(vmul(k.neg_step, m_new), denom)), key, i);
  SK::store(s, k.predicting ? vfma(vsub(param, before), k.predict, param) : param);
  F32K::store(m, m_new);
  F32K::store(v, v_new);
}

inline VecI bin_of(const Adam8bitVecs& k, Vec x, Vec inv_absmax) {
  const Vec y = vmin(vmax(vmul(x, inv_absmax), k.minus_one), k.one);
  return vtrunc(vadd(vmul(vmul(vadd(y, k.one), k.half), k.last_bin), k.half));
}

// Codes of values[0, len) (whole runs of kEncodeRun vectors readable, zero past len) into out[0, len).
inline void encode_block(const Adam8bitVecs& k, const float* values, size_t len, float absmax, const Codes& codes,
                         uint8_t* out) {
  if (absmax == 0.0f) {
    std::memset(out, 0, len);
    return;
  }
  constexpr size_t kRun = kEncodeRun * kWidth;
  const Vec inv = vset(1.0f / absmax);
  VecI bins[kEncodeRun];
  for (size_t i = 0; i < len; i += kRun) {
    for (int j = 0; j < kEncodeRun; ++j) bins[j] = bin_of(k, F32K::load(values + i + j * kWidth), inv);
    if (i + kRun <= len) {
      codes.encode(out + i, bins);
    } else {
      alignas(64) uint8_t tail[kRun];
      codes.encode(tail, bins);
      std::memcpy(out + i, tail, len - i);
    }
  }
}

template <class MK, class GK, class SK>
void adam8bit_typed(const rp::Adam8bitTensor& t, const rp::Adam8bitCoeffs& c, size_t begin, size_t end) {
  using P = typename MK::T;
  using G = typename GK::T;
  using S = typename SK::T;
  const Adam8bitVecs k(c);
  const G* grad = static_cast<const G*>(t.grad);
  S* shadow = static_cast<S*>(t.shadow);
  for (size_t b0 = begin; b0 < end; b0 += rp::kQuantBlock) {
    const size_t len = end - b0 < rp::kQuantBlock ? end - b0 : rp::kQuantBlock;
    const size_t block = b0 / rp::kQuantBlock;
    P* p = static_cast<P*>(t.param) + b0;
    const G* g = grad + b0;
    uint8_t* q1 = t.state1 + b0;
    uint8_t* q2 = t.state2 + b0;
    S* s = shadow ? shadow + b0 : nullptr;
    const Vec absmax1 = vset(t.absmax1[block]), absmax2 = vset(t.absmax2[block]);
    // The block's map values, decoded in one go (a short block's codes from a zero-padded copy).
    alignas(64) float m[rp::kQuantBlock], v[rp::kQuantBlock];
    if (len == rp::kQuantBlock) {
      k.codes1.decode_block(q1, m);
      k.codes2.decode_block(q2, v);
    } else {
      alignas(64) uint8_t c1[rp::kQuantBlock] = {}, c2[rp::kQuantBlock] = {};
      std::memcpy(c1, q1, len);
      std::memcpy(c2, q2, len);
      k.codes1.decode_block(c1, m);
      k.codes2.decode_block(c2, v);
    }
    Vec max1 = vset(0.0f), max2 = vset(0.0f);
    size_t i = 0;
    for (; i + kWidth <= len; i += kWidth) {
      update_vector<MK, GK, SK>(k, t.round_key, b0 + i, absmax1, absmax2, p + i, g + i, m + i, v + i,
                                s ? s + i : nullptr);
      max1 = vmax(vabs(F32K::load(m + i)), max1);
      max2 = vmax(vabs(F32K::load(v + i)), max2);
    }
    if (i < len) {
      // The tail on zero-padded copies; the padding lanes' m and v are zeroed before
      // they reach the maxima and the codes.  Aligned: a shadow kind may stream.
      const size_t r = len - i;
      alignas(64) P tp[kWidth] = {};
      alignas(64) G tg[kWidth] = {};
      alignas(64) S ts[kWidth] = {};
      std::memcpy(tp, p + i, r * sizeof(P));
      std::memcpy(tg, g + i, r * sizeof(G));
      update_vector<MK, GK, SK>(k, t.round_key, b0 + i, absmax1, absmax2, tp, tg, m + i, v + i, ts);
      std::memset(m + len, 0, (kWidth - r) * sizeof(float));
      std::memset(v + len, 0, (kWidth - r) * sizeof(float));
      std::memcpy(p + i, tp, r * sizeof(P));
      if (s) std::memcpy(s + i, ts, r * sizeof(S));
      max1 = vmax(vabs(F32K::load(m + i)), max1);
      max2 = vmax(vabs(F32K::load(v + i)), max2);
    }
    // Zero past len to the end of the last run of vectors (encode_block reads whole runs).
    constexpr size_t kRun = kEncodeRun * kWidth;
    const size_t padded = (len + kRun - 1) / kRun * kRun;
    std::memset(m + len, 0, (padded - len) * sizeof(float));
    std::memset(v + len, 0, (padded - len) * sizeof(float));
    const float new_absmax1 = vreduce_max(max1), new_absmax2 = vreduce_max(max2);
    t.absmax1[block] = new_absmax1;
    t.absmax2[block] = new_absmax2;
    encode_block(k, m, len, new_absmax1, k.codes1, q1);
    encode_block(k, v, len, new_absmax2, k.codes2, q2);
  }
}

template <class BF16Out>
void adam8bit_dispatch(const rp::Adam8bitTensor& t, const rp::Adam8bitCoeffs& c, size_t begin, size_t end) {
  with_master_kinds<BF16Out>(t.param_dtype, t.stochastic, t.grad_dtype, t.shadow, t.shadow_dtype,
                             [&](auto mk, auto gk, auto sk) {
                               adam8bit_typed<decltype(mk), decltype(gk), decltype(sk)>(t, c, begin, end);
                             });
}

}  // namespace
