#include "patrickstar/comm/communicator.h"

#include <cstdlib>
#include <string>

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace patrickstar {
namespace {

void check_tensor(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.defined() && (t.device().is_cpu() || t.device().is_cuda()) && t.is_contiguous(),
              "patrickstar::Communicator::", op, ": ", what,
              " must be a contiguous CPU or CUDA tensor");
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string_view backend() const override { return "local"; }
  void barrier() override {}
  bool takes(const at::Tensor& /*t*/) const override { return true; }  // copies work anywhere
  std::unique_ptr<Communicator> split(int color, int /*key*/) override {
    TORCH_CHECK(color >= 0, "patrickstar::Communicator::split: color ", color, " is negative");
    return std::make_unique<LocalCommunicator>();
  }
  std::unique_ptr<Communicator> split_by_host() override {
    return std::make_unique<LocalCommunicator>();
  }

 protected:
  void do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    if (in.data_ptr() != out.data_ptr()) out.view(in.sizes()).copy_(in);
  }
  void do_reduce_scatter_sum(const at::Tensor& in_fp32, const at::Tensor& out) override {
    out.copy_(in_fp32.view(out.sizes()));
  }
  void do_all_reduce(const at::Tensor& /*buffer*/, ReduceOp /*op*/) override {}
  void do_broadcast(const at::Tensor& /*buffer*/, int /*root*/) override {}
  void do_reduce_sum(const at::Tensor& /*buffer*/, int /*root*/) override {}
};

}  // namespace

at::Tensor Communicator::stage_in(const at::Tensor& t) const {
  if (takes(t)) return t;
  const bool to_host = native_device().is_cpu();
  at::Tensor staged = at::empty(
      t.sizes(), t.options().device(native_device()).pinned_memory(to_host && t.is_cuda()));
  staged.copy_(t);  // from a GPU: waits for the tensor's stream, then the host has it
  return staged;
}

at::Tensor Communicator::stage_out(const at::Tensor& t) const {
  if (takes(t)) return t;
  const bool to_host = native_device().is_cpu();
  return at::empty(t.sizes(),
                   t.options().device(native_device()).pinned_memory(to_host && t.is_cuda()));
}

void Communicator::unstage(const at::Tensor& staged, const at::Tensor& t) {
  if (!staged.is_same(t)) t.copy_(staged);
}

void Communicator::all_gather(const at::Tensor& in, const at::Tensor& out) {
  check_tensor(in, "all_gather", "the input");
  check_tensor(out, "all_gather", "the output");
  TORCH_CHECK(in.scalar_type() == out.scalar_type() && out.numel() == world_size() * in.numel(),
              "patrickstar::Communicator::all_gather: the output must hold world_size (", world_size(),
              ") x the input's ", in.numel(), " elements of ", in.scalar_type(), "; it holds ",
              out.numel(), " of ", out.scalar_type());
  TORCH_CHECK(!overlaps(in, out) || gathers_in_place(in, out),
              "patrickstar::Communicator::all_gather: the input overlaps the output other than as "
              "this rank's slice of it (rank ", rank(), ")");
  const at::Tensor native_out = stage_out(out);
  // In place stays in place only where nothing is staged (a staged buffer is memory of its own).
  const at::Tensor native_in =
      native_out.is_same(out) && gathers_in_place(in, out) ? in : stage_in(in);
  do_all_gather(native_in, native_out);
  unstage(native_out, out);
  ++counters_.all_gather_calls;
  counters_.all_gather_bytes += out.nbytes();
}

void Communicator::reduce_scatter_sum(const at::Tensor& in_flat, const at::Tensor& out) {
  check_tensor(in_flat, "reduce_scatter_sum", "the input");
  check_tensor(out, "reduce_scatter_sum", "the output");
  const at::ScalarType t = in_flat.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
              "patrickstar::Communicator::reduce_scatter_sum: the input is ", t,
              "; it takes fp32, bf16 or fp16");
  TORCH_CHECK(out.scalar_type() == at::kFloat && in_flat.numel() == world_size() * out.numel(),
              "patrickstar::Communicator::reduce_scatter_sum: the output must be fp32 with the input's ",
              in_flat.numel(), " elements / world_size (", world_size(), "); it holds ", out.numel(),
              " of ", out.scalar_type());
  TORCH_CHECK(!overlaps(in_flat, out), "patrickstar::Communicator::reduce_scatter_sum: the output "
              "overlaps the input; give it memory of its own");
  const at::Tensor in_fp32 = stage_in(t == at::kFloat ? in_flat : in_flat.to(at::kFloat));
  const at::Tensor native_out = stage_out(out);
  do_reduce_scatter_sum(in_fp32, native_out);
  unstage(native_out, out);
  ++counters_.reduce_scatter_calls;
  counters_.reduce_scatter_bytes += in_fp32.nbytes();
}

void Communicator::all_reduce(const at::Tensor& buffer, ReduceOp op) {
  check_tensor(buffer, "all_reduce", "the buffer");
  const at::ScalarType t = buffer.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kLong,
              "patrickstar::Communicator::all_reduce: the buffer is ", t,
              "; it takes fp32, fp64 or int64");
  const at::Tensor native = stage_in(buffer);
  do_all_reduce(native, op);
  unstage(native, buffer);
  ++counters_.all_reduce_calls;
  counters_.all_reduce_bytes += buffer.nbytes();
}

void Communicator::broadcast(const at::Tensor& buffer, int root) {
  check_tensor(buffer, "broadcast", "the buffer");
  TORCH_CHECK(root >= 0 && root < world_size(), "patrickstar::Communicator::broadcast: root ", root,
              " is not a rank of this group of ", world_size());
  const at::Tensor native = stage_in(buffer);
  do_broadcast(native, root);
  unstage(native, buffer);
  ++counters_.broadcast_calls;
  counters_.broadcast_bytes += buffer.nbytes();
}

void Communicator::reduce_sum(const at::Tensor& buffer, int root) {
  check_tensor(buffer, "reduce_sum", "the buffer");
  const at::ScalarType t = buffer.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble, "patrickstar::Communicator::reduce_sum: the "
              "buffer is ", t, "; it takes fp32 or fp64");
  TORCH_CHECK(root >= 0 && root < world_size(), "patrickstar::Communicator::reduce_sum: root ", root,
              " is not a rank of this group of ", world_size());
  const at::Tensor native = stage_in(buffer);
  do_reduce_sum(native, root);
  if (rank() == root) unstage(native, buffer);  // the other ranks' buffers are inputs
  ++counters_.reduce_calls;
  counters_.reduce_bytes += buffer.nbytes();
}

bool Communicator::gathers_in_place(const at::Tensor& in, const at::Tensor& out) const {
  return in.numel() > 0 &&
         static_cast<const char*>(in.data_ptr()) ==
             static_cast<const char*>(out.data_ptr()) + static_cast<int64_t>(rank()) * in.nbytes();
}

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

std::unique_ptr<Communicator> communicator_from_env() {
  // Open MPI's mpirun, MPICH's Hydra, and PMIx launchers (srun --mpi=pmix). A launcher that
  // started one process (its size variable says 1) needs no MPI: the local backend serves it.
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
                        std::getenv("PMI_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr;
  if (!launched) {
    // torchrun's variables (WORLD_SIZE above 1 with MASTER_ADDR): NCCL, one GPU per rank.
    const char* world = std::getenv("WORLD_SIZE");
    const bool torchrun = world != nullptr && std::string(world) != "1" &&
                          std::string(world) != "" && std::getenv("MASTER_ADDR") != nullptr;
    if (!torchrun) return make_local_communicator();
    const char* named = std::getenv("PATRICKSTAR_COMM_BACKEND");
    const std::string backend = named != nullptr && *named != '\0' ? named
                                : nccl_available()                 ? "nccl"
                                                                   : "store";
    TORCH_CHECK(backend == "nccl" || backend == "store", "patrickstar: PATRICKSTAR_COMM_BACKEND=\"",
                backend, "\" under torchrun's variables; it takes \"nccl\" or \"store\"");
    if (backend == "store") return make_store_communicator();
    TORCH_CHECK(nccl_available(), "patrickstar: WORLD_SIZE=", world,
                " and MASTER_ADDR are set "
                "(torchrun style) and PATRICKSTAR_COMM_BACKEND asks for NCCL, but this build has "
                "none (a CUDA build with a CUDA LibTorch has it); PATRICKSTAR_COMM_BACKEND=store "
                "runs CPU ranks");
    return make_nccl_communicator();
  }
  for (const char* size : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const char* value = std::getenv(size);
    if (value != nullptr && std::string(value) == "1") return make_local_communicator();
  }
  TORCH_CHECK(mpi_available(), "patrickstar: the process was started by an MPI launcher, but this "
              "build has no MPI backend (install Open MPI, e.g. apt-get install libopenmpi-dev, and "
              "configure again)");
  return make_mpi_communicator();
}

#ifndef PATRICKSTAR_HAVE_NCCL
bool nccl_available() { return false; }
std::unique_ptr<Communicator> make_nccl_communicator() {
  TORCH_CHECK(false, "patrickstar: this build has no NCCL backend (a CUDA build with a CUDA "
              "LibTorch compiles it)");
}
#endif

#ifndef PATRICKSTAR_HAVE_MPI
bool mpi_available() { return false; }
std::unique_ptr<Communicator> make_mpi_communicator() {
  TORCH_CHECK(false, "patrickstar: this build has no MPI backend (install Open MPI, e.g. apt-get "
              "install libopenmpi-dev, and configure again)");
}
#endif

}  // namespace patrickstar
