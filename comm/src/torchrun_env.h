// Private to comm/src: the rendezvous torchrun's variables describe (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), shared by the backends that use it (NCCL, store):
// the variables read and checked, the collective deadline, and the TCPStore on rank 0 that every
// rank joins.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace patrickstar::comm_detail {

// Variable `name`'s value; `backend` names who needs it in the error.
inline std::string torchrun_env(const char* name, const char* backend) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0', "patrickstar: the ", backend, " backend needs ",
              name, " (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)");
  return value;
}

inline int torchrun_int(const char* name, const char* backend, int64_t low, int64_t high) {
  const std::string text = torchrun_env(name, backend);
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(end != text.c_str() && *end == '\0' && value >= low && value <= high,
              "patrickstar: ", name, "=\"", text, "\" is not an integer in [", low, ", ", high,
              "]");
  return static_cast<int>(value);
}

// PATRICKSTAR_COMM_TIMEOUT_S (default 600 s): how long a collective may wait for the other ranks.
inline std::chrono::milliseconds collective_timeout() {
  const char* text = std::getenv("PATRICKSTAR_COMM_TIMEOUT_S");
  double seconds = 600.0;
  if (text != nullptr && *text != '\0') {
    char* end = nullptr;
    seconds = std::strtod(text, &end);
    TORCH_CHECK(end != text && *end == '\0' && seconds > 0 && seconds < 1e9,
                "patrickstar: PATRICKSTAR_COMM_TIMEOUT_S=\"", text,
                "\" is not a positive number of seconds (this backend needs a limit)");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// This rank and the world from RANK and WORLD_SIZE.
struct TorchrunRank {
  int rank = 0;
  int size = 1;
};

inline TorchrunRank torchrun_rank(const char* backend) {
  TorchrunRank r;
  r.rank = torchrun_int("RANK", backend, 0, 1 << 20);
  r.size = torchrun_int("WORLD_SIZE", backend, 1, 1 << 20);
  TORCH_CHECK(r.rank < r.size, "patrickstar: RANK ", r.rank, " is not below WORLD_SIZE ", r.size);
  return r;
}

// The TCPStore at MASTER_ADDR:MASTER_PORT, once every rank has joined: served by rank 0, or under
// torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True) by the agent, which every rank joins as a
// client (a second server on its port would split the ranks between two stores). One per process,
// shared by every communicator made from the variables (rank 0 can serve its port once); each
// communicator keys its collectives under torchrun_prefix().
inline c10::intrusive_ptr<c10d::Store> torchrun_store(const TorchrunRank& r, const char* backend,
                                                      std::chrono::milliseconds timeout) {
  static std::mutex mutex;
  static c10::intrusive_ptr<c10d::Store> shared;
  std::lock_guard<std::mutex> lock(mutex);
  if (shared) return shared;
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(torchrun_int("MASTER_PORT", backend, 1, 65535));
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_serves = agent != nullptr && std::string(agent) == "True";
  options.isServer = r.rank == 0 && !agent_serves;
  options.numWorkers = agent_serves ? std::nullopt : std::optional<std::size_t>(r.size);
  options.waitWorkers = !agent_serves;
  options.timeout = timeout;
  shared = c10::make_intrusive<c10d::TCPStore>(torchrun_env("MASTER_ADDR", backend), options);
  return shared;
}

// A key prefix of its own for each communicator made from torchrun's variables in this process:
// every rank makes them in the same order (making one is collective), so the n-th is the same
// group on every rank.
inline std::string torchrun_prefix(const char* backend) {
  static std::atomic<int> made{0};
  // snprintf, not string concatenation, which GCC 12 at -O2 misreads as out of bounds.
  char prefix[64];
  std::snprintf(prefix, sizeof(prefix), "patrickstar/%s%d/", backend, made++);
  return prefix;
}

}  // namespace patrickstar::comm_detail
