// Host backend of the copy engine: the four queues served by memcpy workers.
//
// Two worker threads stand for the two PCIe directions: "up" serves act_up
// and param_up, "down" serves act_down and grad_down.  Each worker always
// takes the head of its activation queue when that head is ready (its "after"
// fences completed) and only otherwise the head of its bulk queue: strict
// software priority, non-preemptive like a DMA engine, so a bulk copy already
// running finishes first.  This is what the CUDA backend achieves with
// window dependencies, made observable: history() lists the order in which
// submissions started, and pause()/resume() let tests queue work first.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "copy_engine.h"

namespace rp {

class HostCopyEngine : public CopyEngine {
 public:
  // threads_per_copy > 1 splits copies of >= 1 MiB over that many threads.
  explicit HostCopyEngine(int threads_per_copy = 1);
  ~HostCopyEngine() override;

  FencePtr submit(CopyQueue q, std::vector<CopyOp> ops, std::vector<FencePtr> after, int64_t tag) override;
  void synchronize() override;
  std::string backend() const override { return "host"; }

  void pause();
  void resume();
  // (queue, tag) of the last started submissions, oldest first (at most 65536).
  std::vector<std::pair<CopyQueue, int64_t>> history() const;

 private:
  struct Task {
    CopyQueue queue;
    std::vector<CopyOp> ops;
    std::vector<FencePtr> after;
    std::shared_ptr<HostFence> done;
    int64_t tag;
  };
  struct Link {
    std::deque<Task> act, bulk;
  };
  static bool ready(const Task& t);
  bool pick_locked(Link& link, Task* out, bool* blocked);
  void worker(int link);
  void run(Task& t) const;

  const int threads_per_copy_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  Link links_[2];
  size_t outstanding_ = 0;
  bool paused_ = false, stopping_ = false;
  std::deque<std::pair<CopyQueue, int64_t>> history_;
  std::thread workers_[2];
};

}  // namespace rp
