// CUDA backend of the copy engine: four streams on one device.
//
// Each queue is a stream, created here (non-blocking; the activation streams
// at the device's highest priority, which helps kernels of those streams but,
// as docs/transfers.md notes, does not reorder copies: the window dependencies do)
// or borrowed by raw handle from torch (torch.cuda.Stream.cuda_stream).
// A submission makes the stream wait for CUDA fences on the GPU (host fences
// are waited for on the calling thread), issues cudaMemcpyAsync with
// cudaMemcpyDefault (unified addressing tells the direction), and records an
// event owned by the returned fence.
#pragma once

#include <array>
#include <mutex>

#include "copy_engine.h"
#include "cuda_loader.h"

namespace rp {

class CudaCopyEngine : public CopyEngine {
 public:
  // streams: empty (create four) or exactly four raw cudaStream_t handles in
  // queue order (act_up, act_down, param_up, grad_down), kept alive by the caller.
  CudaCopyEngine(int device, const std::vector<cuda::Stream>& streams);
  ~CudaCopyEngine() override;

  FencePtr submit(CopyQueue q, std::vector<CopyOp> ops, std::vector<FencePtr> after, int64_t tag) override;
  void synchronize() override;
  std::string backend() const override { return "cuda"; }
  int device() const { return device_; }
  cuda::Stream stream(CopyQueue q) const { return streams_[static_cast<int>(q)]; }

 private:
  const cuda::Api& api_;
  const int device_;
  std::array<cuda::Stream, kNumQueues> streams_{};
  bool owns_streams_ = false;
  std::mutex mu_;  // keeps wait + copies + record of one submission contiguous on its stream
};

}  // namespace rp
