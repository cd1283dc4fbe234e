#include "window_pack.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

namespace rp {

std::vector<std::vector<Piece>> pack_lpt(const std::vector<size_t>& sizes, size_t windows, size_t align) {
  if (windows == 0) throw std::invalid_argument("windows=0 must be >= 1");
  if (align == 0) throw std::invalid_argument("align=0 must be >= 1");
  size_t total = 0;
  for (size_t s : sizes) total += s;
  std::vector<std::vector<Piece>> out(windows);
  if (total == 0) return out;

  const size_t target = std::max(align, ((total + windows - 1) / windows + align - 1) / align * align);
  std::vector<Piece> pieces;
  for (size_t t = 0; t < sizes.size(); ++t) {
    const size_t s = sizes[t];
    if (s == 0) continue;
    const size_t parts = (s + target - 1) / target;
    // Near-equal pieces rounded to align, so no piece exceeds the target.
    const size_t step = std::max(align, ((s + parts - 1) / parts + align - 1) / align * align);
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
