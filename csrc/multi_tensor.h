// One parallel region over the elements of many tensors.
//
// A group of optimizer tensors is typically a few large matrices and many
// small vectors (biases, norms).  A parallel region per tensor would pay the
// team wake-up (~5-20 us) hundreds of times per step, and a 1000-element bias
// cannot feed two threads anyway.  Instead the tensors are laid end to end,
// each padded to a multiple of `align` elements, and that index space is cut
// into one contiguous range per thread.  Because both the cut points and the
// tensor starts are multiples of `align`, a thread's piece of a tensor starts
// at an aligned element index: with `align` elements per cache line (and
// 64-byte aligned tensors, as torch allocates them) no two threads write the
// same cache line.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "checks.h"
#include "cpu_features.h"
#include "parallel.h"

namespace rp {

class TensorRanges {
 public:
  TensorRanges(const size_t* sizes, size_t count, size_t align, size_t min_per_thread)
      : sizes_(sizes, sizes + count), offsets_(count + 1, 0) {
    for (size_t k = 0; k < count; ++k) {  // padded sizes; a sum that would wrap is an argument error
      const size_t padded = check::add("numels", sizes[k], (align - sizes[k] % align) % align);
      offsets_[k + 1] = check::add("numels", offsets_[k], padded);
    }
    const size_t total = offsets_[count];
    size_t threads = static_cast<size_t>(max_threads());
    if (min_per_thread > 0) threads = std::min(threads, total / min_per_thread);
    threads_ = static_cast<int>(std::max<size_t>(threads, 1));
    per_ = (total + threads_ - 1) / threads_;
    per_ = (per_ + align - 1) / align * align;
  }

  int threads() const { return threads_; }

  // Calls fn(thread, tensor, begin, end) for every non-empty piece, each thread
  // visiting its pieces in tensor order.
  template <class Fn>
  void run(Fn&& fn) const {
    if (threads_ == 1) {
      visit(0, fn);
      return;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads_) schedule(static)
#endif
    for (int t = 0; t < threads_; ++t) visit(t, fn);
  }

 private:
  template <class Fn>
  void visit(int t, Fn& fn) const {
    const size_t lo = static_cast<size_t>(t) * per_;
    const size_t hi = std::min(lo + per_, offsets_.back());
    if (lo >= hi) return;
    // First tensor whose padded span ends after lo.
    size_t k = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), lo) - offsets_.begin()) - 1;
    for (; k < sizes_.size() && offsets_[k] < hi; ++k) {
      const size_t b = std::max(lo, offsets_[k]) - offsets_[k];
      const size_t e = std::min(hi - offsets_[k], sizes_[k]);
      if (b < e) fn(t, k, b, e);
    }
  }

  std::vector<size_t> sizes_, offsets_;
  int threads_ = 1;
  size_t per_ = 0;
};

// One optimizer step over a group (adam_step, optim_step): the per-tensor
// constants from coeffs_of(tensor), then the kernel of the SIMD level in use
// over every piece.  align 32 elements = one cache line of a bf16 shadow, two
// of the fp32 state (an 8-bit step passes its block size, so pieces are whole
// blocks); 32K elements (~0.9 MB of traffic) per thread before a second one
// helps.
template <class Tensor, class Coeffs, class CoeffsOf>
void step_group(const Tensor* tensors, size_t count, CoeffsOf&& coeffs_of,
                void (*scalar)(const Tensor&, const Coeffs&, size_t, size_t),
                void (*avx2)(const Tensor&, const Coeffs&, size_t, size_t),
                void (*avx512)(const Tensor&, const Coeffs&, size_t, size_t), size_t align = 32) {
  auto* fn = simd_level() == SimdLevel::Avx512 ? avx512 : simd_level() == SimdLevel::Avx2 ? avx2 : scalar;
  std::vector<size_t> sizes(count);
  std::vector<Coeffs> coeffs(count);
  for (size_t k = 0; k < count; ++k) {
    sizes[k] = tensors[k].n;
    coeffs[k] = coeffs_of(tensors[k]);
  }
  TensorRanges ranges(sizes.data(), count, align, size_t{1} << 15);
  ranges.run([&](int, size_t k, size_t b, size_t e) { fn(tensors[k], coeffs[k], b, e); });
}

}  // namespace rp
