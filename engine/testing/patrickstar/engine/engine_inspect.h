// What this project's tests and benchmarks look at inside an Engine: its chunk store, scheduler,
// tracer, tiers, the Adam placement and the communicator. Test-only: seen by this build tree (the
// engine library's testing/ folder), not installed. Training code does not need it (engine.h is the API);
// everything here is read-only except the tiers, whose peaks a benchmark may reset.
// The chunk store is replaced when "default_chunk_size": "auto" moves the model into smaller
// chunks (a step whose IterationReport::chunk_elems_retried is not 0): a reference to it taken
// before such a step dangles after it; take it again. (The scheduler stays, with a new chunk
// table.)
//
//   const patrickstar::ChunkStore& store = patrickstar::inspect(engine).chunks();
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "patrickstar/chunk/chunk_store.h"
#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/comm/communicator.h"
#include "patrickstar/engine/engine.h"
#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"

namespace patrickstar {

class EngineInspector {
 public:
  explicit EngineInspector(const Engine& engine) : core_(*engine.core_) {}

  // The chunks as the serial step leaves them: host Adam updates the overlapped step made ahead in
  // the backward in progress are undone first (that backward's step then updates them itself).
  const ChunkStore& chunks() const;
  // The overlapped step's optimizer thread, one span per chunk index it updated ahead, while the
  // timeline is recorded (Engine::set_record_timeline); on the scheduler's clock.
  std::vector<CopySpan> optimizer_spans() const;
  const Scheduler& scheduler() const;
  const TraceRecorder& tracer() const;
  MemoryTier& device_tier() const;
  MemoryTier& host_tier() const;
  // Adam for chunk index i runs on the device: decided at the first step() after the trace was
  // dropped (the first iteration's, and the one after each retrace) from the margin its moments
  // measured; a warm-up repeated because its trace did not fit keeps the placement it had.
  const std::vector<bool>& adam_on_device() const;
  // Chunk index i belongs to CPU embeddings (use_cpu_embedding): it never moves to the device.
  bool host_only(int64_t chunk_index) const;
  // Data parallel: whether this rank owns chunk index i (keeps its optimizer state; always true
  // with one process), and the communicator the engine uses.
  bool owns(int64_t chunk_index) const;
  const Communicator& communicator() const;
  // "plan": "auto": the other chunk sizes the plan considers, and the trace it predicts for chunks
  // of `chunk_elems` (for the engine's own size, after the warm-up: the scheduler's trace); nullopt
  // where it has none.
  std::vector<int64_t> plan_chunk_sizes() const;
  std::optional<Trace> plan_trace_of(int64_t chunk_elems) const;
  // After the plan: the trace it weighed for Engine::plan().candidates[candidate] (its chunk size
  // and activations; the step moment as the margin's placement has it); nullopt before.
  std::optional<Trace> plan_candidate_trace(int candidate) const;
  // Applies the plan's candidate `candidate` as if the engine had chosen it (between iterations;
  // the one thing here that changes the engine: tests run every candidate through it); -1: as if
  // none fitted (the config's own settings).
  static void apply_plan_candidate(Engine& engine, int candidate);

 private:
  const engine_detail::EngineImpl& core_;
};

inline EngineInspector inspect(const Engine& engine) { return EngineInspector(engine); }

}  // namespace patrickstar
