// ps_copy_bench: host <-> device bandwidth of patrickstar's chunk copies against the plain copy of
// the same bytes between the same two blocks (cudaMemcpy on CUDA, std::memcpy on the emulated
// device). Chunk-sized payloads come from the tiers the engine uses (HostTier: pinned where a GPU
// is; CudaDeviceTier or EmulatedDeviceTier) and cross through the engine's copy engine
// (CudaCopyStream or the copy thread), three ways per direction:
//   reference  the plain copy, one chunk after the other;
//   waited     submit_copy then wait, one chunk after the other (a synchronous move);
//   queued     every chunk of a round submitted, then drain (how prefetch issues moves);
// the three interleaved round by round.
// The bytes are checked after the round trip. GB/s are 1e9 bytes per second; the ratios are the
// figure to compare across machines. Exit status: 0 measured, 1 an error (or bytes changed), 3 no
// GPU for --device cuda (nothing measured). Usage:
//
//   ps_copy_bench --device cuda --chunk-bytes 64MiB --chunks 8 --rounds 5 --json copy.json
#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/cuda_copy_stream.h"
#include "patrickstar/chunk/cuda_device_tier.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/engine/config.h"
#include "dashed_flags.h"

#ifdef PATRICKSTAR_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

ABSL_FLAG(std::string, device, "emulated", "emulated or cuda (device 0)");
ABSL_FLAG(std::string, chunk_bytes, "64MiB", "bytes per chunk payload, e.g. 64MiB");
ABSL_FLAG(int64_t, chunks, 8, "payloads per round (each direction)");
ABSL_FLAG(int64_t, rounds, 5, "timed rounds per way (after one untimed round)");
ABSL_FLAG(std::string, json, "", "write the figures to this JSON file");

namespace patrickstar {
namespace {

using Clock = std::chrono::steady_clock;

struct Setup {
  bool cuda = false;
  int64_t chunk_bytes = 0;
  int64_t chunks = 0;
  int64_t rounds = 0;
};

// The plain copy the figures are measured against, synchronous like cudaMemcpy.
void reference_copy(bool cuda, void* dst, const void* src, int64_t bytes) {
#ifdef PATRICKSTAR_HAVE_CUDA
  if (cuda) {
    const cudaError_t status =
        cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault);
    TORCH_CHECK(status == cudaSuccess, "cudaMemcpy of ", bytes, " bytes failed: ",
                cudaGetErrorString(status));
    return;
  }
#else
  TORCH_CHECK(!cuda, "this build has no CUDA support");
#endif
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

struct Way {
  double reference_gbps = 0;
  double waited_gbps = 0;
  double queued_gbps = 0;
};

double gbps(int64_t bytes, Clock::duration elapsed) {
  const double seconds = std::chrono::duration<double>(elapsed).count();
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

// One direction: `to[i]` <- `from[i]` for every payload, three ways. One untimed round of each,
// then `rounds` rounds of the three ways interleaved (the machine's drift meets all three alike).
Way measure(const Setup& setup, CopyEngine& copies, MemoryTier& device, CopyDirection direction,
            const std::vector<void*>& to, const std::vector<void*>& from) {
  const char* name = direction == CopyDirection::kHostToDevice ? "h2d" : "d2h";
  auto reference_round = [&] {
    for (int64_t i = 0; i < setup.chunks; ++i) {
      reference_copy(setup.cuda, to[i], from[i], setup.chunk_bytes);
    }
  };
  auto waited_round = [&] {
    for (int64_t i = 0; i < setup.chunks; ++i) {
      copies.wait(copies.submit_copy(device, to[i], from[i], setup.chunk_bytes, direction,
                                     absl::StrFormat("%s %d", name, i)));
    }
  };
  auto queued_round = [&] {
    for (int64_t i = 0; i < setup.chunks; ++i) {
      copies.submit_copy(device, to[i], from[i], setup.chunk_bytes, direction,
                         absl::StrFormat("%s %d", name, i));
    }
    copies.drain();
  };
  reference_round();
  waited_round();
  queued_round();
  Clock::duration reference{}, waited{}, queued{};
  auto time = [](auto round, Clock::duration& total) {
    const Clock::time_point start = Clock::now();
    round();
    total += Clock::now() - start;
  };
  for (int64_t r = 0; r < setup.rounds; ++r) {
    time(reference_round, reference);
    time(waited_round, waited);
    time(queued_round, queued);
  }
  const int64_t bytes = setup.chunk_bytes * setup.chunks * setup.rounds;
  return Way{gbps(bytes, reference), gbps(bytes, waited), gbps(bytes, queued)};
}

double ratio(double value, double reference) { return reference > 0 ? value / reference : 0.0; }

void print_way(const char* direction, const char* reference, const Way& way) {
  absl::PrintF("%-4s %-9s %8.2f GB/s\n", direction, reference, way.reference_gbps);
  absl::PrintF("%-4s %-9s %8.2f GB/s  %.3fx %s\n", direction, "waited", way.waited_gbps,
              ratio(way.waited_gbps, way.reference_gbps), reference);
  absl::PrintF("%-4s %-9s %8.2f GB/s  %.3fx %s\n", direction, "queued", way.queued_gbps,
              ratio(way.queued_gbps, way.reference_gbps), reference);
}

std::string way_json(const Way& way) {
  return absl::StrFormat(
      "{\"reference_gbps\": %.4f, \"waited_gbps\": %.4f, \"queued_gbps\": %.4f, "
      "\"waited_ratio\": %.4f, \"queued_ratio\": %.4f}",
      way.reference_gbps, way.waited_gbps, way.queued_gbps,
      ratio(way.waited_gbps, way.reference_gbps), ratio(way.queued_gbps, way.reference_gbps));
}

int run(const Setup& setup) {
  HostTier host;
  std::unique_ptr<MemoryTier> device;
  std::unique_ptr<CopyEngine> copies;
#ifdef PATRICKSTAR_HAVE_CUDA
  if (setup.cuda) {
    device = std::make_unique<CudaDeviceTier>(0);
    copies = std::make_unique<CudaCopyStream>(0);
  }
#endif
  if (!setup.cuda) {
    device = std::make_unique<EmulatedDeviceTier>(MemoryTier::kUnlimited);
    copies = std::make_unique<CopyQueue>();
  }
  const char* reference = setup.cuda ? "cudaMemcpy" : "memcpy";
  absl::PrintF("ps_copy_bench: %s, %d payloads of %d bytes, %d rounds per way; host %s\n",
              setup.cuda ? "cuda:0" : "emulated device", setup.chunks, setup.chunk_bytes,
              setup.rounds, host.pinned() ? "pinned" : "pageable");

  std::vector<void*> sent, device_blocks, returned;
  for (int64_t i = 0; i < setup.chunks; ++i) {
    sent.push_back(host.allocate(setup.chunk_bytes));
    returned.push_back(host.allocate(setup.chunk_bytes));
    device_blocks.push_back(device->allocate(setup.chunk_bytes));
    auto* bytes = static_cast<unsigned char*>(sent.back());
    for (int64_t b = 0; b < setup.chunk_bytes; ++b) {
      bytes[b] = static_cast<unsigned char>((b * 131 + i * 7) >> 3);
    }
    std::memset(returned.back(), 0, static_cast<size_t>(setup.chunk_bytes));
  }
  const Way h2d =
      measure(setup, *copies, *device, CopyDirection::kHostToDevice, device_blocks, sent);
  const Way d2h =
      measure(setup, *copies, *device, CopyDirection::kDeviceToHost, returned, device_blocks);
  bool intact = true;
  for (int64_t i = 0; i < setup.chunks; ++i) {
    const size_t bytes = static_cast<size_t>(setup.chunk_bytes);
    intact = intact && std::memcmp(sent[i], returned[i], bytes) == 0;
  }
  print_way("h2d", reference, h2d);
  print_way("d2h", reference, d2h);
  absl::PrintF("round trip: %s\n", intact ? "bytes identical" : "BYTES CHANGED");

  const std::string json = absl::GetFlag(FLAGS_json);
  if (!json.empty()) {
    std::ofstream out(json);
    out << absl::StrFormat(
        "{\"device\": \"%s\", \"reference\": \"%s\", \"host_pinned\": %s, \"chunk_bytes\": %d, "
        "\"chunks\": %d, \"rounds\": %d, \"gb\": \"1e9 bytes\", \"h2d\": %s, \"d2h\": %s, "
        "\"round_trip_identical\": %s}\n",
        setup.cuda ? "cuda" : "emulated", reference, host.pinned() ? "true" : "false",
        setup.chunk_bytes, setup.chunks, setup.rounds, way_json(h2d), way_json(d2h),
        intact ? "true" : "false");
    TORCH_CHECK(out.good(), "could not write ", json);
  }
  for (int64_t i = 0; i < setup.chunks; ++i) {
    host.deallocate(sent[i]);
    host.deallocate(returned[i]);
    device->deallocate(device_blocks[i]);
  }
  return intact ? 0 : 1;
}

}  // namespace
}  // namespace patrickstar

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "host <-> device bandwidth of patrickstar's chunk copies against cudaMemcpy (or memcpy on "
      "the emulated device)\n  ps_copy_bench --device cuda --chunk-bytes 64MiB --json copy.json");
  std::vector<std::string> args;
  std::vector<char*> pointers = patrickstar::dashed_flags(argc, argv, args);
  absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
  try {
    patrickstar::Setup setup;
    const std::string device = absl::GetFlag(FLAGS_device);
    if (device != "emulated" && device != "cuda") {
      absl::FPrintF(stderr, "ps_copy_bench: --device is \"%s\"; it takes emulated or cuda\n",
                    device);
      return 1;
    }
    setup.cuda = device == "cuda";
    setup.chunk_bytes =
        patrickstar::parse_byte_size(absl::GetFlag(FLAGS_chunk_bytes), "--chunk-bytes");
    setup.chunks = absl::GetFlag(FLAGS_chunks);
    setup.rounds = absl::GetFlag(FLAGS_rounds);
    if (setup.chunk_bytes <= 0 || setup.chunks <= 0 || setup.rounds <= 0) {
      absl::FPrintF(stderr, "ps_copy_bench: --chunk-bytes, --chunks and --rounds must be > 0\n");
      return 1;
    }
    if (setup.cuda) {
#ifndef PATRICKSTAR_HAVE_CUDA
      absl::PrintF("ps_copy_bench: this build has no CUDA support: nothing measured\n");
      return 3;
#else
      if (!torch::cuda::is_available()) {
        absl::PrintF("ps_copy_bench: LibTorch sees no CUDA device here: nothing measured\n");
        return 3;
      }
#endif
    }
    return patrickstar::run(setup);
  } catch (const c10::Error& error) {
    absl::FPrintF(stderr, "ps_copy_bench: %s\n", error.what_without_backtrace());
    return 1;
  } catch (const std::exception& error) {
    absl::FPrintF(stderr, "ps_copy_bench: %s\n", error.what());
    return 1;
  }
}
