// Collectives between the processes of one data-parallel group: the few operations chunk-granular
// ZeRO-3 needs (docs/design.md section 9), behind a small interface of our own. Backends: "local"
// (one process, world size 1), "mpi" (Open MPI over host memory, the CPU and emulated-device
// backend; built when CMake finds MPI) and "nccl" (CUDA tensors, PyTorch's ProcessGroupNCCL;
// built in CUDA builds, for the CUDA engine: make_nccl_communicator).
//
//   auto comm = patrickstar::communicator_from_env();   // MPI under mpirun, else local
//   comm->all_gather(my_chunk, group_buffer);            // group_buffer: world_size chunks, rank
//   order
//
// Every rank calls the same collectives in the same order with the same sizes; a call returns when
// it is complete on this rank. Arguments are checked before anything is sent, so a bad call throws
// c10::Error on every rank that makes it (a rank that alone makes a bad call leaves the others
// waiting until the launcher's timeout). Counts are ints in MPI: a call over more than 2^31 - 1
// elements (a whole group buffer included) is refused. Tensors are contiguous, on the CPU or a
// GPU: each backend works on its own device's (MPI the CPU's, NCCL this process's GPU, local any)
// and takes the others through a staging copy on its device (MPI: a CUDA tensor through pinned
// host memory, synchronizing with the tensor's stream; NCCL: a CPU tensor through device memory).
// Not thread-safe: one thread drives a communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

namespace patrickstar {

enum class ReduceOp { kSum, kMax };

// What this rank passed through collectives since the communicator was made: calls, and bytes as
// they are counted for the traffic formulas (all-gather: the output, world_size x the input;
// reduce-scatter: the fp32 input; all-reduce, broadcast and reduce: the buffer).
struct CollectiveCounters {
  int64_t all_gather_calls = 0;
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatter_calls = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t all_reduce_calls = 0;
  int64_t all_reduce_bytes = 0;
  int64_t broadcast_calls = 0;
  int64_t broadcast_bytes = 0;
  int64_t reduce_calls = 0;
  int64_t reduce_bytes = 0;

  // Two communicators' counts together (an engine's world, shard group and replica group).
  CollectiveCounters& operator+=(const CollectiveCounters& o) {
    all_gather_calls += o.all_gather_calls;
    all_gather_bytes += o.all_gather_bytes;
    reduce_scatter_calls += o.reduce_scatter_calls;
    reduce_scatter_bytes += o.reduce_scatter_bytes;
    all_reduce_calls += o.all_reduce_calls;
    all_reduce_bytes += o.all_reduce_bytes;
    broadcast_calls += o.broadcast_calls;
    broadcast_bytes += o.broadcast_bytes;
    reduce_calls += o.reduce_calls;
    reduce_bytes += o.reduce_bytes;
    return *this;
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string_view backend() const = 0;

  // `out` (world_size x in.numel() elements, in's dtype) receives every rank's `in`, in rank order.
  // `in` may be this rank's slice of `out` (a chunk gathered into its group buffer, in place).
  void all_gather(const at::Tensor& in, const at::Tensor& out);
  // `out` (fp32, n elements) receives the sum over ranks of in_flat[rank * n, (rank + 1) * n).
  // `in_flat` (world_size x n elements) is fp32, bf16 or fp16; 16-bit values are summed in fp32
  // (MPI has no bf16, and fp32 sums are the more accurate: the owner's shard feeds the fp32 Adam).
  void reduce_scatter_sum(const at::Tensor& in_flat, const at::Tensor& out);
  // In place over ranks; fp32, fp64 or int64.
  void all_reduce(const at::Tensor& buffer, ReduceOp op);
  // `buffer` takes root's values on every rank.
  void broadcast(const at::Tensor& buffer, int root);
  // fp32 or fp64: root's `buffer` becomes the sum over ranks of every rank's `buffer`, in place; the
  // other ranks' buffers are inputs, left unchanged (one chunk's gradients into its owner).
  void reduce_sum(const at::Tensor& buffer, int root);
  virtual void barrier() = 0;

  // Sub-groups (hybrid sharding, docs/design.md section 9). Each is a collective every rank of this
  // communicator calls, in the same order; the result is a communicator of its own (same backend,
  // counters from zero, its own deadline) that outlives nothing of this one's but the process.
  // The ranks passing the same `color` (>= 0), ranked by `key`, then by rank here.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // The ranks that share this rank's host: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) under MPI;
  // under torchrun (NCCL) the LOCAL_WORLD_SIZE consecutive ranks of this one's node.
  virtual std::unique_ptr<Communicator> split_by_host() = 0;

  const CollectiveCounters& counters() const { return counters_; }

 protected:
  // True when `in` is this rank's slice of `out` (gathered in place: MPI_IN_PLACE).
  bool gathers_in_place(const at::Tensor& in, const at::Tensor& out) const;
  // The device whose tensors the backend's do_* calls take; a tensor elsewhere is staged there.
  virtual c10::Device native_device() const { return c10::Device(c10::kCPU); }
  // Whether `t` goes to do_* as it is (the local backend takes every device).
  virtual bool takes(const at::Tensor& t) const { return t.device() == native_device(); }
  // Called after the arguments were checked; `in_fp32` is in_flat converted to fp32.
  virtual void do_all_gather(const at::Tensor& in, const at::Tensor& out) = 0;
  virtual void do_reduce_scatter_sum(const at::Tensor& in_fp32, const at::Tensor& out) = 0;
  virtual void do_all_reduce(const at::Tensor& buffer, ReduceOp op) = 0;
  virtual void do_broadcast(const at::Tensor& buffer, int root) = 0;
  virtual void do_reduce_sum(const at::Tensor& buffer, int root) = 0;

 private:
  // A tensor the backend does not take, copied to (stage_in) or made on (stage_out) its device,
  // and copied back (unstage); a tensor it takes is itself.
  at::Tensor stage_in(const at::Tensor& t) const;
  at::Tensor stage_out(const at::Tensor& t) const;
  static void unstage(const at::Tensor& staged, const at::Tensor& t);

  CollectiveCounters counters_;
};

// One process: world size 1, collectives are copies.
std::unique_ptr<Communicator> make_local_communicator();
// MPI_COMM_WORLD (initializing MPI once per process, finalized at exit). Throws c10::Error when this
// build has no MPI.
std::unique_ptr<Communicator> make_mpi_communicator();
// Whether this build has the MPI backend.
bool mpi_available();
// NCCL over PyTorch's ProcessGroupNCCL, rendezvous torchrun style (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT; a TCPStore on rank 0), one GPU per rank (LOCAL_RANK). Throws
// c10::Error when this build has no NCCL backend or the environment is incomplete.
std::unique_ptr<Communicator> make_nccl_communicator();
bool nccl_available();
// Collectives through c10d's TCPStore on rank 0 (same rendezvous as NCCL; no MPI, no GPU per rank):
// slow and exact, every reduction in rank order. For tests where Open MPI is absent (two ranks
// sharing one GPU), and CPU ranks under torchrun. Every build has it.
std::unique_ptr<Communicator> make_store_communicator();
// MPI when the process was started by an MPI launcher (mpirun sets OMPI_COMM_WORLD_SIZE, Hydra
// PMI_SIZE); when torchrun's variables say several ranks (WORLD_SIZE > 1 and MASTER_ADDR), the
// backend PATRICKSTAR_COMM_BACKEND names ("nccl" or "store"; by default NCCL where this build has
// it, else the store); else local. A launcher whose backend this build lacks: c10::Error.
std::unique_ptr<Communicator> communicator_from_env();

}  // namespace patrickstar
