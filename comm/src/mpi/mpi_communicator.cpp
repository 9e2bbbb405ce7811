// The MPI backend: MPI_COMM_WORLD over host memory. MPI is initialized once per process
// (MPI_THREAD_SERIALIZED: one thread at a time calls MPI) and finalized at exit. Errors return to
// us (MPI_ERRORS_RETURN) and become c10::Error with MPI's text.
//
// A dead or hung rank: MPI itself waits forever for a peer that stopped without exiting. Every
// collective here has a deadline (PATRICKSTAR_COMM_TIMEOUT_S seconds, default 600, 0 for none); a
// watchdog thread that sees one pass prints which collective on which rank waited, and ends the
// process with exit code 3, and mpirun then ends the whole job. (It does not call MPI_Abort:
// under MPI_THREAD_SERIALIZED a second thread may not call MPI while the first is inside a
// collective.) A rank that dies outright is seen by mpirun directly, which ends the job too.
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

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

// The deadline of the collective in progress, watched by a thread of its own.
class Watchdog {
 public:
  Watchdog(int rank, int size, double timeout_s) : rank_(rank), size_(size), timeout_s_(timeout_s) {
    if (timeout_s_ > 0) thread_ = std::thread([this] { watch(); });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Arms the deadline for one collective while it lives.
  class Scope {
   public:
    Scope(Watchdog& dog, const char* call) : dog_(dog) { dog_.begin(call); }
    ~Scope() { dog_.end(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Watchdog& dog_;
  };

 private:
  using Clock = std::chrono::steady_clock;
  void begin(const char* call) {
    std::lock_guard<std::mutex> lock(mutex_);
    call_ = call;
    ++serial_;
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(timeout_s_));
    active_ = true;
  }
  void end() {
    std::lock_guard<std::mutex> lock(mutex_);
    active_ = false;
  }
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(100));
      if (!active_ || Clock::now() < deadline_) continue;
      std::fprintf(stderr,
                   "patrickstar: rank %d of %d: %s (collective #%lld of this rank) did not complete "
                   "within %.0f s: another rank has died or hangs. Ending this process so that the "
                   "launcher ends the job (PATRICKSTAR_COMM_TIMEOUT_S sets the limit).\n",
                   rank_, size_, call_, static_cast<long long>(serial_), timeout_s_);
      std::fflush(stderr);
      std::_Exit(3);
    }
  }

  const int rank_;
  const int size_;
  const double timeout_s_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  bool active_ = false;
  const char* call_ = "";
  int64_t serial_ = 0;
  Clock::time_point deadline_;
  std::thread thread_;
};

double timeout_from_env() {
  const char* text = std::getenv("PATRICKSTAR_COMM_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return 600.0;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  TORCH_CHECK(end != text && *end == '\0' && value >= 0 && value < 1e9,
              "patrickstar: PATRICKSTAR_COMM_TIMEOUT_S=\"", text,
              "\" is not a number of seconds (>= 0; 0 waits forever)");
  return value;
}

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
  // MPI_COMM_WORLD's ranks.
  MpiCommunicator() {
    init_mpi_once();
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    start();
  }
  // A communicator MPI made (split): this one frees it.
  explicit MpiCommunicator(MPI_Comm made) : comm_(made) { start(); }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  void barrier() override {
    Watchdog::Scope deadline(*watchdog_, "MPI_Barrier");
    check_mpi(MPI_Barrier(comm_), "MPI_Barrier");
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    TORCH_CHECK(color >= 0, "patrickstar::Communicator::split: color ", color, " is negative");
    MPI_Comm made = MPI_COMM_NULL;
    {
      Watchdog::Scope deadline(*watchdog_, "MPI_Comm_split");
      check_mpi(MPI_Comm_split(comm_, color, key, &made), "MPI_Comm_split");
    }
    return std::make_unique<MpiCommunicator>(made);
  }
  std::unique_ptr<Communicator> split_by_host() override {
    MPI_Comm made = MPI_COMM_NULL;
    {
      Watchdog::Scope deadline(*watchdog_, "MPI_Comm_split_type");
      check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &made),
                "MPI_Comm_split_type");
    }
    return std::make_unique<MpiCommunicator>(made);
  }

 protected:
  void do_all_gather(const at::Tensor& in, const at::Tensor& out) override {
    const ElementType element(in);
    const int n = count_of(in.numel(), "all_gather");
    count_of(out.numel(), "all_gather");  // the whole group buffer, too
    // The input may be this rank's slice of the output (a chunk gathered into its group buffer).
    const void* send = gathers_in_place(in, out) ? MPI_IN_PLACE : in.data_ptr();
    Watchdog::Scope deadline(*watchdog_, "MPI_Allgather");
    check_mpi(MPI_Allgather(send, n, element.get(), out.data_ptr(), n, element.get(), comm_),
              "MPI_Allgather");
  }
  void do_reduce_scatter_sum(const at::Tensor& in_fp32, const at::Tensor& out) override {
    const int n = count_of(out.numel(), "reduce_scatter_sum");
    count_of(in_fp32.numel(), "reduce_scatter_sum");
    Watchdog::Scope deadline(*watchdog_, "MPI_Reduce_scatter_block");
    check_mpi(MPI_Reduce_scatter_block(in_fp32.data_ptr(), out.data_ptr(), n, MPI_FLOAT, MPI_SUM,
                                       comm_),
              "MPI_Reduce_scatter_block");
  }
  void do_all_reduce(const at::Tensor& buffer, ReduceOp op) override {
    const int n = count_of(buffer.numel(), "all_reduce");
    Watchdog::Scope deadline(*watchdog_, "MPI_Allreduce");
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), n, reduce_type(buffer.scalar_type()),
                            op == ReduceOp::kSum ? MPI_SUM : MPI_MAX, comm_),
              "MPI_Allreduce");
  }
  void do_broadcast(const at::Tensor& buffer, int root) override {
    const ElementType element(buffer);
    Watchdog::Scope deadline(*watchdog_, "MPI_Bcast");
    check_mpi(MPI_Bcast(buffer.data_ptr(), count_of(buffer.numel(), "broadcast"), element.get(), root,
                        comm_),
              "MPI_Bcast");
  }
  void do_reduce_sum(const at::Tensor& buffer, int root) override {
    const int n = count_of(buffer.numel(), "reduce_sum");
    const MPI_Datatype type = reduce_type(buffer.scalar_type());
    Watchdog::Scope deadline(*watchdog_, "MPI_Reduce");
    if (rank_ == root) {
      check_mpi(MPI_Reduce(MPI_IN_PLACE, buffer.data_ptr(), n, type, MPI_SUM, root, comm_),
                "MPI_Reduce");
    } else {
      check_mpi(MPI_Reduce(buffer.data_ptr(), nullptr, n, type, MPI_SUM, root, comm_), "MPI_Reduce");
    }
  }

 private:
  void start() {
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    watchdog_ = std::make_unique<Watchdog>(rank_, size_, timeout_from_env());
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(); }

}  // namespace patrickstar
