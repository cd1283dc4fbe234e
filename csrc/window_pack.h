// Splitting a stage's parameter/gradient tensors over its M transfer windows.
//
// A stage with M microbatches has M windows (one per microbatch's activation
// copy).  Bulk bytes are spread over them by longest-processing-time-first
// packing: pieces are taken largest first and each goes to the window with the
// least bytes so far (lowest index on ties).  A tensor larger than a window's
// target (ceil(total / M)) is first cut into near-equal pieces no larger than
// the target (an LM head would otherwise fill one window alone).  LPT keeps the
// largest window within 4/3 of the optimum; with pre-splitting, in practice
// within one piece of the mean.
#pragma once

#include <cstddef>
#include <vector>

namespace rp {

struct Piece {
  size_t tensor = 0;  // index into the sizes given
  size_t offset = 0;  // byte offset inside that tensor
  size_t length = 0;  // bytes
};

// windows[w] lists the pieces of window w in (tensor, offset) order.  Piece
// boundaries fall on multiples of `align` bytes inside each tensor; tensors of
// zero bytes produce no piece.  windows must be in [1, kMaxWindows] (a window
// per microbatch; the bound keeps a wild count from allocating gigabytes), the
// sizes and their sum at most PTRDIFF_MAX; std::invalid_argument otherwise.
constexpr size_t kMaxWindows = size_t{1} << 16;
std::vector<std::vector<Piece>> pack_lpt(const std::vector<size_t>& sizes, size_t windows, size_t align);

}  // namespace rp
