// The engine's side of patrickstar::checkpoint: the activation plan's questions and the offloaded
// inputs (activation_plan.h, activation_offload.h; docs/design.md, "Activations").
#include "engine_core.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include <ATen/ops/from_blob.h>

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

ModuleHookHandler::CheckpointPlan EngineCore::plan_checkpoint(const torch::nn::Module* block,
                                                              std::optional<bool> offload) {
  std::lock_guard<EntryGate> serialized(entry_gate_);
  return activations_->planner.plan(block != nullptr, offload, recorder_->current_moment());
}

void EngineCore::checkpoint_forward_done(int64_t call, const at::Tensor& input, double seconds) {
  std::lock_guard<EntryGate> serialized(entry_gate_);
  activations_->planner.forward_done(call, static_cast<int64_t>(input.nbytes()), seconds,
                                     recorder_->current_moment());
  // The inputs offloaded before this call have been copied out meanwhile: they leave the device.
  if (activations_->store != nullptr) activations_->store->call_forward_done();
}

std::unique_ptr<OffloadedActivation> EngineCore::offload_activation(int64_t call,
                                                                    const at::Tensor& input) {
  std::lock_guard<EntryGate> serialized(entry_gate_);
  if (activations_->store == nullptr) {
    activations_->store = std::make_unique<ActivationStore>(*storage_.device(), *storage_.host(),
                                                            storage_.copy_queue());
  }
  return activations_->store->offload(call, input);
}

void EngineCore::checkpoint_recompute_begins(int64_t call) {
  std::lock_guard<EntryGate> serialized(entry_gate_);
  // Backward's next offloaded input comes back while this call recomputes.
  if (activations_->store != nullptr) activations_->store->recompute_begins();
  // (Data parallel: the groups the recompute's doors gather are not the block's activations.)
  activations_->planner.recompute_begins(call, recorder_->current_moment(),
                                         probe_->live_bytes() - probe_->gathered_bytes());
}

void EngineCore::checkpoint_recompute_done(int64_t call, double seconds) {
  std::lock_guard<EntryGate> serialized(entry_gate_);
  activations_->planner.recompute_done(call, seconds, recorder_->current_moment(),
                                       probe_->live_bytes() - probe_->gathered_bytes());
}

ActivationPlanReport EngineCore::activation_plan() const {
  return activations_->planner.report();
}

bool EngineCore::report_activations(IterationReport& report, bool may_plan) {
  if (activations_->store != nullptr) {
    const OffloadFigures f = activations_->store->figures();
    report.activation_offload_bytes = f.offloaded_bytes;
    report.activation_prefetch_bytes = f.prefetched_bytes;
    report.activation_refused_bytes = f.refused_bytes;
    report.activation_host_peak_bytes = f.host_peak_bytes;
    report.activation_host_bytes = f.host_bytes;
    activations_->store->reset_figures();
  }
  ActivationPlanner& planner = activations_->planner;
  planner.restart();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                       activations_->iteration_start)
                             .count();
  if (planner.policy() != ActivationPolicy::kAuto) planner.stop_measuring();
  if (!may_plan || !planner.wants_plan()) return false;
  ActivationPlanner::PlanInputs in;
  in.trace = &recorder_->current_trace();
  in.chunks = scheduler_chunks();
  in.scheduler = scheduler_.get();
  int64_t largest = 0;
  for (const auto& [id, chunk] : in.chunks) largest = std::max(largest, chunk.bytes);
  in.copy_bytes_per_s =
      measure_copy_bandwidth(*storage_.device(), *storage_.host(), storage_.device()->device(),
                             std::clamp<int64_t>(largest, 1 << 20, 64 << 20));
  in.copies_overlap = storage_.copy_queue() != nullptr;
  in.warmup_seconds = seconds;
  try {
    planner.make_plan(in);
  } catch (const std::exception& e) {
    // Every call stays recomputed (choices() says so to the other ranks below).
    TORCH_WARN("patrickstar: the activation plan could not be made; every call recomputes: ",
               e.what());
  }
  // Data parallel: every rank runs rank 0's plan (a recompute's doors gather on every rank).
  std::vector<uint8_t> choices = planner.choices();
  if (dp_.distributed()) {
    dp_.comm().broadcast(
        at::from_blob(choices.data(), {static_cast<int64_t>(choices.size())}, at::kByte), 0);
  }
  planner.set_choices(choices);
  activations_->planned_chunk_elems = store().chunk_elems();
  report.activation_plan_made = true;
  return true;
}

}  // namespace patrickstar
