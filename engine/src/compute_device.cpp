// Where the engine computes: the emulated device (CPU memory with a hard capacity; the default,
// and every test unless PATRICKSTAR_TEST_DEVICE=cuda) or, in builds with CUDA, GPU 0. The tier and
// copy engine it picks live here (their CUDA code in chunk/src/cuda, the probe's in
// memtracer/src/cuda); elsewhere the engine branches on the device type only where a GPU needs it:
// the constructor's refusals (copy delays, data parallel) and the probe (engine.cpp), host pinning
// (engine_registration.cpp) and the config's check of copy delays (config.cpp). The rest reads the
// tier's device().
#include <ATen/Context.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <memory>
#include <string>

#ifdef PATRICKSTAR_HAVE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/cuda_copy_stream.h"
#include "patrickstar/chunk/cuda_device_tier.h"
#include "patrickstar/chunk/memory_tier.h"

#include "engine_internal.h"

namespace patrickstar::engine_detail {

std::string device_unavailable_reason(const Config& config) {
  if (config.device.type == DeviceType::kEmulated) return "";
#ifndef PATRICKSTAR_HAVE_CUDA
  return "this build of patrickstar has no CUDA support (configure with -DPATRICKSTAR_CUDA=ON and "
         "the CUDA toolkit)";
#else
  if (!torch::cuda::is_available()) {
    return "LibTorch sees no CUDA device on this machine (torch::cuda::is_available() is false)";
  }
  const int index = resolved_device_index(config);
  const int count = static_cast<int>(torch::cuda::device_count());
  if (index >= count) {
    return "GPU " + std::to_string(index) + " (client.device.index " +
           (config.device.index == DeviceConfig::kLocalRankIndex ? "\"auto\": the local rank"
                                                                 : std::string("set")) +
           ") but this machine has " + std::to_string(count) + " GPU(s): one GPU per rank";
  }
  const int64_t total = CudaDeviceTier::total_memory_bytes(index);
  if (config.device.capacity_bytes > total) {
    return "client.device.capacity_bytes is " + std::to_string(config.device.capacity_bytes) +
           " bytes, more than GPU " + std::to_string(index) + "'s " + std::to_string(total) +
           " (it caps what patrickstar plans with; set it to at most the GPU's memory)";
  }
  return "";
#endif
}

std::unique_ptr<MemoryTier> make_device_tier(const Config& config) {
  TORCH_INTERNAL_ASSERT(config.device.capacity_bytes != DeviceConfig::kAutoCapacity,
                        "the engine resolves an \"auto\" capacity first");
  if (config.device.type == DeviceType::kEmulated) {
    return std::make_unique<EmulatedDeviceTier>(config.device.capacity_bytes);
  }
#ifdef PATRICKSTAR_HAVE_CUDA
  return std::make_unique<CudaDeviceTier>(config.device.index, config.device.capacity_bytes);
#else
  TORCH_CHECK(false, "patrickstar: internal: a CUDA device tier in a build without CUDA");
#endif
}

std::unique_ptr<CopyEngine> make_copy_engine(const Config& config) {
  if (config.device.type == DeviceType::kEmulated) {
    CopyQueueOptions options;
    options.max_delay_us = config.scheduler.copy_delay_max_us;
    options.delay_seed = static_cast<uint64_t>(config.scheduler.copy_delay_seed);
    return std::make_unique<CopyQueue>(options);
  }
  // The engine refused copy delays on CUDA before it built anything.
  TORCH_INTERNAL_ASSERT(config.scheduler.copy_delay_max_us == 0);
#ifdef PATRICKSTAR_HAVE_CUDA
  return std::make_unique<CudaCopyStream>(config.device.index);
#else
  TORCH_CHECK(false, "patrickstar: internal: a CUDA copy engine in a build without CUDA");
#endif
}

void make_current_device(const Config& config) {
#ifdef PATRICKSTAR_HAVE_CUDA
  if (config.device.type == DeviceType::kCuda) {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(config.device.index));
  }
#else
  (void)config;
#endif
}

}  // namespace patrickstar::engine_detail

namespace patrickstar {
namespace {

// A launcher's local rank variable: its value, or -1 where it is not set.
int local_rank_from(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return -1;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  TORCH_CHECK(end != text && *end == '\0' && value >= 0 && value < 1024, "patrickstar: ", name,
              "=\"", text, "\" is not a local rank (an integer from 0)");
  return static_cast<int>(value);
}

}  // namespace

int resolved_device_index(const Config& config) {
  if (config.device.type == DeviceType::kEmulated) return 0;
  if (config.device.index != DeviceConfig::kLocalRankIndex) return config.device.index;
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}) {
    if (const int rank = local_rank_from(name); rank >= 0) return rank;
  }
  return 0;
}

int64_t resolved_device_capacity(const Config& config) {
  if (config.device.type == DeviceType::kEmulated) {
    return config.device.capacity_bytes == DeviceConfig::kAutoCapacity
               ? DeviceConfig::kEmulatedAutoCapacity
               : config.device.capacity_bytes;
  }
  const std::string unavailable = engine_detail::device_unavailable_reason(config);
  TORCH_CHECK(unavailable.empty(), "patrickstar: device type \"cuda\": ", unavailable);
#ifdef PATRICKSTAR_HAVE_CUDA
  // LibTorch's CUDA side (its caching allocator among it) starts on first use; the engine's probe
  // and the reading below need it started even where the trainer has not touched CUDA yet.
  at::globalContext().lazyInitDevice(c10::kCUDA);
  if (config.device.capacity_bytes != DeviceConfig::kAutoCapacity) {
    return config.device.capacity_bytes;
  }
  return CudaDeviceTier::available_memory_bytes(resolved_device_index(config));
#else
  TORCH_CHECK(false, "patrickstar: internal: a CUDA capacity in a build without CUDA");
#endif
}

}  // namespace patrickstar
