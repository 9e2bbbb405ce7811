// patrickstar::Engine (engine.h) and EngineInspector (engine_inspect.h): the public faces of
// EngineCore, which does the work (engine_core.h).
#include "patrickstar/engine/engine.h"

#include "patrickstar/engine/engine_inspect.h"

#include "engine_core.h"

namespace patrickstar {

Engine::Engine(std::shared_ptr<torch::nn::Module> model, Config config,
               std::shared_ptr<Communicator> comm)
    : core_(std::make_unique<engine_detail::EngineImpl>(std::move(model), std::move(config), std::move(comm))) {}
Engine::~Engine() = default;

torch::nn::Module& Engine::module() const { return core_->module(); }
const std::shared_ptr<torch::nn::Module>& Engine::module_ptr() const { return core_->module_ptr(); }
const Config& Engine::config() const { return core_->config(); }
ActiveHandlerGuard Engine::activate() { return core_->activate(); }

void Engine::backward(const at::Tensor& loss) { core_->backward(loss); }
IterationReport Engine::step() { return core_->step(); }
void Engine::zero_grad(bool set_to_none) { core_->zero_grad(set_to_none); }
const at::Tensor& Engine::zero_grad_marker() const { return core_->zero_grad_marker(); }
void Engine::set_lr(double lr) { core_->set_lr(lr); }
void Engine::set_adam_hyperparameters(double beta1, double beta2, double eps, double weight_decay) {
  core_->set_adam_hyperparameters(beta1, beta2, eps, weight_decay);
}
std::vector<ParamGroupInfo> Engine::param_groups() const {
  return core_->param_groups();
}
std::vector<AdamHyperparameters> Engine::param_group_options() const {
  return core_->param_group_options();
}
void Engine::set_param_group_options(const std::vector<AdamHyperparameters>& options) {
  core_->set_param_group_options(options);
}
AdamHyperparameters Engine::adam_hyperparameters() const {
  return core_->adam_hyperparameters();
}
void Engine::set_overlap_step(bool on) {
  core_->set_overlap_step(on);
}
double Engine::lr() const { return core_->lr(); }

std::vector<std::pair<std::string, at::Tensor>> Engine::fp32_state_dict() const {
  return core_->fp32_state_dict();
}
void Engine::save_weights(const std::string& path) const { core_->save_weights(path); }
SafetensorsSaveReport Engine::save_safetensors(const std::string& folder,
                                               const SafetensorsOptions& options) const {
  return core_->save_safetensors(folder, options);
}
void Engine::save_checkpoint(const std::string& path) const { core_->save_checkpoint(path); }
void Engine::load_checkpoint(const std::string& path) { core_->load_checkpoint(path); }

const RegistrationReport& Engine::registration() const { return core_->registration(); }
void Engine::note_model_construction_peak(int64_t bytes) {
  core_->note_model_construction_peak(bytes);
}
const std::vector<IterationReport>& Engine::history() const { return core_->history(); }
ActivationPlanReport Engine::activation_plan() const {
  return core_->activation_plan();
}

PlanReport Engine::plan() const { return core_->plan(); }
void Engine::set_record_timeline(bool on) { core_->set_record_timeline(on); }
const MemoryBreakdown& Engine::device_peak_breakdown() const {
  return core_->device_peak_breakdown();
}
const MemoryBreakdown& Engine::host_peak_breakdown() const { return core_->host_peak_breakdown(); }
int64_t Engine::iteration() const { return core_->iteration(); }
int64_t Engine::retrace_count() const { return core_->retrace_count(); }
double Engine::loss_scale() const { return core_->loss_scale(); }
int Engine::rank() const { return core_->rank(); }
int Engine::world_size() const { return core_->world_size(); }
int Engine::shard_group_size() const {
  return core_->shard_group_size();
}

const ChunkStore& EngineInspector::chunks() const { return core_.chunks(); }
std::vector<CopySpan> EngineInspector::optimizer_spans() const {
  return core_.optimizer_spans();
}
const Scheduler& EngineInspector::scheduler() const { return core_.scheduler(); }
std::vector<int64_t> EngineInspector::plan_chunk_sizes() const {
  return core_.plan_sizes();
}
std::optional<Trace> EngineInspector::plan_trace_of(int64_t chunk_elems) const {
  return core_.plan_trace_of(chunk_elems);
}
std::optional<Trace> EngineInspector::plan_candidate_trace(int candidate) const {
  return core_.plan_candidate_trace(candidate);
}
void EngineInspector::apply_plan_candidate(Engine& engine, int candidate) {
  engine.core_->apply_plan_candidate(candidate);
}
const TraceRecorder& EngineInspector::tracer() const { return core_.tracer(); }
MemoryTier& EngineInspector::device_tier() const { return core_.device_tier(); }
MemoryTier& EngineInspector::host_tier() const { return core_.host_tier(); }
const std::vector<bool>& EngineInspector::adam_on_device() const { return core_.adam_on_device(); }
bool EngineInspector::host_only(int64_t chunk_index) const { return core_.host_only(chunk_index); }
bool EngineInspector::owns(int64_t chunk_index) const { return core_.owns(chunk_index); }
const Communicator& EngineInspector::communicator() const { return core_.communicator(); }

}  // namespace patrickstar
