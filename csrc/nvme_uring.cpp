// The io_uring backend of FileStore (csrc/nvme_io.h has the design; csrc/uring.h the ring).
//
// One thread owns the ring and `threads` slots, a slot per chunk in flight:
//
//   loop:  under mu_, fill free slots with pick_locked() chunks (the same
//          scheduler as the threads: submission order, ordering after writes,
//          poisoned regions); a chunk runs check_chunk() (injected fault, file
//          truncated or removed) and puts its body and its tail block in the
//          ring, or a timer first (the delay_s test hook)
//          unlock; io_uring_enter: submit, sleep until a completion
//          lock; reap: a short transfer is resubmitted for the rest, a chunk
//          whose entries all ended finishes (finish_chunk_locked), its slot is free
//
// The ring always holds one read of the eventfd that submit() and close()
// write to, so new work wakes the sleeping thread.  Entries in the ring never
// exceed 2 per slot + 1, which the ring was sized for.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "nvme_io.h"

namespace rp {

void FileStore::wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof one) < 0) {}  // only fails when the counter is full: a wakeup is pending anyway
}

#if RP_HAVE_IO_URING

namespace {
constexpr uint64_t kWake = ~uint64_t{0};  // user_data of the eventfd read
constexpr int kBody = 0, kTail = 1, kDelay = 2;
}  // namespace

struct FileStore::RingSlot {
  size_t index = 0;
  char* bounce = nullptr;     // 4096 bytes of this slot: the tail block
  Chunk chunk;                // no request: the slot is free
  int fault = 0;              // an injected errno for this chunk
  Span sp{};
  size_t want[2]{}, done[2]{};  // body and tail: bytes to move, bytes moved
  int error[2]{};               // errno of a part, or 0
  int pending = 0;              // this slot's entries in the ring
  __kernel_timespec delay{};
  uint64_t tag(int part) const { return static_cast<uint64_t>(index) << 2 | static_cast<uint64_t>(part); }
};

void FileStore::ring_worker() {
  const size_t depth = static_cast<size_t>(options_.threads);
  std::vector<char> bounce_mem((depth + 1) * kAlign);
  char* bounces = bounce_mem.data() + (kAlign - reinterpret_cast<std::uintptr_t>(bounce_mem.data()) % kAlign);
  std::vector<RingSlot> slots(depth);
  for (size_t i = 0; i < depth; ++i) slots[i].index = i, slots[i].bounce = bounces + i * kAlign;
  std::minstd_rand rng(static_cast<unsigned>(std::hash<std::thread::id>()(std::this_thread::get_id())));
  bool wake_armed = false;
  const auto ended = [&](uint64_t data, int res) {
    if (data == kWake) wake_armed = false;
    else ring_complete_locked(slots[data >> 2], static_cast<int>(data & 3), res);
  };
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    for (;;) {
      auto free = std::find_if(slots.begin(), slots.end(), [](const RingSlot& s) { return !s.chunk.request; });
      if (free == slots.end() || !pick_locked(&free->chunk)) break;
      ring_start_locked(*free, options_.delay_s * static_cast<double>(rng() % 1000) / 1000.0);
    }
    const bool busy = std::any_of(slots.begin(), slots.end(), [](const RingSlot& s) { return s.chunk.request; });
    if (stopping_ && queue_.empty() && !busy) return;
    if (!wake_armed) {
      io_uring_sqe* sqe = ring_->prepare(kWake);
      sqe->opcode = IORING_OP_READ;
      sqe->fd = wake_fd_;
      sqe->addr = reinterpret_cast<std::uintptr_t>(&wake_buf_);
      sqe->len = sizeof wake_buf_;
      wake_armed = true;
    }
    lock.unlock();
    const int e = ring_->enter(true);
    lock.lock();
    if (e) {
      // io_uring_enter took none of the new entries.  EAGAIN/EBUSY (out of kernel resources: "wait for some
      // completions and try again") resubmits them after a pause; any other errno fails their chunks.
      ring_->unprepare([&](uint64_t data) { ended(data, -e); });
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
    }
    ring_->reap(ended);
  }
}

// A picked chunk: skipped when an earlier chunk of its request failed, else its timer or its I/O.
void FileStore::ring_start_locked(RingSlot& s, double delay_s) {
  if (s.chunk.request->error) {
    ring_finish_locked(s, nullptr);
    return;
  }
  s.fault = take_fault_locked(s.chunk.request->kind);
  if (delay_s > 0) {
    const auto ns = static_cast<long long>(delay_s * 1e9);
    s.delay.tv_sec = ns / 1000000000;
    s.delay.tv_nsec = ns % 1000000000;
    io_uring_sqe* sqe = ring_->prepare(s.tag(kDelay));
    sqe->opcode = IORING_OP_TIMEOUT;
    sqe->addr = reinterpret_cast<std::uintptr_t>(&s.delay);
    sqe->len = 1;
    ++s.pending;
    return;
  }
  ring_issue_locked(s);
}

// The checks before a chunk's I/O, then its body and tail block into the ring (both at once).
void FileStore::ring_issue_locked(RingSlot& s) {
  try {
    check_chunk(s.chunk, s.fault);
  } catch (const IoError& e) {
    ring_finish_locked(s, std::make_shared<IoError>(e));
    return;
  }
  s.sp = span(s.chunk);
  if (s.sp.len == 0) {
    ring_finish_locked(s, nullptr);
    return;
  }
  s.want[kBody] = s.sp.body, s.want[kTail] = s.sp.tail ? kAlign : 0;
  s.done[kBody] = s.done[kTail] = 0;
  s.error[kBody] = s.error[kTail] = 0;
  // The last partial block through the slot's bounce block: written whole, zero-padded; read whole.
  if (s.sp.tail && s.chunk.request->kind == IoKind::Write) {
    std::memcpy(s.bounce, s.sp.buf + s.sp.body, s.sp.tail);
    std::memset(s.bounce + s.sp.tail, 0, kAlign - s.sp.tail);
  }
  for (int part : {kBody, kTail})
    if (s.want[part]) ring_submit(s, part);
}

// The part's remaining bytes as one READ/WRITE entry.
void FileStore::ring_submit(RingSlot& s, int part) {
  const Request& r = *s.chunk.request;
  char* buf = part == kBody ? s.sp.buf : s.bounce;
  const size_t off = part == kBody ? s.sp.off : s.sp.off + s.sp.body;
  io_uring_sqe* sqe = ring_->prepare(s.tag(part));
  sqe->opcode = r.kind == IoKind::Read ? IORING_OP_READ : IORING_OP_WRITE;
  sqe->fd = r.reg->fd;
  sqe->addr = reinterpret_cast<std::uintptr_t>(buf + s.done[part]);
  sqe->len = static_cast<uint32_t>(s.want[part] - s.done[part]);  // at most chunk_bytes <= 1 GiB
  sqe->off = off + s.done[part];
  ++s.pending;
}

// A completion of one of the slot's entries; the chunk finishes when its last entry ended.
void FileStore::ring_complete_locked(RingSlot& s, int part, int res) {
  --s.pending;
  if (part == kDelay) {  // the timer ran out (res -ETIME)
    ring_issue_locked(s);
    return;
  }
  const bool read = s.chunk.request->kind == IoKind::Read;
  if (res == -EINTR || res == -EAGAIN || res == -EBUSY) {
    ring_submit(s, part);
    return;
  }
  if (res < 0) {
    s.error[part] = -res;
  } else if (res == 0) {
    if (!read) s.error[part] = EIO;  // a write never moves 0 of n > 0 bytes; a read at 0 is the end of the file
  } else {
    s.done[part] += static_cast<size_t>(res);
    if (s.done[part] < s.want[part]) {  // a short transfer: the rest, as pread/pwrite loops do
      ring_submit(s, part);
      return;
    }
  }
  if (s.pending) return;
  // Reported as the threads would: the body's failure first, then the tail's.
  const Chunk& c = s.chunk;
  std::shared_ptr<const IoError> error;
  if (s.error[kBody]) error = std::make_shared<IoError>(chunk_errno(c, s.error[kBody]));
  else if (s.done[kBody] < s.sp.body) error = std::make_shared<IoError>(short_read(c, s.done[kBody]));
  else if (s.error[kTail]) error = std::make_shared<IoError>(chunk_errno(c, s.error[kTail]));
  else if (s.done[kTail] < s.sp.tail) error = std::make_shared<IoError>(short_read(c, s.sp.body + s.done[kTail]));
  else if (read && s.sp.tail) std::memcpy(s.sp.buf + s.sp.body, s.bounce, s.sp.tail);
  ring_finish_locked(s, std::move(error));
}

void FileStore::ring_finish_locked(RingSlot& s, std::shared_ptr<const IoError> error) {
  const Chunk c = std::move(s.chunk);
  s.chunk = Chunk{};
  finish_chunk_locked(c, std::move(error));
}

#else  // no io_uring at build time: Uring::open refuses, so the store never starts this thread

void FileStore::ring_worker() { std::abort(); }

#endif

}  // namespace rp
