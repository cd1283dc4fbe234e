#include "copy_engine.h"

#include <stdexcept>

#include "window_pack.h"

namespace rp {

const char* queue_name(CopyQueue q) {
  switch (q) {
    case CopyQueue::ActUp: return "act_up";
    case CopyQueue::ActDown: return "act_down";
    case CopyQueue::ParamUp: return "param_up";
    case CopyQueue::GradDown: return "grad_down";
  }
  return "?";
}

std::vector<FencePtr> CopyEngine::submit_windows(CopyQueue q, const std::vector<CopyOp>& tensors,
                                                 const std::vector<FencePtr>& window_after, size_t align,
                                                 int64_t tag) {
  if (window_after.empty()) throw std::invalid_argument("window_after is empty; need one entry per window (M >= 1)");
  std::vector<size_t> sizes;
  sizes.reserve(tensors.size());
  for (const CopyOp& t : tensors) sizes.push_back(t.nbytes);
  const auto plan = pack_lpt(sizes, window_after.size(), align);
  std::vector<FencePtr> fences;
  fences.reserve(plan.size());
  for (size_t w = 0; w < plan.size(); ++w) {
    std::vector<CopyOp> ops;
    ops.reserve(plan[w].size());
    for (const Piece& p : plan[w]) {
      const CopyOp& t = tensors[p.tensor];
      ops.push_back(CopyOp{static_cast<char*>(t.dst) + p.offset, static_cast<const char*>(t.src) + p.offset, p.length});
    }
    std::vector<FencePtr> after;
    if (window_after[w]) after.push_back(window_after[w]);
    fences.push_back(submit(q, std::move(ops), std::move(after), tag));
  }
  return fences;
}

}  // namespace rp
