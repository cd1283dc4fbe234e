// Splitting element ranges over OpenMP threads.
//
// Work is cut into contiguous ranges whose boundaries are multiples of
// `align` elements (callers pass a cache line's worth), so two threads never
// write the same cache line; below `min_per_thread` elements per thread the
// call stays single-threaded, since waking the team costs ~5-20 us.
#pragma once

#include <cstddef>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace rp {

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

template <class Fn>
void parallel_ranges(size_t n, size_t align, size_t min_per_thread, Fn&& fn) {
  int threads = max_threads();
  if (min_per_thread > 0 && n / min_per_thread < static_cast<size_t>(threads))
    threads = static_cast<int>(n / min_per_thread);
  if (threads <= 1) {
    if (n) fn(size_t{0}, n);
    return;
  }
  size_t per = (n + threads - 1) / threads;
  per = (per + align - 1) / align * align;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int t = 0; t < threads; ++t) {
    const size_t begin = static_cast<size_t>(t) * per;
    const size_t end = begin + per < n ? begin + per : n;
    if (begin < end) fn(begin, end);
  }
}

}  // namespace rp
