// Copy engine: one device's host<->device traffic in four queues.
//
//   queue      direction   class          issued
//   act_up     host->dev   activation     one microbatch early (critical path)
//   act_down   dev->host   activation     one microbatch late
//   param_up   host->dev   parameters     per stage, split over M windows
//   grad_down  dev->host   gradients      per stage, split over M windows
//
// Copies in one queue run in submission order (a queue is a stream); a copy
// may also wait for fences ("after"), which is how priority is enforced in
// software: CUDA stream priorities do not reorder copies, so a stage's bulk
// bytes are packed into M windows (window_pack.h) and the caller submits
// window w after window w's activation fence (roundpipe/workers/transfers.py).  Parameters then never get ahead of the
// activation they would delay.  Every submission returns a fence that Python
// can wait on, record against arena blocks, or (CUDA) make a stream wait on.
//
// Backends: CudaCopyEngine issues cudaMemcpyAsync on four streams of its device
// through the dlopen'd runtime (copy_cuda.cpp); HostCopyEngine runs the same
// queues with memcpy on worker threads so that ordering, priority, packing and
// completion are exercised without a GPU (copy_host.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fence.h"

namespace rp {

enum class CopyQueue : int { ActUp = 0, ActDown = 1, ParamUp = 2, GradDown = 3 };
constexpr int kNumQueues = 4;
const char* queue_name(CopyQueue q);
inline bool is_activation(CopyQueue q) { return q == CopyQueue::ActUp || q == CopyQueue::ActDown; }

struct CopyOp {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t nbytes = 0;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Queues `ops` on `q` behind every fence in `after`; the returned fence
  // completes when all of them are copied.  `tag` labels the submission in
  // the host backend's history (ignored on CUDA).
  virtual FencePtr submit(CopyQueue q, std::vector<CopyOp> ops, std::vector<FencePtr> after, int64_t tag) = 0;
  // Blocks until everything submitted so far has completed.
  virtual void synchronize() = 0;
  virtual std::string backend() const = 0;
};

}  // namespace rp
