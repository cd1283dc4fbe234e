#include "window_pack.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

#include "checks.h"

namespace rp {
namespace {

// Neither wraps for a, b, to <= PTRDIFF_MAX (what pack_lpt accepts).
size_t ceil_div(size_t a, size_t b) { return a / b + (a % b != 0); }
size_t round_up(size_t a, size_t to) { return ceil_div(a, to) * to; }

}  // namespace

std::vector<std::vector<Piece>> pack_lpt(const std::vector<size_t>& sizes, size_t windows, size_t align) {
  if (windows < 1 || windows > kMaxWindows)
    throw std::invalid_argument("windows=" + std::to_string(windows) + " must be in [1, " +
                                std::to_string(kMaxWindows) + "] (one per microbatch)");
  if (align < 1) throw std::invalid_argument("align=0 must be >= 1");
  check::at_most("align", align, check::kMaxBytes, "the largest possible buffer");
  // total <= kMaxBytes and align <= kMaxBytes: no rounding below can wrap.
  size_t total = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    check::at_most("sizes[" + std::to_string(t) + "]", sizes[t], check::kMaxBytes, "the largest possible buffer");
    total = check::add("sizes", total, sizes[t]);
  }
  std::vector<std::vector<Piece>> out(windows);
  if (total == 0) return out;

  const size_t target = round_up(ceil_div(total, windows), align);
  std::vector<Piece> pieces;  // at most sizes.size() + windows of them
  for (size_t t = 0; t < sizes.size(); ++t) {
    const size_t s = sizes[t];
    if (s == 0) continue;
    const size_t parts = ceil_div(s, target);
    // Near-equal pieces rounded to align, so no piece exceeds the target.
    const size_t step = round_up(ceil_div(s, parts), align);
    for (size_t off = 0; off < s; off += step) pieces.push_back(Piece{t, off, std::min(step, s - off)});
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.length > b.length; });

  using Load = std::pair<size_t, size_t>;  // (bytes so far, window index)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> least;
  for (size_t w = 0; w < windows; ++w) least.push({0, w});
  for (const Piece& p : pieces) {
    auto [load, w] = least.top();
    least.pop();
    out[w].push_back(p);
    least.push({load + p.length, w});
  }
  for (auto& win : out)
    std::sort(win.begin(), win.end(), [](const Piece& a, const Piece& b) {
      return a.tensor != b.tensor ? a.tensor < b.tensor : a.offset < b.offset;
    });
  return out;
}

}  // namespace rp
