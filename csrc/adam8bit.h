// Fused Adam / AdamW step with 8-bit blockwise moments (bitsandbytes 0.50's format).
//
// m and v live as one byte per element plus one fp32 absmax per block of
// kBlock = 256 elements: value = code[byte] * absmax, with bitsandbytes' signed
// dynamic map for m and the unsigned one for v (roundpipe/optim/blockwise.py
// builds the maps and the bin -> code tables and documents the coding).  Per
// block, one pass reads the gradient (fp32/bf16/fp16), decodes m and v, updates
// them and the fp32 weight, writes the weight's low-precision upload ("shadow")
// copy, and re-codes m and v from their new fp32 values (new absmax = the
// block's largest |value|).  Host traffic with bf16 gradient and shadow: 4 + 4
// (weight) + 2 (gradient) + 2 + 2 (codes) + 2 (shadow) = 16 bytes per parameter,
// against 28 for the fp32-state step (adam.h).
//
// Arithmetic is bitsandbytes' CPU 8-bit Adam (backends/cpu/ops.py, torch ops)
// operation by operation, each one fp32 rounding:
//   g  = load(grad) * grad_mul;  maximize: g = g * -1;  Adam (L2): g = fma(p, wd, g)
//   m  = fma(g, 1 - beta1, (code1[q1] * absmax1) * beta1)      torch's add(alpha)
//   v  = fma((1 - beta2) * g, g, (code2[q2] * absmax2) * beta2)  torch's addcmul
//   AdamW: p = p * (1 - lr * wd)
//   p  = p + ((-lr / bc1) * m) / (sqrt(v) / sqrt(bc2) + eps);   shadow = p
//        (with predict: shadow = fma(p - p_before, predict, p))
// so with fp32 gradients the codes and absmax equal bitsandbytes' AdamW8bit's,
// and the weights agree within about an ulp per step (its torch sqrt is MKL's
// vsSqrt, not always correctly rounded; vsqrt here is).
// Adam (decoupled=false) adds the L2 term to the gradient as torch.optim.Adam
// does (bitsandbytes' Adam8bit decays the weight instead: that is AdamW8bit).
// All SIMD levels are bit-identical (maxima are exact, codes come from
// comparisons and table lookups).
//
// Nothing here validates: the bindings check dtypes, sizes, null pointers and
// overlaps before calling.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam.h"
#include "convert.h"
#include "step_tensor.h"

namespace rp {

constexpr size_t kQuantBlock = 256;
constexpr size_t kQuantBins = 65536;

// A bin -> code table (LUT) as the bins where its codes start, in the order a
// binary search reads them, so that the AVX-512 level codes by searching in
// registers instead of gathering from the 64 KB LUT (a gather is the slowest
// instruction of the step on AMD Zen: vec_avx512.h).  The LUT is
// non-decreasing, so LUT[bin] = #{j in 1..255 : first(j) <= bin}, first(j) =
// the first bin whose code is >= j; the search finds that count in 8 steps.
// Step t (0..7) compares with tree[2^t - 1 + k] = first(k * 2^(8-t) + 2^(7-t)),
// k being the t bits found so far.  first(j) beyond the last bin is stored as
// the last bin, and `top` = LUT[last bin] caps the count, so the search equals
// the LUT for every bin.
struct CodeSearch {
  alignas(64) uint16_t tree[256] = {};
  uint16_t top = 0;
};

// The search of a LUT of kQuantBins entries; throws std::invalid_argument
// naming `name` if the LUT is not non-decreasing.
CodeSearch code_search(const uint8_t* lut, const char* name);

// The maps (256 fp32 codes each) and their bin -> code tables (kQuantBins
// bytes each, followed by 3 readable bytes: the vector levels load 4 bytes per
// lookup), with the tables' searches: 1 for m (signed), 2 for v (unsigned).
// adam8bit_step fills search1 and search2 from lut1 and lut2.
struct Adam8bitTables {
  const float* code1 = nullptr;
  const uint8_t* lut1 = nullptr;
  const float* code2 = nullptr;
  const uint8_t* lut2 = nullptr;
  const CodeSearch* search1 = nullptr;
  const CodeSearch* search2 = nullptr;
};

// One tensor of a group: n elements, ceil(n / kQuantBlock) absmax entries per
// state.  shadow may be null.  step is the step number after this update.
struct Adam8bitTensor : StepTensor {
  uint8_t* state1 = nullptr;
  uint8_t* state2 = nullptr;
  float* absmax1 = nullptr;
  float* absmax2 = nullptr;
  double step = 1;
};

// The per-tensor constants of one step: the fp32 Adam ones (bitsandbytes' torch
// ops round its Python scalars where torch's AdamW does, but takes sqrt(bc2)
// with math.sqrt), beta1 for m * beta1, and the tables.
struct Adam8bitCoeffs {
  AdamCoeffs adam;
  float beta1;
  Adam8bitTables tables;
};

Adam8bitCoeffs adam8bit_coeffs(const AdamOptions& opt, double step, const Adam8bitTables& tables);

// Updates every tensor of the group in one OpenMP region; each thread's ranges
// are whole blocks (multi_tensor.h).  opt.amsgrad must be false; tables' searches
// are filled here (throws std::invalid_argument for a LUT that is not non-decreasing).
void adam8bit_step(const Adam8bitTensor* tensors, size_t count, const AdamOptions& opt, const Adam8bitTables& tables);

// Per-level kernels: elements [begin, end) of one tensor, begin a multiple of
// kQuantBlock and end one too or n; single-threaded.
void adam8bit_range_scalar(const Adam8bitTensor& t, const Adam8bitCoeffs& c, size_t begin, size_t end);
void adam8bit_range_avx2(const Adam8bitTensor& t, const Adam8bitCoeffs& c, size_t begin, size_t end);
void adam8bit_range_avx512(const Adam8bitTensor& t, const Adam8bitCoeffs& c, size_t begin, size_t end);

}  // namespace rp
