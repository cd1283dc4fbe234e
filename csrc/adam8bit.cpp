// Scalar 8-bit Adam kernel, the per-step coefficients and the group entry point.
#pragma GCC optimize("fp-contract=off")  // each operation rounds once, as torch's: see adam.cpp

#include "adam8bit.h"

#include <cmath>
#include <stdexcept>
#include <string>

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

CodeSearch code_search(const uint8_t* lut, const char* name) {
  // One pass over the bins: first(j) for every code j the LUT reaches, in order.
  uint16_t first[256];
  size_t next = 1;
  for (size_t bin = 0; bin < kQuantBins; ++bin) {
    if (bin > 0 && lut[bin] < lut[bin - 1])
      throw std::invalid_argument(std::string("tables: ") + name + " must be non-decreasing (the bin -> code table " +
                                  "of a sorted map), but bin " + std::to_string(bin) + " has code " +
                                  std::to_string(lut[bin]) + " after " + std::to_string(lut[bin - 1]));
    for (; next <= lut[bin]; ++next) first[next] = static_cast<uint16_t>(bin);
  }
  for (; next < 256; ++next) first[next] = static_cast<uint16_t>(kQuantBins - 1);
  CodeSearch s;
  for (size_t t = 0; t < 8; ++t)
    for (size_t k = 0; k < (size_t{1} << t); ++k) s.tree[(size_t{1} << t) - 1 + k] = first[(k << (8 - t)) + (128 >> t)];
  s.top = lut[kQuantBins - 1];
  return s;
}

void adam8bit_step(const Adam8bitTensor* tensors, size_t count, const AdamOptions& opt,
                   const Adam8bitTables& tables) {
  const CodeSearch search1 = code_search(tables.lut1, "lut1"), search2 = code_search(tables.lut2, "lut2");
  Adam8bitTables with_search = tables;
  with_search.search1 = &search1;
  with_search.search2 = &search2;
  step_group<Adam8bitTensor, Adam8bitCoeffs>(
      tensors, count, [&](const Adam8bitTensor& t) { return adam8bit_coeffs(opt, t.step, with_search); },
      adam8bit_range_scalar, adam8bit_range_avx2, adam8bit_range_avx512, kQuantBlock);
}

}  // namespace rp
