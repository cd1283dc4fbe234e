#include "fence.h"

#include <chrono>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "checks.h"

namespace rp {

bool Fence::done() {
  const FenceState s = poll();
  if (s == FenceState::Failed) throw std::runtime_error(std::string(kind()) + " fence failed: " + error());
  return s == FenceState::Done;
}

void Fence::wait() {
  if (block() == FenceState::Failed) throw std::runtime_error(std::string(kind()) + " fence failed: " + error());
}

FenceState HostFence::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

FenceState HostFence::block() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return state_ != FenceState::Pending; });
  return state_;
}

FenceState HostFence::block_for(double seconds) {
  // Past ~292 years the wait in nanoseconds overflows the clock's int64.
  if (!(seconds >= 0 && seconds <= kMaxWaitSeconds))
    throw std::invalid_argument("seconds=" + check::num(seconds) + " must be a number in [0, 1e9]");
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return state_ != FenceState::Pending; });
  return state_;
}

std::string HostFence::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void HostFence::set() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == FenceState::Pending) state_ = FenceState::Done;
  }
  cv_.notify_all();
}

void HostFence::fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == FenceState::Pending) {
      state_ = FenceState::Failed;
      error_ = message;
    }
  }
  cv_.notify_all();
}

std::shared_ptr<CudaEventFence> CudaEventFence::borrow(cuda::Event event) {
  if (!event) throw std::invalid_argument("event is a null cudaEvent_t");
  const cuda::Api* api = cuda::api();
  if (!api) throw std::runtime_error("a CUDA event fence needs CUDA, which is unavailable: " + cuda::status());
  return std::shared_ptr<CudaEventFence>(new CudaEventFence(*api, event, false));
}

namespace {

// Free events per device.  Every fence used to create and destroy its own event (two driver
// calls per copy and per compute fence); the pool keeps up to kKeep per device for reuse.
// Never destroyed: fences may die during static destruction, after a pool object would have.
struct EventPool {
  static constexpr size_t kKeep = 4096;
  std::mutex mu;
  std::vector<std::vector<cuda::Event>> free;
  int64_t created = 0;
  int64_t reused = 0;
};

EventPool& event_pool() {
  static EventPool* pool = new EventPool();
  return *pool;
}

}  // namespace

std::pair<int64_t, int64_t> CudaEventFence::pool_stats() {
  EventPool& pool = event_pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  return {pool.created, pool.reused};
}

std::shared_ptr<CudaEventFence> CudaEventFence::record(cuda::Stream stream, int device, const cuda::Api* fake) {
  const cuda::Api& api = fake ? *fake : cuda::require_runtime("recording a CUDA event");
  if (device < 0 || device >= api.device_count)
    throw std::invalid_argument("device=" + std::to_string(device) + " is out of range; " +
                                std::to_string(api.device_count) + " CUDA devices are visible");
  const bool pooled = fake == nullptr;  // a stand-in's events never mix with real ones
  cuda::Event event = nullptr;
  EventPool& pool = event_pool();
  if (pooled) {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pool.free.size() <= static_cast<size_t>(device)) pool.free.resize(device + 1);
    auto& mine = pool.free[device];
    if (!mine.empty()) {
      event = mine.back();
      mine.pop_back();
      ++pool.reused;
    }
  }
  // The device's context for the create and the record: a thread with no context current (a
  // completion thread) would otherwise get one made for GPU 0.
  cuda::DeviceGuard guard(api, device);
  if (!event) {
    // Every fence may be waited on by the host (arena limits, Fence.wait, copy-queue waits):
    // without cudaEventBlockingSync cudaEventSynchronize spins a core for the whole wait,
    // beside the OpenMP optimizer step that needs every core.
    api.check(api.cudaEventCreateWithFlags(&event, cuda::kHostWaitedEventFlags), "cudaEventCreateWithFlags");
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pooled) ++pool.created;
  }
  // Owned from here on: an error below gives the event back to the pool through the fence.
  auto fence = std::shared_ptr<CudaEventFence>(new CudaEventFence(api, event, true, device, pooled));
  api.check(api.cudaEventRecord(event, stream), "cudaEventRecord");
  return fence;
}

CudaEventFence::~CudaEventFence() {
  if (!owned_) return;
  EventPool& pool = event_pool();
  if (pooled_) {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (device_ >= 0 && static_cast<size_t>(device_) < pool.free.size() &&
        pool.free[device_].size() < EventPool::kKeep) {
      pool.free[device_].push_back(event_);
      return;
    }
  }
  if (api_.cudaEventDestroy) api_.cudaEventDestroy(event_);
}

FenceState CudaEventFence::from_code(int code) {
  if (code == cuda::kSuccess) return FenceState::Done;
  if (code == cuda::kNotReady) return FenceState::Pending;
  last_error_ = code;
  return FenceState::Failed;
}

FenceState CudaEventFence::poll() { return from_code(api_.event_query(event_)); }

FenceState CudaEventFence::block() { return from_code(api_.event_synchronize(event_)); }

std::string CudaEventFence::error() const { return last_error_ ? api_.error_string(last_error_) : std::string(); }

void CudaEventFence::make_stream_wait(cuda::Stream stream) const {
  const cuda::Api& api = cuda::require_runtime("making a stream wait on an event");
  api.check(api.cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

}  // namespace rp
