// The MPI backend: MPI_COMM_WORLD over host memory. MPI is initialized once per process
// (MPI_THREAD_SERIALIZED: one thread at a time calls MPI) and finalized at exit. Errors return to
// us (MPI_ERRORS_RETURN) and become c10::Error with MPI's text.
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "patrickstar/comm/communicator.h"

namespace patrickstar {
namespace {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  TORCH_CHECK(false, "patrickstar: ", call, " failed: ", std::string(text, static_cast<size_t>(length)));
}

void finalize_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void init_mpi_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;  // the program initialized MPI itself
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    std::atexit(finalize_mpi);
    // Errors outside a communicator (datatypes) return too, instead of aborting the job.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  });
  // Whoever initialized MPI, the level must allow calls from the thread that drives the engine.
  int provided = 0;
  check_mpi(MPI_Query_thread(&provided), "MPI_Query_thread");
  TORCH_CHECK(provided >= MPI_THREAD_SERIALIZED, "patrickstar: MPI was initialized with thread level ",
              provided, "; patrickstar needs MPI_THREAD_SERIALIZED (MPI_Init_thread)");
}

int count_of(int64_t n, const char* op) {
  TORCH_CHECK(n <= INT_MAX, "patrickstar::Communicator::", op, ": ", n,
              " elements exceed what one MPI call takes (", INT_MAX, "); use smaller chunks");
  return static_cast<int>(n);
}

// A contiguous MPI type of one element of `t` (MPI counts elements in int).
class ElementType {
 public:
  explicit ElementType(const at::Tensor& t) {
    check_mpi(MPI_Type_contiguous(static_cast<int>(t.element_size()), MPI_BYTE, &type_),
              "MPI_Type_contiguous");
    check_mpi(MPI_Type_commit(&type_), "MPI_Type_commit");
  }
  ~ElementType() { MPI_Type_free(&type_); }
  ElementType(const ElementType&) = delete;
  ElementType& operator=(const ElementType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

MPI_Datatype reduce_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    default: TORCH_CHECK(false, "patrickstar: no MPI reduction type for ", t);
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    init_mpi_once();
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  void barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }

 protected:
  void do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    const ElementType element(in);
    const int n = count_of(in.numel(), "all_gather");
    count_of(out.numel(), "all_gather");  // the whole group buffer, too
    // The input may be this rank's slice of the output (a chunk gathered into its group buffer).
    const void* send = gathers_in_place(in, out) ? MPI_IN_PLACE : in.data_ptr();
    check_mpi(MPI_Allgather(send, n, element.get(), out.data_ptr(), n, element.get(), comm_),
              "MPI_Allgather");
  }
  void do_reduce_scatter_sum(const at::Tensor& in_fp32, const at::Tensor& out) override {
    const int n = count_of(out.numel(), "reduce_scatter_sum");
    count_of(in_fp32.numel(), "reduce_scatter_sum");
    check_mpi(MPI_Reduce_scatter_block(in_fp32.data_ptr(), out.data_ptr(), n, MPI_FLOAT, MPI_SUM,
                                       comm_),
              "MPI_Reduce_scatter_block");
  }
  void do_all_reduce(const at::Tensor& buffer, ReduceOp op) override {
    const int n = count_of(buffer.numel(), "all_reduce");
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), n, reduce_type(buffer.scalar_type()),
                            op == ReduceOp::kSum ? MPI_SUM : MPI_MAX, comm_),
              "MPI_Allreduce");
  }
  void do_broadcast(const at::Tensor& buffer, int root) override {
    const ElementType element(buffer);
    check_mpi(MPI_Bcast(buffer.data_ptr(), count_of(buffer.numel(), "broadcast"), element.get(), root,
                        comm_),
              "MPI_Bcast");
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(); }

}  // namespace patrickstar
