#include "uring.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace rp {

#if RP_HAVE_IO_URING

namespace {

// The syscall numbers are the same on every architecture (the unified table since 5.1).
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(::syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

int sys_register(int fd, unsigned opcode, void* arg, unsigned nr) {
  return static_cast<int>(::syscall(__NR_io_uring_register, fd, opcode, arg, nr));
}

unsigned* at(void* base, uint32_t offset) { return reinterpret_cast<unsigned*>(static_cast<char*>(base) + offset); }

std::string errno_name(int e) {
  char buf[256];
  return std::string(strerror_r(e, buf, sizeof buf));
}

}  // namespace

std::unique_ptr<Uring> Uring::open(unsigned entries, std::string* why) {
  io_uring_params p;
  std::memset(&p, 0, sizeof p);
  const int fd = sys_setup(entries, &p);
  if (fd < 0) {
    const int e = errno;
    *why = "io_uring_setup: " + errno_name(e) +
           (e == EPERM ? " (disabled: /proc/sys/kernel/io_uring_disabled or a seccomp filter)"
                       : e == ENOSYS ? " (the kernel has no io_uring)" : "");
    return nullptr;
  }
  std::unique_ptr<Uring> u(new Uring());
  u->fd_ = fd;
  // The probe (5.6) lists the opcodes this kernel supports.
  std::vector<char> probe_mem(sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op), 0);
  auto* probe = reinterpret_cast<io_uring_probe*>(probe_mem.data());
  if (sys_register(fd, IORING_REGISTER_PROBE, probe, 256) < 0) {
    *why = "IORING_REGISTER_PROBE: " + errno_name(errno) + " (a kernel before 5.6)";
    return nullptr;
  }
  for (unsigned op : {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_TIMEOUT})
    if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
      *why = "the kernel's io_uring lacks opcode " + std::to_string(op);
      return nullptr;
    }
  u->sq_map_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  u->cq_map_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
  if (single) u->sq_map_bytes_ = u->cq_map_bytes_ = std::max(u->sq_map_bytes_, u->cq_map_bytes_);
  const auto map = [&](size_t n, off_t what) {
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
    if (m == MAP_FAILED) {
      *why = "mmap of the io_uring rings: " + errno_name(errno);
      return static_cast<void*>(nullptr);
    }
    return m;
  };
  if (!(u->sq_map_ = map(u->sq_map_bytes_, IORING_OFF_SQ_RING))) return nullptr;
  if (single) u->cq_map_ = u->sq_map_;
  else if (!(u->cq_map_ = map(u->cq_map_bytes_, IORING_OFF_CQ_RING))) return nullptr;
  u->sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
  void* sqes = map(u->sqes_bytes_, IORING_OFF_SQES);
  if (!sqes) return nullptr;
  u->sqes_ = static_cast<io_uring_sqe*>(sqes);
  u->sq_head_ = at(u->sq_map_, p.sq_off.head);
  u->sq_tail_ = at(u->sq_map_, p.sq_off.tail);
  u->sq_mask_ = *at(u->sq_map_, p.sq_off.ring_mask);
  u->sq_array_ = at(u->sq_map_, p.sq_off.array);
  u->sq_entries_ = p.sq_entries;
  u->cq_head_ = at(u->cq_map_, p.cq_off.head);
  u->cq_tail_ = at(u->cq_map_, p.cq_off.tail);
  u->cq_mask_ = *at(u->cq_map_, p.cq_off.ring_mask);
  u->cqes_ = static_cast<char*>(u->cq_map_) + p.cq_off.cqes;
  return u;
}

Uring::~Uring() {
  if (sqes_) ::munmap(sqes_, sqes_bytes_);
  if (cq_map_ && cq_map_ != sq_map_) ::munmap(cq_map_, cq_map_bytes_);
  if (sq_map_) ::munmap(sq_map_, sq_map_bytes_);
  if (fd_ >= 0) ::close(fd_);
}

io_uring_sqe* Uring::prepare(uint64_t user_data) {
  const unsigned tail = *sq_tail_;  // only this thread writes it
  // The caller bounds what is in flight by entries(): a full ring is a bug.
  if (tail - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE) >= sq_entries_) std::abort();
  const unsigned index = tail & sq_mask_;
  io_uring_sqe* sqe = &sqes_[index];
  std::memset(sqe, 0, sizeof *sqe);
  sqe->user_data = user_data;
  sq_array_[index] = index;
  __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
  ++unsubmitted_;
  return sqe;
}

int Uring::enter(bool wait) {
  const int n = sys_enter(fd_, unsubmitted_, wait ? 1 : 0, wait ? IORING_ENTER_GETEVENTS : 0);
  if (n < 0) return errno == EINTR ? 0 : errno;
  unsubmitted_ -= static_cast<unsigned>(n) < unsubmitted_ ? static_cast<unsigned>(n) : unsubmitted_;
  return 0;
}

bool Uring::pop(uint64_t* data, int* res) {
  const unsigned head = *cq_head_;
  if (head == __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE)) return false;
  const io_uring_cqe& cqe = static_cast<const io_uring_cqe*>(cqes_)[head & cq_mask_];
  *data = cqe.user_data;
  *res = cqe.res;
  __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
  return true;
}

bool Uring::unprepare_one(uint64_t* data) {
  const unsigned tail = *sq_tail_;
  if (unsubmitted_ == 0 || tail == __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE)) {
    unsubmitted_ = 0;
    return false;
  }
  *data = sqes_[(tail - 1) & sq_mask_].user_data;
  __atomic_store_n(sq_tail_, tail - 1, __ATOMIC_RELEASE);
  --unsubmitted_;
  return true;
}

#else  // built without <linux/io_uring.h> (or one older than Linux 5.6)

std::unique_ptr<Uring> Uring::open(unsigned, std::string* why) {
  *why = "built without <linux/io_uring.h> from Linux 5.6 or later";
  return nullptr;
}
Uring::~Uring() = default;
io_uring_sqe* Uring::prepare(uint64_t) { std::abort(); }
int Uring::enter(bool) { return ENOSYS; }
bool Uring::pop(uint64_t*, int*) { return false; }
bool Uring::unprepare_one(uint64_t*) { return false; }

#endif

}  // namespace rp
