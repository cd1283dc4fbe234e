// A minimal io_uring: the raw syscalls and the two shared rings, for one thread.
//
// No liburing: the extension must build and load where it is not installed.
// What is used is what the kernel has offered since Linux 5.6 (IORING_OP_READ,
// IORING_OP_WRITE, IORING_OP_TIMEOUT, IORING_REGISTER_PROBE):
//
//   setup    io_uring_setup(entries) gives a file descriptor and the offsets of
//            the submission (SQ) and completion (CQ) rings; mmap maps them (one
//            mapping where IORING_FEAT_SINGLE_MMAP says both share it) and the
//            array of submission entries (SQEs).
//   submit   fill the SQE at sq_tail & mask, store its index in the SQ array,
//            publish the new tail (release); io_uring_enter(to_submit) hands
//            them to the kernel, which copies each SQE when it consumes it.
//   complete the kernel appends a CQE {user_data, res} at cq_tail; read the
//            entries up to the tail (acquire), then publish the new head.
//
// One thread owns a Uring: nothing here is locked.  The caller bounds the
// operations in flight by the ring's size, so a free SQE always exists and the
// completion ring (twice the submission ring) cannot overflow.
//
// Kernels and headers without it: Uring::open returns null and says why (no
// <linux/io_uring.h> at build time, io_uring_setup refused: ENOSYS on old
// kernels, EPERM where /proc/sys/kernel/io_uring_disabled or a seccomp filter
// forbids it, a missing opcode), and the file store uses its thread pool.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#endif
#if defined(IORING_FEAT_RW_CUR_POS)  // the 5.6 header: IORING_OP_READ/WRITE and the probe
#define RP_HAVE_IO_URING 1
#else
#define RP_HAVE_IO_URING 0
struct io_uring_sqe;
#endif

namespace rp {

class Uring {
 public:
  // A ring with room for at least `entries` operations in flight, or null with the reason in *why.
  static std::unique_ptr<Uring> open(unsigned entries, std::string* why);
  ~Uring();
  Uring(const Uring&) = delete;
  Uring& operator=(const Uring&) = delete;

  // The next submission entry, zeroed, tagged with user_data; the caller fills the rest.
  io_uring_sqe* prepare(uint64_t user_data);
  // Submits what was prepared and, when `wait`, blocks until at least one completion is there.
  // 0, or the errno of io_uring_enter (EINTR is 0: the caller reaps and loops).
  int enter(bool wait);
  // Calls fn(user_data, res) for each completion posted so far.
  template <class F>
  void reap(F&& fn) {
    uint64_t data;
    int res;
    while (pop(&data, &res)) fn(data, res);
  }
  // Takes back entries prepared but not consumed by the kernel (after enter failed): fn(user_data) for each.
  template <class F>
  void unprepare(F&& fn) {
    uint64_t data;
    while (unprepare_one(&data)) fn(data);
  }
  unsigned entries() const { return sq_entries_; }

 private:
  Uring() = default;
  bool pop(uint64_t* data, int* res);
  bool unprepare_one(uint64_t* data);

  int fd_ = -1;
  void* sq_map_ = nullptr;
  void* cq_map_ = nullptr;
  size_t sq_map_bytes_ = 0, cq_map_bytes_ = 0, sqes_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  void* cqes_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, sq_entries_ = 0;
  unsigned unsubmitted_ = 0;  // prepared entries not yet passed to io_uring_enter
};

}  // namespace rp
