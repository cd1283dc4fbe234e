#include "copy_host.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "checks.h"

namespace rp {
namespace {

constexpr size_t kHistory = 65536;
constexpr size_t kSplitBytes = size_t{1} << 20;
// How often a worker re-checks heads blocked on fences it cannot be woken by
// (CUDA events, fences of other engines).  50 us is far below one copy window.
constexpr auto kDependencyPoll = std::chrono::microseconds(50);

int link_of(CopyQueue q) { return (q == CopyQueue::ActUp || q == CopyQueue::ParamUp) ? 0 : 1; }

void parallel_memcpy(void* dst, const void* src, size_t n, int threads) {
  if (threads <= 1 || n < kSplitBytes) {
    std::memcpy(dst, src, n);
    return;
  }
  const size_t per = (n / threads + 63) / 64 * 64;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
  for (int t = 0; t < threads; ++t) {
    const size_t begin = static_cast<size_t>(t) * per;
    if (begin >= n) continue;
    const size_t len = begin + per < n && t + 1 < threads ? per : n - begin;
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len);
  }
}

}  // namespace

HostCopyEngine::HostCopyEngine(int threads_per_copy) : threads_per_copy_(threads_per_copy) {
  check::threads("threads_per_copy", threads_per_copy);
  for (int l = 0; l < 2; ++l) workers_[l] = std::thread([this, l] { worker(l); });
}

HostCopyEngine::~HostCopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    paused_ = false;
  }
  work_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

FencePtr HostCopyEngine::submit(CopyQueue q, std::vector<CopyOp> ops, std::vector<FencePtr> after, int64_t tag) {
  for (const auto& f : after)
    if (!f) throw std::invalid_argument("after contains None; pass only fences");
  auto done = std::make_shared<HostFence>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw std::runtime_error("the copy engine is shutting down");
    Link& link = links_[link_of(q)];
    (is_activation(q) ? link.act : link.bulk).push_back(Task{q, std::move(ops), std::move(after), done, tag});
    ++outstanding_;
  }
  work_cv_.notify_all();
  return done;
}

bool HostCopyEngine::ready(const Task& t) {
  for (const auto& f : t.after)
    if (f->poll() == FenceState::Pending) return false;
  return true;
}

bool HostCopyEngine::pick_locked(Link& link, Task* out, bool* blocked) {
  *blocked = false;
  for (std::deque<Task>* q : {&link.act, &link.bulk}) {
    if (q->empty()) continue;
    // On shutdown a head blocked on a fence is not waited for: it fails in run().
    if (stopping_ || ready(q->front())) {
      *out = std::move(q->front());
      q->pop_front();
      return true;
    }
    *blocked = true;
  }
  return false;
}

void HostCopyEngine::worker(int l) {
  Link& link = links_[l];
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    Task task;
    bool blocked = false;
    if (paused_ || !pick_locked(link, &task, &blocked)) {
      if (stopping_ && link.act.empty() && link.bulk.empty()) return;
      if (blocked && !paused_) {
        work_cv_.wait_for(lock, kDependencyPoll);
      } else {
        work_cv_.wait(lock);
      }
      continue;
    }
    history_.emplace_back(task.queue, task.tag);
    if (history_.size() > kHistory) history_.pop_front();
    lock.unlock();
    run(task);
    lock.lock();
    --outstanding_;
    idle_cv_.notify_all();
  }
}

void HostCopyEngine::run(Task& t) const {
  for (const auto& f : t.after) {
    const FenceState s = f->poll();
    if (s == FenceState::Failed) {
      t.done->fail(std::string("a fence this copy waited on failed: ") + f->error());
      return;
    }
    if (s == FenceState::Pending) {
      t.done->fail("the copy engine was destroyed before this copy's fences completed");
      return;
    }
  }
  for (const CopyOp& op : t.ops) parallel_memcpy(op.dst, op.src, op.nbytes, threads_per_copy_);
  t.done->set();
}

void HostCopyEngine::synchronize() {
  std::unique_lock<std::mutex> lock(mu_);
  if (paused_ && outstanding_ > 0)
    throw std::runtime_error("synchronize() on a paused copy engine with " + std::to_string(outstanding_) +
                             " submissions queued would never return; call resume() first");
  idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
}

void HostCopyEngine::pause() {
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = true;
}

void HostCopyEngine::resume() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
  }
  work_cv_.notify_all();
}

std::vector<std::pair<CopyQueue, int64_t>> HostCopyEngine::history() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {history_.begin(), history_.end()};
}

}  // namespace rp
