// Where every byte goes (issue: scale): the breakdowns the engine keeps at its device peak and its
// host peak account for every chunk payload once, by kind and tier, and stay within the tiers'
// exact peaks and the device's capacity.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <string>

#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace memory_breakdown_test {

using namespace test;  // NOLINT: the shared helpers of gpt_training.h

// Every payload of every kind, from the store's own figures (not from a breakdown).
std::array<int64_t, kChunkKindCount> payload_bytes_by_kind(const ChunkStore& store) {
  std::array<int64_t, kChunkKindCount> out{};
  for (ChunkId id = 0; id < store.chunk_count(); ++id) {
    out[static_cast<size_t>(store.kind_of(id))] += store.chunk_bytes(id);
  }
  return out;
}

void expect_accounts_for_everything(const Engine& engine, const MemoryBreakdown& b,
                                    const char* which) {
  SCOPED_TRACE(which);
  ASSERT_GE(b.iteration, 0);
  EXPECT_FALSE(b.moment.empty());
  const auto expected = payload_bytes_by_kind(inspect(engine).chunks());
  for (int k = 0; k < kChunkKindCount; ++k) {
    const auto i = static_cast<size_t>(k);
    EXPECT_EQ(b.device_chunk_bytes[i] + b.host_chunk_bytes[i], expected[i]) << "kind " << k;
  }
  EXPECT_EQ(b.device_chunk_total() + b.host_chunk_total(), engine.registration().model_data_bytes);
  // Payloads are blocks of their tier; the rest of a tier's blocks are "other".
  EXPECT_LE(b.device_chunk_total(), b.device_used_bytes);
  EXPECT_LE(b.host_chunk_total(), b.host_used_bytes);
  // Tier blocks stay within each tier's hard capacity (the tiers' peak_bytes() restart every
  // iteration, so they are no bound on an earlier iteration's figures).
  EXPECT_LE(b.device_used_bytes, inspect(engine).device_tier().capacity_bytes());
  EXPECT_LE(b.host_used_bytes, inspect(engine).host_tier().capacity_bytes());
  // Cached blocks are what the tier holds beyond its used bytes, within its reserved peak.
  EXPECT_GE(b.device_cached_bytes, 0);
  EXPECT_GE(b.host_cached_bytes, 0);
  EXPECT_LE(b.device_used_bytes + b.device_cached_bytes, inspect(engine).device_tier().peak_reserved_bytes());
  EXPECT_LE(b.host_used_bytes + b.host_cached_bytes, inspect(engine).host_tier().peak_reserved_bytes());
  // The scheduler's budget: the payloads on the device next to the live non-model bytes fit the
  // capacity. (The sources of evictions still being copied are blocks beyond it until their
  // copies complete: "other" in the breakdown, docs/design.md.)
  EXPECT_LE(b.device_chunk_total() + b.device_non_model_bytes,
            engine.config().device.capacity_bytes)
      << "iteration " << b.iteration << " moment " << b.moment << " payloads "
      << b.device_chunk_total() << " non-model " << b.device_non_model_bytes;
}

TEST(MemoryBreakdown, PeaksAccountForEveryPayloadOnceByKindAndTier) {
  // fp32, bf16 (an fp32 master kind), bf16 with a gradient space; each moves every iteration.
  struct Case {
    const char* extra;
    int64_t chunk_room;  // bytes for chunks beyond the measured non-model peak (0: tight_config)
  };
  for (const Case& c : {Case{"{}", 0}, Case{R"({"bf16": {"enabled": true}})", 240000},
                        Case{R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2})",
                             480000}}) {
    SCOPED_TRACE(c.extra);
    models::Gpt model = make_model(1);
    const Config config = c.chunk_room == 0 ? tight_config(c.extra)
                                            : config_with_chunk_room(c.extra, c.chunk_room);
    Engine engine(model.ptr(), config);
    const int micro = config.gradient_accumulation_steps;
    for (int step = 0; step < 3; ++step) {
      auto batch = batch_of_step(step);
      engine.zero_grad();
      for (int k = 0; k < micro; ++k) {
        const int64_t rows = batch.tokens.size(0) / micro;
        at::Tensor loss;
        {
          auto active = engine.activate();
          loss = model->loss(batch.tokens.narrow(0, k * rows, rows),
                             batch.targets.narrow(0, k * rows, rows));
        }
        engine.backward(loss);
      }
      engine.step();
    }
    const MemoryBreakdown& device = engine.device_peak_breakdown();
    const MemoryBreakdown& host = engine.host_peak_breakdown();
    expect_accounts_for_everything(engine, device, "device peak");
    expect_accounts_for_everything(engine, host, "host peak");
    // Each is the highest of its tier over the moments seen, the other's moment included.
    EXPECT_GE(device.device_total(), host.device_total());
    EXPECT_GE(host.host_used_bytes, device.host_used_bytes);
    // The device held chunks at its peak and the trace's non-model bytes were seen.
    EXPECT_GT(device.device_chunk_total(), 0);
    EXPECT_GT(device.device_non_model_bytes, 0);
  }
}

}  // namespace memory_breakdown_test
}  // namespace patrickstar
