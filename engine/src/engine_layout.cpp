// What the engine builds over the chunk layout (the scheduler with its chunk table, the mover), and
// "auto"'s retry: a warm-up whose moment needed more than the chunk budget goes on past the budget
// (within the device's capacity), measures every moment, and at its step the engine moves the
// model into chunks of the least-waste size with which every moment fits (chunk_size_choice.h).
#include "engine_core.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

std::map<int64_t, ChunkInfo> EngineCore::scheduler_chunks() const {
  // Data parallel: other ranks' param chunks on the device are the doors' (gathered with their
  // group, dropped after use), not the scheduler's; their bytes reach its budgets as non-model
  // bytes of the trace. Other ranks' gradient chunks are scheduled (they carry gradients).
  std::map<int64_t, ChunkInfo> chunk_table;
  for (ChunkId id = 0; id < store().chunk_count(); ++id) {
    if (store().omitted(id)) continue;  // a lean index's states: never anywhere
    if (store().kind_of(id) == ChunkKind::kParam && !owns(store().index_of(id)) &&
        !storage_.host_only()[store().index_of(id)]) {
      continue;
    }
    chunk_table[id] = ChunkInfo{
        store().chunk_bytes(id),
        store().kind_of(id) == ChunkKind::kParam && !storage_.host_only()[store().index_of(id)],
        pipeline_->placement().state_on_device(id)};
  }
  return chunk_table;
}

void EngineCore::build_scheduler() {
  SchedulerOptions options;
  options.capacity_bytes = config_.device.capacity_bytes;
  options.overall_ratio = config_.mem_tracer.overall_gpu_mem_ratio;
  options.reserve_bytes = config_.scheduler.reserve_bytes;
  options.warmup_ratio = config_.mem_tracer.warmup_gpu_chunk_mem_ratio;
  options.policy = config_.scheduler.policy;
  options.prefetch_depth = config_.scheduler.prefetch_depth;
  options.warmup_overdraft = retry_.armed();
  scheduler_ = std::make_unique<Scheduler>(options, scheduler_chunks());
  scheduler_->set_clock(clock_);
}

void EngineCore::build_mover() {
  mover_ = std::make_unique<Mover>(store(), /*lazy_grads=*/dp_.shards_gradients());
  // The optimizer threads leave a chunk before it moves.
  mover_->before_move = [this](int64_t id) { pipeline_->before_chunk_move(id); };
}

void EngineCore::note_warmup_need(int64_t moment, const ModuleInfo& module, MomentKind kind,
                                  bool with_grads) {
  if (!retry_.armed() || scheduler_->has_trace()) return;
  MomentNeed need;
  need.label = absl::StrCat(moment_kind_name(kind), " '", module.label, "'");
  need.module = module.label;
  need.tensors = module.params;
  need.with_grads = with_grads;
  retry_.note_need(moment, std::move(need));
}

void EngineCore::choose_retry_chunk_size(const Trace& trace, const c10::Error& why) {
  DeviceCosts costs;
  costs.param_elem_bytes = chunk_element_bytes(store().dtype(ChunkKind::kParam));
  costs.grad_elem_bytes =
      gradients_.space() ? chunk_element_bytes(store().dtype(ChunkKind::kGrad)) : 0;
  costs.trainable.resize(params_.size());
  for (const Param& p : params_) costs.trainable[static_cast<size_t>(p.id)] = p.trainable;
  retry_.choose(trace, why, usable_device_bytes(config_), store(), costs, *storage_.host());
}

void EngineCore::move_to_chunk_size(int64_t chunk_elems, bool retried) {
  torch::NoGradGuard no_grad;
  const int64_t before = store().chunk_elems();
  const int64_t waste_before = store().layout().waste_elems();
  const int64_t overdrafts = scheduler_->current_stats().overdrafts;
  // The delayed update in flight (under "plan": "auto") writes its weights into the old chunks
  // first; the moves below then copy what it made.
  pipeline_->land_delayed_now();
  store().finish_copies();
  std::string reason;  // why the warm-up's trace did not fit, for the warning
  retry_.take_chosen(&reason);
  Layout layout = retry_.layout(chunk_elems);
  auto fresh = std::make_unique<ChunkStore>(std::move(layout), store().kinds(), *storage_.host(),
                                            *storage_.device());
  const Layout& placed = fresh->layout();
  const int64_t n = placed.chunk_count();
  const bool lean_frozen = config_.frozen_parameters == FrozenParameters::kLean;
  ModelStorage::omit_lean_states(*fresh, lean_frozen);
  // Kind by kind: the new chunks of a kind are allocated on the host, every tensor's slot copied
  // into them, and the old chunks of that kind freed, so the host holds one kind beyond the model
  // data at most. (After the step: no tensor is in use, no gradient view is shown.)
  for (const ChunkKindSpec& spec : fresh->kinds()) {
    for (int64_t i = 0; i < n; ++i) {
      const ChunkId id = fresh->chunk_id(spec.kind, i);
      if (!fresh->omitted(id)) fresh->allocate(id, Tier::kHost);
    }
    for (const Param& p : params_) {
      if (fresh->omitted(fresh->chunk_of(p.id, spec.kind))) continue;
      fresh->view(p.id, spec.kind).copy_(store().view(p.id, spec.kind));
    }
    for (int64_t i = 0; i < store().chunks_per_kind(); ++i) {
      store().release(store().chunk_id(spec.kind, i));
    }
    // The old size's blocks would sit in the tiers' caches for good: no chunk has that size now.
    storage_.host()->empty_cache();
    storage_.device()->empty_cache();
  }
  for (const Param& p : params_) p.eval_copy.reset();
  storage_.replace_store(std::move(fresh), lean_frozen);
  pipeline_->on_new_layout(store().chunk_count(), n);
  scheduler_->replace_chunks(scheduler_chunks());  // (its history stays, for the reports)
  build_mover();
  recorder_->rewarm();  // the next iteration is a warm-up over the new chunks

  RegistrationReport& r = metrics_.registration();
  r.chunk_elems = placed.chunk_elems();
  r.chunks_per_kind = n;
  r.chunk_waste_elems = placed.waste_elems();
  r.chunk_waste_fraction = placed.waste_fraction();
  r.model_data_bytes = store().total_chunk_bytes();
  r.model_data_bytes_per_param =
      static_cast<double>(r.model_data_bytes) / static_cast<double>(std::max<int64_t>(1, r.params));
  if (!retried) return;  // the plan's size: its report says why
  r.chunk_size_retries += 1;
  TORCH_WARN(
      "patrickstar: \"default_chunk_size\": \"auto\": with chunks of ", before,
      " elements (the least waste, ", waste_before,
      " elements empty) the warm-up's trace "
      "does not fit the device (",
      reason, ")",
      overdrafts > 0 ? absl::StrCat("; ", overdrafts,
                                    " of its moments went past the chunk "
                                    "budget, within the device's capacity")
                     : std::string(),
      ". The model now trains with chunks of ", chunk_elems, " elements, the least waste (",
      placed.waste_elems(),
      " elements empty) with which every moment fits; the next iteration is a warm-up again");
}

}  // namespace patrickstar
