#include "copy_cuda.h"

#include <stdexcept>
#include <string>

namespace rp {

namespace {
constexpr unsigned kNonBlocking = 1;  // cudaStreamNonBlocking: no implicit sync with the legacy stream
constexpr int kMemcpyDefault = 4;     // cudaMemcpyDefault: direction from unified addressing
}  // namespace

CudaCopyEngine::CudaCopyEngine(int device, const std::vector<cuda::Stream>& streams)
    : api_(cuda::require_runtime("the CUDA copy engine")), device_(device) {
  if (device < 0 || device >= api_.device_count)
    throw std::invalid_argument("device=" + std::to_string(device) + " is out of range; " +
                                std::to_string(api_.device_count) + " CUDA devices are visible");
  if (!streams.empty() && streams.size() != kNumQueues)
    throw std::invalid_argument("streams has " + std::to_string(streams.size()) +
                                " handles; pass none or exactly 4 (act_up, act_down, param_up, grad_down)");
  if (!streams.empty()) {
    for (int q = 0; q < kNumQueues; ++q) streams_[q] = streams[q];
    return;
  }
  cuda::DeviceGuard guard(api_, device_);
  int least = 0, greatest = 0;  // numerically greatest priority is the lowest (e.g. 0 vs -5)
  api_.check(api_.cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  for (int q = 0; q < kNumQueues; ++q) {
    const int priority = is_activation(static_cast<CopyQueue>(q)) ? greatest : least;
    api_.check(api_.cudaStreamCreateWithPriority(&streams_[q], kNonBlocking, priority), "cudaStreamCreateWithPriority");
  }
  owns_streams_ = true;
}

CudaCopyEngine::~CudaCopyEngine() {
  if (!owns_streams_) return;
  for (cuda::Stream s : streams_) {
    api_.cudaStreamSynchronize(s);
    api_.cudaStreamDestroy(s);
  }
}

FencePtr CudaCopyEngine::submit(CopyQueue q, std::vector<CopyOp> ops, std::vector<FencePtr> after, int64_t) {
  for (const auto& f : after)
    if (!f) throw std::invalid_argument("after contains None; pass only fences");
  cuda::Stream stream = streams_[static_cast<int>(q)];
  // Host fences cannot be waited for by a stream: wait here, before locking.
  for (const auto& f : after)
    if (!f->cuda_event()) f->wait();
  std::lock_guard<std::mutex> lock(mu_);
  cuda::DeviceGuard guard(api_, device_);
  for (const auto& f : after)
    if (cuda::Event e = f->cuda_event()) api_.check(api_.cudaStreamWaitEvent(stream, e, 0), "cudaStreamWaitEvent");
  for (const CopyOp& op : ops)
    if (op.nbytes) api_.check(api_.cudaMemcpyAsync(op.dst, op.src, op.nbytes, kMemcpyDefault, stream), "cudaMemcpyAsync");
  return CudaEventFence::record(stream, device_);
}

void CudaCopyEngine::synchronize() {
  for (cuda::Stream s : streams_) api_.check(api_.cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

}  // namespace rp
