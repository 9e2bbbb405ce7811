// The engine's construction (checks, the memory probe, registration: engine_registration.cpp) and
// teardown: the model gets plain fp32 parameters back, one chunk index at a time.
#include "engine_core.h"

#include <algorithm>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>

#include "absl/strings/str_cat.h"
#include "patrickstar/chunk/copy_queue.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/memtracer/memory_probe.h"

#include "patrickstar/engine/gathered_parameters.h"

#include "disk_states.h"
#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

EngineCore::EngineCore(std::shared_ptr<torch::nn::Module> model, Config config,
               std::shared_ptr<Communicator> comm)
    : model_(std::move(model)), config_(std::move(config)), dp_(std::move(comm)) {
  TORCH_CHECK(model_ != nullptr, "patrickstar::Engine: the model is null");
  // A Config built in code skips from_json's check of this pair; before the device's own checks,
  // so it is refused the same on every machine.
  TORCH_CHECK(config_.device.type == DeviceType::kEmulated ||
                  config_.scheduler.copy_delay_max_us == 0,
              "patrickstar::Engine: client.scheduler.copy_delay_max_us is ",
              config_.scheduler.copy_delay_max_us,
              ": injected copy delays test the emulated device's copy thread; on device type "
              "\"cuda\" copies run on a CUDA stream (set it to 0)");
  // The same for bf16 optimizer states and betas they cannot hold.
  const std::string bf16_states = bf16_state_problem(config_.optimizer);
  TORCH_CHECK(bf16_states.empty(), "patrickstar::Engine: ", bf16_states);
  const std::string groups = param_group_problem(config_.optimizer);
  TORCH_CHECK(groups.empty(), "patrickstar::Engine: ", groups);
  // The GPU: from here on config().device.index is the one in use.
  config_.device.index = resolved_device_index(config_);
  const std::string unavailable = device_unavailable_reason(config_);
  TORCH_CHECK(unavailable.empty(), "patrickstar::Engine: device type \"cuda\": ", unavailable,
              "; the emulated device trains on any machine (\"client\": {\"device\": {\"type\": "
              "\"emulated\"}})");
  make_current_device(config_);
  // Hybrid sharding's groups (a collective; a bad size is refused alike on every rank).
  dp_.form_shard_groups(config_.shard_group_size);
  check_plan_config();
  // From here on config().device.capacity_bytes is the capacity in use, never "auto".
  config_.device.capacity_bytes = resolved_device_capacity(config_);
  // Other ranks' chunks are never allocated here (PatrickStar's release_after_init is always on):
  // their param chunks are gathered when a door needs them.
  gradients_.decide_space(!mixed() || config_.gradient_accumulation_steps > 1);
  pipeline_ = std::make_unique<StepPipeline>(pipeline_wiring());
  activations_ = std::make_unique<Activations>(config_.activation_checkpointing);
  // Non-model memory: what LibTorch's CPU allocator serves (the counter sees it from now on), or
  // on a GPU the caching allocator's (chunk payloads do not come from it).
  probe_ = std::make_unique<NonModelProbe>(config_.device.type, config_.device.index,
                                           /*gathers_groups=*/!dp_.one_process());
  dp_.connect(ShardWiring{storage_, params_, gradients_, tracker_, metrics_, *probe_,
                          [this](int64_t index) { pipeline_->on_index_used(index); },
                          [this](int64_t bytes) { scheduler_->make_room(bytes, *mover_); },
                          [this] { return describe_pinned(); },
                          config_.gradient_accumulation_steps});
  report_config_warnings();
  // A module belongs to one engine: refuse before anything moves.
  for (const auto& item : model_->named_modules("", /*include_self=*/true)) {
    ModuleHookHandler* owner = handler_for(*item.value());
    TORCH_CHECK(owner == nullptr || owner == active_module_hook_handler(), "patrickstar::Engine: module ",
                item.key().empty() ? "<root>" : item.key(),
                " already belongs to another engine; a module can be trained by one engine only");
  }
  std::string error;
  try {
    register_parameters();
    gradients_.create_marker();
  } catch (const std::exception& e) {
    // A failing allocation after the parameters moved (register_parameters restores them itself
    // when it fails mid-way): the model gets its weights back, as from a destroyed engine.
    give_back_model(pipeline_->access(/*even_mid_iteration=*/true), /*may_gather=*/false);
    error = error_text(e);
    // One process, or a failure the ranks already agreed on (the same on every rank).
    if (!dp_.distributed() || error.rfind(kRegistrationFailed, 0) == 0) throw;
  } catch (...) {
    give_back_model(pipeline_->access(/*even_mid_iteration=*/true), /*may_gather=*/false);
    if (!dp_.distributed()) throw;
    error = "an exception that is not a std::exception";
  }
  // Data parallel: a rank whose registration failed (a deferred initializer that threw, memory it
  // could not have) fails every rank's, with its error; none waits for it at a gather.
  const std::string agreed = dp_.first_error(error);
  if (!agreed.empty()) {
    if (error.empty()) {
      give_back_model(pipeline_->access(/*even_mid_iteration=*/true), /*may_gather=*/false);
    }
    TORCH_CHECK(false, kRegistrationFailed, agreed, kNoRankRegistered);
  }
  // "plan": "auto" decides the step schedule: no trial of its own, no delayed update before it.
  if (plan_.enabled()) {
    if (pipeline_->overlap_possible()) pipeline_->set_overlap_step(false);
    if (pipeline_->delayed_possible()) pipeline_->set_delayed_update(false);
  }
  // From now on the doors of the model's modules find this engine.
  for (const auto& [module, name] : params_.module_names()) register_module_handler(*module, this);
}

void EngineCore::report_config_warnings() const {
  // Once per engine, through LibTorch's warning handler (a trainer may install its own).
  if (config_.warnings.empty()) return;
  std::string all;
  for (const std::string& w : config_.warnings) absl::StrAppend(&all, "\n  ", w);
  TORCH_WARN("patrickstar: the config has ", config_.warnings.size(), " unknown key",
             config_.warnings.size() == 1 ? "" : "s", " (ignored; \"strict\": true makes them errors):",
             all);
}

void EngineCore::note_model_construction_peak(int64_t bytes) {
  metrics_.registration().model_construction_peak_bytes = bytes;
  metrics_.registration().host_peak_bytes_during_init =
      std::max(metrics_.registration().host_peak_bytes_during_init, bytes);
}

EngineCore::~EngineCore() {
  try {
    // The model gets the weights of its last step, and of the delayed update in flight.
    pipeline_->access(/*even_mid_iteration=*/true);
  } catch (const std::exception& e) {
    TORCH_WARN(
        "patrickstar: settling the optimizer thread's updates failed while the engine "
        "goes: ",
        e.what());
  }
  pipeline_->stop_threads();
  for (const auto& [module, name] : params_.module_names())
    unregister_module_handler(*module, this);
  if (!params_.scopes().empty()) {
    TORCH_WARN(
        "patrickstar: the engine is destroyed while ", params_.scopes().size(),
        " GatheredParameters scope", params_.scopes().size() == 1 ? " is" : "s are",
        " open: their values are not written back (the model gets the fp32 master weights, while "
        "anything holds it)");
    for (GatheredParameters* scope : params_.scopes()) engine_gone(*scope);
  }
  // (Its threads stopped, the pipeline has nothing left to take back or land.)
  give_back_model(pipeline_->access(/*even_mid_iteration=*/true),
                  /*may_gather=*/std::uncaught_exceptions() == 0);
}

void EngineCore::give_back_model(const StateAccess& access, bool may_gather) {
  if (storage_.store() == nullptr) return;
  for (const Param& p : params_) params_.set_grad_consumed(p.id, false);
  clear_gradient_handles();  // no grad() may keep pointing into a chunk
  // The model gets ordinary fp32 parameters back, with the master weights: it trains on with plain
  // LibTorch. Nothing may keep pointing into the payloads the store is about to free.
  torch::NoGradGuard no_grad;
  // Data parallel: every rank destroys its engine, and the masters come from their owners. Not
  // while an exception unwinds (the other ranks are elsewhere): then, and when the gather fails,
  // the parameters keep their fences (reading one throws) and nothing points at the engine.
  std::vector<at::Tensor> masters(static_cast<size_t>(store().chunks_per_kind()));
  if (dp_.values_from_owners()) {
    const std::string failure = gather_masters(access, may_gather, masters);
    if (!failure.empty()) {
      leave_model_without_values(failure);
      return;
    }
  }
  // Parameters and buffers whose value could not be allocated (out of memory); the parameters
  // first, then the buffers.
  int64_t lost = give_back_parameters(access, masters);
  lost += give_back_buffers();
  if (lost > 0) {
    TORCH_WARN("patrickstar: the engine could not give ", lost, " of the model's tensors their "
               "fp32 values back (out of memory, or a chunk lost to a failed copy); they are left "
               "without values");
  }
}

std::string EngineCore::gather_masters(const StateAccess& access, bool may_gather,
                                      std::vector<at::Tensor>& masters) {
  if (!may_gather) return "an exception is unwinding on this rank";
  try {
    for (int64_t i = 0; i < store().chunks_per_kind(); ++i)
      masters[i] = dp_.master_chunk_everywhere(access, i, master_kind());
  } catch (const std::exception& e) {
    return e.what();
  }
  return std::string();
}

void EngineCore::leave_model_without_values(const std::string& failure) {
  TORCH_WARN("patrickstar: the engine was destroyed without gathering the fp32 weights from "
             "the other ranks (", failure, "); the model's parameters are left without values");
  for (const Param& p : params_) {
    if (!p.tensor.defined()) continue;
    if (p.tensor.requires_grad() && p.tensor.is_leaf()) clear_post_accumulate_grad_hook(p.tensor);
    point_at_nothing(p);
  }
  for (const at::Tensor& b : params_.cast_buffers()) b.set_data(b.to(at::kFloat));
}

int64_t EngineCore::give_back_parameters(const StateAccess& access,
                                         const std::vector<at::Tensor>& masters) {
  int64_t lost = 0;  // parameters whose value could not be allocated (out of memory)
  // The engine holds the last reference to the model (its handles went first, as at the end of
  // the scope that made them; one process): the root module can no longer be reached, and fp32
  // values would take the whole model in fp32, more than the model data on the host with a lean
  // frozen base or the disk tier (GPT3_8B with adapters: 33 GB against 17). The parameters get a
  // fence that says so instead (a submodule or a parameter kept from elsewhere throws when read).
  const bool values = dp_.values_from_owners() || model_.use_count() > 1;
  // One chunk at a time: its tensors get their values, then (one process) its payloads of every
  // kind go back to the system, so the host holds the model data plus one chunk's fp32 values at
  // most, not the model data plus the whole model in fp32 (megatron_1.3B: 18.5 GB + 5.3 GB).
  if (!dp_.values_from_owners()) {
    try {
      store().finish_copies();
    } catch (const std::exception&) {
      // A failed copy's chunk has no readable payload: its tensors are counted as lost below.
    }
  }
  for (int64_t index = 0; index < store().chunks_per_kind(); ++index) {
    for (TensorId id : store().layout().tensors_in_chunk(index)) {
      const Param& p = params_[id];
      if (!p.tensor.defined()) continue;
      if (p.tensor.requires_grad() && p.tensor.is_leaf()) clear_post_accumulate_grad_hook(p.tensor);
      at::Tensor value;
      try {
        if (values) {
          value = dp_.values_from_owners()
                      ? DataParallel::value_in(store().layout(),
                                               masters[static_cast<size_t>(index)], p.id)
                      : fp32_copy(access.weight(p.id));
        }
      } catch (const std::exception&) {
        ++lost;
      }
      if (p.gathered == GatherHold::kNone) point_at_nothing(p);
      if (value.defined()) {
        p.tensor.set_data(value);
      } else if (!values) {
        p.tensor.set_data(tensor_over(
            fence_storage(4 * p.tensor.numel(),
                          "patrickstar: parameter " + p.name +
                              " has no value: its engine was destroyed holding the model's last "
                              "reference, so it gave the model no fp32 weights back (they may "
                              "not fit the host); keep the model (its handle, or "
                              "Engine::module_ptr()) while the engine goes, or save the weights "
                              "before (save_weights, fp32_state_dict)",
                          c10::Device(c10::kCPU)),
            p.tensor.sizes(), at::kFloat));
      }
    }
    if (dp_.values_from_owners()) continue;  // the broadcasts above need every rank's chunks
    release_index_payloads(access, index);
  }
  return lost;
}

void EngineCore::release_index_payloads(const StateAccess& access, int64_t index) {
  try {
    access.finish_views();  // read only: frees the disk tier's staged states (if any)
  } catch (const std::exception&) {
  }
  for (int k = 0; k < kChunkKindCount; ++k) {
    const auto kind = static_cast<ChunkKind>(k);
    if (!store().has_kind(kind)) continue;
    try {
      store().release(store().chunk_id(kind, index));
    } catch (const std::exception&) {
      // A tensor still in COMPUTE: the payload goes with the store.
    }
  }
  storage_.host()->empty_cache();
  storage_.device()->empty_cache();
}

int64_t EngineCore::give_back_buffers() {
  int64_t lost = 0;  // buffers whose fp32 or CPU copy could not be allocated
  for (const at::Tensor& b : params_.cast_buffers()) {
    try {
      b.set_data(b.to(at::kCPU, at::kFloat));
    } catch (const std::exception&) {
      ++lost;
    }
  }
  // On CUDA the other buffers come back to the CPU too, where the model was built.
  for (const at::Tensor& b : model_->buffers(/*recurse=*/true)) {
    if (b.device().is_cpu()) continue;
    try {
      b.set_data(b.to(at::kCPU));
    } catch (const std::exception&) {
      ++lost;
    }
  }
  return lost;
}

}  // namespace patrickstar
