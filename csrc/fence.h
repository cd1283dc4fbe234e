// Fences: "has this piece of asynchronous work finished?", whatever ran it.
//
// The arena defers reuse of a freed block until every fence recorded against
// it has completed, and the copy engine returns one per submitted copy.  Three
// kinds share the interface:
//   HostFence       set by a host thread (the copy engine's host backend), or by
//                   hand: tests use it as the fake event that they complete
//                   whenever they choose;
//   CudaEventFence  a cudaEvent_t queried through the dlopen'd runtime/driver,
//                   either recorded and owned by roundpipe or borrowed by raw
//                   handle (the owner must keep the event alive meanwhile).
// poll() never throws, so allocator bookkeeping cannot be interrupted by a
// failed copy; done()/wait() are the user-facing forms and throw on failure.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "cuda_loader.h"

namespace rp {

enum class FenceState { Pending, Done, Failed };

class Fence {
 public:
  virtual ~Fence() = default;
  virtual FenceState poll() = 0;
  // Blocks until the fence is no longer pending; never throws.
  virtual FenceState block() = 0;
  // Why the work failed (empty unless poll() says Failed).
  virtual std::string error() const = 0;
  virtual const char* kind() const = 0;
  // The cudaEvent_t behind the fence, or nullptr for host fences.
  virtual cuda::Event cuda_event() const { return nullptr; }

  bool done();   // true when complete; std::runtime_error when the work failed
  void wait();   // blocks; std::runtime_error when the work failed
};

using FencePtr = std::shared_ptr<Fence>;

class HostFence : public Fence {
 public:
  explicit HostFence(bool already_set = false) : state_(already_set ? FenceState::Done : FenceState::Pending) {}
  FenceState poll() override;
  FenceState block() override;
  std::string error() const override;
  const char* kind() const override { return "host"; }
  void set();                             // marks the work complete, wakes waiters
  void fail(const std::string& message);  // marks the work failed with a reason
  // Waits at most `seconds` (in [0, kMaxWaitSeconds], else std::invalid_argument);
  // returns the state reached.
  static constexpr double kMaxWaitSeconds = 1e9;
  FenceState block_for(double seconds);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  FenceState state_;
  std::string error_;
};

class CudaEventFence : public Fence {
 public:
  // Borrows an existing event (not destroyed here).
  static std::shared_ptr<CudaEventFence> borrow(cuda::Event event);
  // Takes an event of `device` from the pool (creating one only when the pool is empty),
  // records it on `stream`, and gives it back to the pool when the fence dies.  Re-recording
  // a pooled event is safe: a stream that waited on it captured the earlier record.  Events
  // are created with cuda::kHostWaitedEventFlags: block() sleeps rather than spins.  `api`
  // replaces the loaded runtime (tests pass a cuda::FakeCuda's; its events are not pooled).
  static std::shared_ptr<CudaEventFence> record(cuda::Stream stream, int device, const cuda::Api* api = nullptr);
  // Events created and records served from the pool since start (for tests and stats).
  static std::pair<int64_t, int64_t> pool_stats();
  ~CudaEventFence() override;
  FenceState poll() override;
  FenceState block() override;
  std::string error() const override;
  const char* kind() const override { return "cuda"; }
  cuda::Event cuda_event() const override { return event_; }
  // Makes `stream` wait for this event (on the GPU; the host does not block).
  void make_stream_wait(cuda::Stream stream) const;

 private:
  CudaEventFence(const cuda::Api& api, cuda::Event event, bool owned, int device = -1, bool pooled = false)
      : api_(api), event_(event), owned_(owned), pooled_(pooled), device_(device) {}
  FenceState from_code(int code);
  const cuda::Api& api_;
  cuda::Event event_;
  bool owned_;
  bool pooled_;                      // goes back to the pool of `device_` (else destroyed)
  int device_;                       // the pool the event goes back to (owned events)
  std::atomic<int> last_error_{0};  // poll() may run on several threads
};

}  // namespace rp
