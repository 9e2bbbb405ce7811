#include "patrickstar/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/isfinite.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/str_cat.h"
#include "patrickstar/chunk/memory_tier.h"
#include "patrickstar/engine/checkpoint.h"
#include "patrickstar/memtracer/counting_allocator.h"
#include "patrickstar/optimizer/placement.h"

namespace patrickstar {
namespace {

constexpr int64_t kCheckpointFormat = 1;

// A tensor of `sizes` and `dtype` with a storage object of the right size but no memory: the
// engine points the storage at a chunk slot while the parameter is in use. Views that autograd
// saves share this storage object, so they follow every re-pointing.
at::Tensor storage_without_memory(c10::IntArrayRef sizes, at::ScalarType dtype) {
  const int64_t nbytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       c10::DataPtr(nullptr, c10::Device(c10::kCPU)), /*allocator=*/nullptr,
                       /*resizable=*/false);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

void repoint(const at::Tensor& param, void* data) {
  param.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(
      c10::DataPtr(data, c10::Device(c10::kCPU)));
}

at::ScalarType param_dtype(Precision precision) {
  switch (precision) {
    case Precision::kFp32: return at::kFloat;
    case Precision::kBf16: return at::kBFloat16;
    case Precision::kFp16: return at::kHalf;
  }
  return at::kFloat;
}

}  // namespace

// Carries out the scheduler's decisions on the chunk store.
class Engine::Mover final : public ChunkMover {
 public:
  explicit Mover(ChunkStore& store) : store_(store) {}
  bool on_device(int64_t id) override { return store_.tier(id) == Tier::kDevice; }
  bool movable(int64_t id) override { return store_.is_movable(id); }
  void to_device(int64_t id) override { store_.move(id, Tier::kDevice); }
  void to_host(int64_t id) override { store_.move(id, Tier::kHost); }

 private:
  ChunkStore& store_;
};

Engine::Engine(std::shared_ptr<torch::nn::Module> model, Config config)
    : model_(std::move(model)), config_(std::move(config)) {
  TORCH_CHECK(model_ != nullptr, "patrickstar::Engine: the model is null");
  TORCH_CHECK(config_.device.type == DeviceType::kEmulated,
              "patrickstar::Engine: device type \"cuda\" is not supported by the engine yet; this "
              "build trains on the emulated device (\"client\": {\"device\": {\"type\": "
              "\"emulated\"}})");
  // release_after_init frees the chunks other ranks own after initialization (PatrickStar's
  // "release remote chunks"); with one process every chunk is this rank's, so it changes nothing.
  mixed_ = config_.precision() != Precision::kFp32;
  grad_space_ = !mixed_ || config_.gradient_accumulation_steps > 1;
  // Non-model memory is what LibTorch's CPU allocator serves; the counter must see it from now on.
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  counter.reset_peak();
  probe_ = std::make_unique<CpuMemoryProbe>(counter);
  register_parameters();
}

void Engine::note_model_construction_peak(int64_t bytes) {
  registration_.model_construction_peak_bytes = bytes;
  registration_.host_peak_bytes_during_init =
      std::max(registration_.host_peak_bytes_during_init, bytes);
}

Engine::~Engine() {
  // Parameters must not keep pointing into payloads the store is about to free.
  for (const Param& p : params_) {
    if (p.trainable) clear_post_accumulate_grad_hook(p.tensor);
    point_at_nothing(p);
  }
}

void Engine::register_parameters() {
  // 1. Collect and check, touching nothing.
  std::vector<std::pair<std::string, at::Tensor>> unique;
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (param_of_impl_.count(t.unsafeGetTensorImpl())) continue;  // tied: registered once
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
                "patrickstar::Engine: parameter ", item.key(), " is ", t.scalar_type(), " on ",
                t.device(), "; build the model in fp32 on the CPU (the engine places it)");
    param_of_impl_[t.unsafeGetTensorImpl()] = static_cast<TensorId>(unique.size());
    unique.emplace_back(item.key(), t);
  }
  if (unique.empty()) param_of_impl_.clear();
  TORCH_CHECK(!unique.empty(), "patrickstar::Engine: the model has no parameters to train");
  // use_cpu_embedding: the parameters of embedding modules get chunks of their own (layout group
  // 1) that stay on the host; the embedding reads them there and its Adam runs on the host.
  std::unordered_set<const c10::TensorImpl*> embedding_params;
  for (const auto& item : model_->named_modules("", /*include_self=*/true)) {
    const torch::nn::Module* module = item.value().get();
    module_names_[module] = item.key().empty() ? "<root>" : item.key();
    const bool cpu_embedding = config_.use_cpu_embedding &&
                               (dynamic_cast<const torch::nn::EmbeddingImpl*>(module) != nullptr ||
                                dynamic_cast<const torch::nn::EmbeddingBagImpl*>(module) != nullptr);
    int64_t own = 0;
    for (const at::Tensor& t : module->parameters(/*recurse=*/false)) {
      own += t.numel();
      if (cpu_embedding) embedding_params.insert(t.unsafeGetTensorImpl());
    }
    registration_.largest_module_param_bytes =
        std::max(registration_.largest_module_param_bytes, 4 * own);
  }
  Layout layout;
  for (const auto& [name, t] : unique) {
    layout.add_tensor(name, t.sizes(), embedding_params.count(t.unsafeGetTensorImpl()) ? 1 : 0);
  }
  try {
    if (config_.chunk_size_auto) {
      const int64_t lo = (layout.max_numel() + 1023) / 1024 * 1024;
      const int64_t hi = 2 * lo;  // least waste among sizes that keep the chunks many
      layout.finalize_search(lo, hi, std::max<int64_t>(1024, (hi - lo) / 256 / 1024 * 1024));
    } else {
      layout.finalize(config_.default_chunk_size);
    }
  } catch (c10::Error& e) {
    param_of_impl_.clear();
    e.add_context("while packing the model's parameters into chunks (config key "
                  "\"default_chunk_size\")");
    throw;
  }

  // 2. Memory: tiers and chunks, every payload on the host to start with.
  const at::ScalarType half = param_dtype(config_.precision());
  std::vector<ChunkKindSpec> kinds = {{ChunkKind::kParam, half}};
  if (mixed_) kinds.push_back({ChunkKind::kParamFp32, at::kFloat});
  kinds.push_back({ChunkKind::kMomentum, at::kFloat});
  kinds.push_back({ChunkKind::kVariance, at::kFloat});
  if (grad_space_) kinds.push_back({ChunkKind::kGrad, at::kFloat});
  const int64_t host_capacity = config_.device.host_capacity_bytes > 0
                                    ? config_.device.host_capacity_bytes
                                    : MemoryTier::kUnlimited;
  host_ = std::make_unique<HostTier>(host_capacity);
  device_ = std::make_unique<EmulatedDeviceTier>(config_.device.capacity_bytes);
  store_ = std::make_unique<ChunkStore>(std::move(layout), kinds, *host_, *device_);
  const Layout* placed = &store_->layout();
  host_only_.assign(static_cast<size_t>(placed->chunk_count()), false);
  for (int64_t i = 0; i < placed->chunk_count(); ++i) host_only_[i] = placed->chunk_group(i) == 1;
  // The whole model data must fit the host before anything moves: a model is either untouched or
  // fully registered.
  if (host_->capacity_bytes() != MemoryTier::kUnlimited &&
      host_->used_bytes() + store_->total_chunk_bytes() > host_->capacity_bytes()) {
    const int64_t need = store_->total_chunk_bytes();
    const int64_t have = host_->capacity_bytes() - host_->used_bytes();
    store_.reset();
    param_of_impl_.clear();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "patrickstar::Engine: the model data needs ", need,
                     " bytes of host memory but the host budget has ", have,
                     " bytes left (config key client.device.host_capacity_bytes); nothing was "
                     "registered");
  }

  // 3. Values into chunks, one chunk index at a time: its weight payloads are allocated, its
  //    tensors copied in and their original storage freed, and only then its optimizer payloads
  //    are allocated. So the host holds at most the model data plus one chunk of fp32 weights
  //    still waiting (RegistrationReport::host_peak_bytes_during_init measures it).
  torch::NoGradGuard no_grad;
  CountingCpuAllocator& counter = *CountingCpuAllocator::installed();
  int64_t model_bytes_at_start = 0;
  for (const auto& item : unique) model_bytes_at_start += item.second.nbytes();
  const int64_t live_at_start = counter.live_bytes();
  counter.reset_peak();
  int64_t& init_peak = registration_.host_peak_bytes_during_init;
  auto sample = [&] {
    // What the process holds beyond what it held before registration began, plus the model's
    // own fp32 weights (there at the start).
    init_peak = std::max(init_peak, counter.peak_bytes() - live_at_start + model_bytes_at_start +
                                        host_->used_bytes());
    counter.reset_peak();
  };
  sample();
  params_.resize(unique.size());
  try {
    for (int64_t index = 0; index < store_->chunks_per_kind(); ++index) {
      store_->allocate(store_->chunk_id(ChunkKind::kParam, index), Tier::kHost);
      if (mixed_) store_->allocate(store_->chunk_id(ChunkKind::kParamFp32, index), Tier::kHost);
      sample();
      for (TensorId id : placed->tensors_in_chunk(index)) {
        const auto& [name, t] = unique[static_cast<size_t>(id)];
        Param& p = params_[static_cast<size_t>(id)];
        p.name = name;
        p.tensor = t;
        p.id = id;
        p.trainable = t.requires_grad();
        store_->view(p.id, ChunkKind::kParam).copy_(t);
        if (mixed_) store_->view(p.id, ChunkKind::kParamFp32).copy_(t);
        t.set_data(storage_without_memory(t.sizes(), half));
        point_at_nothing(p);
      }
      sample();
      for (ChunkKind kind : {ChunkKind::kMomentum, ChunkKind::kVariance, ChunkKind::kGrad}) {
        if (store_->has_kind(kind)) store_->allocate(store_->chunk_id(kind, index), Tier::kHost);
      }
      sample();
    }
  } catch (...) {
    // Only a failing system allocation gets here (the budget was checked): the model is partly
    // moved and cannot be restored.
    store_.reset();
    param_of_impl_.clear();
    params_.clear();
    throw;
  }
  for (const Param& p : params_) {
    if (!p.trainable) continue;
    const TensorId id = p.id;
    set_post_accumulate_grad_hook(p.tensor, [this, id](const at::Tensor& t) { on_gradient(id, t); });
  }

  // 4. Scheduler, tracer, optimizer.
  std::map<int64_t, ChunkInfo> chunk_table;
  for (ChunkId id = 0; id < store_->chunk_count(); ++id) {
    chunk_table[id] = ChunkInfo{store_->chunk_bytes(id), store_->kind_of(id) == ChunkKind::kParam &&
                                                              !host_only_[store_->index_of(id)]};
  }
  SchedulerOptions options;
  options.capacity_bytes = config_.device.capacity_bytes;
  options.overall_ratio = config_.mem_tracer.overall_gpu_mem_ratio;
  options.reserve_bytes = config_.scheduler.reserve_bytes;
  options.warmup_ratio = config_.mem_tracer.warmup_gpu_chunk_mem_ratio;
  options.policy = config_.scheduler.policy;
  options.prefetch_depth = config_.scheduler.prefetch_depth;
  scheduler_ = std::make_unique<Scheduler>(options, std::move(chunk_table));
  recorder_ = std::make_unique<TraceRecorder>(probe_.get());
  mover_ = std::make_unique<Mover>(*store_);

  AdamOptions adam_options;
  adam_options.lr(config_.optimizer.lr)
      .beta1(config_.optimizer.beta1)
      .beta2(config_.optimizer.beta2)
      .eps(config_.optimizer.eps)
      .weight_decay(config_.optimizer.weight_decay)
      .decoupled(config_.optimizer.type == OptimizerType::kAdamW)
      .max_grad_norm(config_.gradient_clipping);
  LossScaler scaler = LossScaler::disabled();
  if (config_.precision() == Precision::kFp16) {
    LossScalerOptions s;
    s.loss_scale = config_.fp16.loss_scale;
    s.initial_scale_power = config_.fp16.initial_scale_power;
    s.loss_scale_window = config_.fp16.loss_scale_window;
    s.hysteresis = config_.fp16.hysteresis;
    s.min_loss_scale = config_.fp16.min_loss_scale;
    scaler = LossScaler(s);
  }
  adam_ = std::make_unique<HybridAdam>(adam_options, scaler);

  // 5. Figures.
  RegistrationReport& r = registration_;
  r.tensors = static_cast<int64_t>(params_.size());
  r.params = placed->total_numel();
  for (const Param& p : params_) {
    if (p.trainable) r.trainable_params += placed->numel(p.id);
  }
  r.chunk_elems = placed->chunk_elems();
  r.chunks_per_kind = placed->chunk_count();
  r.chunk_waste_elems = placed->waste_elems();
  r.chunk_waste_fraction = placed->waste_fraction();
  for (ChunkId id = 0; id < store_->chunk_count(); ++id) r.model_data_bytes += store_->chunk_bytes(id);
  r.model_data_bytes_per_param =
      static_cast<double>(r.model_data_bytes) / static_cast<double>(std::max<int64_t>(1, r.params));
  r.init_goal_bytes = r.model_data_bytes + r.largest_module_param_bytes;
}

Engine::ModuleInfo& Engine::module_info(torch::nn::Module& module) {
  auto it = modules_.find(&module);
  if (it != modules_.end()) return *it->second;
  auto info = std::make_unique<ModuleInfo>();
  auto name = module_names_.find(&module);
  info->label = name != module_names_.end() ? name->second : module.name();
  for (const at::Tensor& t : module.parameters(/*recurse=*/true)) {
    auto id = param_of_impl_.find(t.unsafeGetTensorImpl());
    TORCH_CHECK(id != param_of_impl_.end(), "patrickstar: module ", info->label,
                " has a parameter the engine did not register (was it added after "
                "initialize_engine?)");
    if (std::find(info->params.begin(), info->params.end(), id->second) == info->params.end()) {
      info->params.push_back(id->second);
    }
  }
  ModuleInfo* raw = info.get();
  info->hook_id = hooks_.add([this, raw] { pre_backward(*raw); });
  info->post_hook_id = hooks_.add([this, raw] { post_backward(*raw); });
  return *modules_.emplace(&module, std::move(info)).first->second;
}

void Engine::point_at_chunk(const Param& p) {
  p.tensor.unsafeGetTensorImpl()->set_sizes_contiguous(store_->layout().sizes(p.id));
  repoint(p.tensor, store_->view(p.id, ChunkKind::kParam).data_ptr());
}

// A released parameter has no memory and no elements: a module called outside a door fails on its
// shapes instead of reading freed memory. Views autograd saved keep their own sizes.
void Engine::point_at_nothing(const Param& p, bool keep_shape) {
  repoint(p.tensor, nullptr);
  if (!keep_shape) p.tensor.unsafeGetTensorImpl()->set_sizes_contiguous({0});
}

void Engine::begin_iteration_if_needed() {
  if (in_iteration_) return;
  in_iteration_ = true;
  scopes_.clear();
  open_moment_ = -1;
  counters_at_iteration_start_ = store_->move_counters();
  device_->reset_peak();
  recorder_->begin_iteration();
  scheduler_->begin_iteration();
}

std::vector<TensorId> Engine::access(const ModuleInfo& module, MomentKind kind,
                                     bool with_grad_chunks) {
  std::vector<int64_t> chunk_ids;
  auto add_chunk = [&](ChunkId c) {
    if (host_only_[store_->index_of(c)]) return;  // a CPU embedding's: read on the host
    if (std::find(chunk_ids.begin(), chunk_ids.end(), c) == chunk_ids.end()) chunk_ids.push_back(c);
  };
  for (TensorId id : module.params) {
    add_chunk(store_->chunk_of(id, ChunkKind::kParam));
    if (with_grad_chunks && grad_space_ && params_[id].trainable) {
      add_chunk(store_->chunk_of(id, ChunkKind::kGrad));
    }
  }
  close_moment();
  const int64_t m = recorder_->tick(kind, module.label);
  for (int64_t c : chunk_ids) recorder_->record_access(c);
  try {
    scheduler_->at_moment(m, kind, chunk_ids, *mover_, probe_->live_bytes());
    open_moment_ = m;
  } catch (c10::Error& e) {
    e.add_context(absl::StrCat("while making the chunks of module ", module.label,
                               " resident; chunks pinned by tensors in use: ", describe_pinned()));
    throw;
  }
  for (TensorId id : module.params) {
    Param& p = params_[id];
    if (p.compute_refs++ > 0) continue;
    store_->set_state(id, ChunkKind::kParam, TensorState::kCompute);
    if (with_grad_chunks && grad_space_ && p.trainable) {
      store_->set_state(id, ChunkKind::kGrad, TensorState::kCompute);
    }
    point_at_chunk(p);
  }
  return module.params;
}

void Engine::close_moment() {
  // The previous moment's compute is over: the scheduler may prefetch for the next ones now.
  if (open_moment_ >= 0) scheduler_->after_moment(open_moment_, *mover_);
  open_moment_ = -1;
}

std::string Engine::describe_pinned() const {
  std::string out;
  for (ChunkId c = 0; c < store_->chunk_count(); ++c) {
    if (store_->tier(c) != Tier::kDevice || store_->is_movable(c)) continue;
    std::string users;
    for (TensorId t : store_->layout().tensors_in_chunk(store_->index_of(c))) {
      if (store_->state(t, store_->kind_of(c)) == TensorState::kCompute) {
        absl::StrAppend(&users, users.empty() ? "" : ", ", params_[t].name);
      }
    }
    absl::StrAppend(&out, out.empty() ? "" : "; ", store_->describe(c), " (", users, ")");
  }
  return out.empty() ? "none" : out;
}

int64_t Engine::pre_forward(torch::nn::Module& module) {
  ModuleInfo& info = module_info(module);
  // A checkpointed forward runs without gradients but is part of the training step: it is a moment
  // like any other (the trace must not depend on where activations are dropped), and its recompute
  // in backward comes through here again as a training forward.
  const ForwardKind kind = at::GradMode::is_enabled() ? ForwardKind::kTraining
                           : in_checkpointed_forward() ? ForwardKind::kCheckpointed
                                                       : ForwardKind::kEvaluation;
  if (kind == ForwardKind::kEvaluation) {
    // Evaluation: no moments, no moves; parameters are read wherever their chunks are.
    TORCH_CHECK(phase_ == Phase::kIdle, "patrickstar: a forward without gradients (evaluation) ",
                "between backward and step; call step() first");
    for (TensorId id : info.params) {
      Param& p = params_[id];
      if (p.compute_refs++ > 0) continue;
      store_->set_state(id, ChunkKind::kParam, TensorState::kCompute);
      point_at_chunk(p);
    }
    scopes_.push_back(OpenScope{&info, info.params, kind});
    return static_cast<int64_t>(scopes_.size()) - 1;
  }
  if (phase_ == Phase::kBackwardDone) {
    TORCH_CHECK(grad_space_ && backwards_since_step_ < config_.gradient_accumulation_steps,
                "patrickstar: forward after backward without step(): the gradients sit where the "
                "half weights were (gradient_accumulation_steps is ",
                config_.gradient_accumulation_steps, "); call step() first");
  }
  begin_iteration_if_needed();
  phase_ = Phase::kForward;
  scopes_.push_back(OpenScope{&info, {}, kind});
  const int64_t token = static_cast<int64_t>(scopes_.size()) - 1;
  if (!info.params.empty()) scopes_[token].acquired = access(info, MomentKind::kPreForward, false);
  return token;
}

void Engine::release(TensorId id, TensorState to) {
  Param& p = params_[id];
  TORCH_CHECK(p.compute_refs > 0, "patrickstar: internal: release of ", p.name, " not in use");
  if (--p.compute_refs > 0) return;
  store_->set_state(id, ChunkKind::kParam, to);
  point_at_nothing(p);
}

std::vector<at::Tensor> Engine::post_forward(int64_t token, std::vector<at::Tensor> outputs) {
  TORCH_CHECK(token >= 0 && token < static_cast<int64_t>(scopes_.size()),
              "patrickstar: internal: unknown door token ", token);
  OpenScope& scope = scopes_[static_cast<size_t>(token)];
  // Only a training forward leaves a graph that will use the parameters again in backward.
  const bool training = scope.kind == ForwardKind::kTraining;
  for (TensorId id : scope.acquired) {
    release(id, training ? TensorState::kHoldAfterFwd : TensorState::kHold);
  }
  scope.acquired.clear();
  if (!training || outputs.empty() || scope.module->params.empty()) return outputs;
  return with_pre_backward(outputs, hooks_, scope.module->hook_id);
}

void Engine::pre_backward(ModuleInfo& module) {
  if (module.params.empty()) return;
  access(module, MomentKind::kPreBackward, /*with_grad_chunks=*/true);
}

std::vector<at::Tensor> Engine::wrap_inputs(int64_t token, std::vector<at::Tensor> inputs) {
  TORCH_CHECK(token >= 0 && token < static_cast<int64_t>(scopes_.size()),
              "patrickstar: internal: unknown door token ", token);
  const OpenScope& scope = scopes_[static_cast<size_t>(token)];
  if (scope.kind != ForwardKind::kTraining || scope.module->params.empty()) return inputs;
  return with_pre_backward(inputs, hooks_, scope.module->post_hook_id);
}

void Engine::post_backward(ModuleInfo& module) {
  // The module's backward is over. Parameters whose gradient is still to come (a tied weight used
  // again earlier in the model) wait without memory; their gradient lands in the slot later.
  for (TensorId id : module.params) {
    Param& p = params_[id];
    if (p.compute_refs == 0 || --p.compute_refs > 0) continue;
    store_->set_state(id, ChunkKind::kParam,
                      p.trainable ? TensorState::kHoldAfterFwd : TensorState::kHold);
    if (grad_space_ && p.trainable &&
        store_->state(id, ChunkKind::kGrad) == TensorState::kCompute) {
      store_->set_state(id, ChunkKind::kGrad, TensorState::kHold);
    }
    point_at_nothing(p, /*keep_shape=*/true);
  }
}

void Engine::on_gradient(TensorId id, const at::Tensor& param) {
  Param& p = params_[id];
  at::Tensor grad = param.grad();
  if (!grad.defined()) return;
  torch::NoGradGuard no_grad;
  if (p.compute_refs == 0) {  // a gradient without its module's pre-backward: take the slot now
    store_->set_state(id, ChunkKind::kParam, TensorState::kCompute);
    if (grad_space_) store_->set_state(id, ChunkKind::kGrad, TensorState::kCompute);
    p.compute_refs = 1;
  }
  if (grad_space_) {
    at::Tensor slot = store_->view(id, ChunkKind::kGrad);
    slot.add_(grad);  // zeroed by zero_grad(): the first micro-batch adds to zeros
    store_->set_state(id, ChunkKind::kGrad, TensorState::kHoldAfterBwd);
  } else {
    // The weight's last use is behind us and the fp32 master keeps its value: the half slot
    // takes the gradient (DESIGN.md section 4).
    store_->view(id, ChunkKind::kParam).copy_(grad);
  }
  param.mutable_grad().reset();
  p.has_grad = true;
  p.compute_refs = 0;
  store_->set_state(id, ChunkKind::kParam, TensorState::kHoldAfterBwd);
  point_at_nothing(p);
}

void Engine::backward(const at::Tensor& loss) {
  TORCH_CHECK(phase_ == Phase::kForward, "patrickstar: backward() without a forward since the last ",
              phase_ == Phase::kIdle ? "step" : "backward");
  TORCH_CHECK(loss.defined() && loss.numel() == 1 && loss.requires_grad(),
              "patrickstar: backward() takes the scalar loss of a training forward (one element "
              "that requires grad)");
  if (config_.precision() != Precision::kFp16) {
    const bool finite = at::isfinite(loss).item<bool>();
    if (!finite) {
      const double value = loss.item<double>();
      discard_iteration();
      TORCH_CHECK(false, "patrickstar: the loss is ", value, " in ",
                  to_string(config_.precision()),
                  "; the forward was discarded and no gradient was computed (weights unchanged). "
                  "Lower the learning rate or check the data.");
    }
  }
  const double factor = adam_->loss_scale() / config_.gradient_accumulation_steps;
  if (factor != 1.0) {
    (loss * factor).backward();
  } else {
    loss.backward();
  }
  finish_backward();
}

void Engine::finish_backward() {
  // Parameters whose gradient never arrived (frozen, or unused by this loss) still hold a slot.
  for (Param& p : params_) {
    const TensorState state = store_->state(p.id, ChunkKind::kParam);
    if (p.compute_refs > 0 || state == TensorState::kCompute) {
      p.compute_refs = 0;
      store_->set_state(p.id, ChunkKind::kParam, TensorState::kHold);
      point_at_nothing(p);
    } else if (state == TensorState::kHoldAfterFwd) {
      store_->set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    if (grad_space_ && store_->state(p.id, ChunkKind::kGrad) == TensorState::kCompute) {
      store_->set_state(p.id, ChunkKind::kGrad, TensorState::kHold);
    }
  }
  ++backwards_since_step_;
  phase_ = Phase::kBackwardDone;
}

void Engine::discard_iteration() {
  for (Param& p : params_) {
    const TensorState state = store_->state(p.id, ChunkKind::kParam);
    if (state == TensorState::kCompute || state == TensorState::kHoldAfterFwd) {
      store_->set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    p.compute_refs = 0;
    point_at_nothing(p);
  }
  open_moment_ = -1;
  if (in_iteration_ && backwards_since_step_ == 0) {
    recorder_->abort_iteration();
    scheduler_->abort_iteration();
    in_iteration_ = false;
    phase_ = Phase::kIdle;
  } else {
    phase_ = Phase::kBackwardDone;  // earlier micro-batches keep their gradients
  }
}

void Engine::zero_grad() {
  TORCH_CHECK(phase_ != Phase::kForward, "patrickstar: zero_grad() between forward and backward");
  for (Param& p : params_) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().reset();
  }
  if (!grad_space_) return;
  for (int64_t i = 0; i < store_->chunks_per_kind(); ++i) {
    store_->chunk_view(store_->chunk_id(ChunkKind::kGrad, i)).zero_();
  }
}

void Engine::decide_adam_placement() {
  const int64_t n = store_->chunks_per_kind();
  // CPU embeddings update on the host: the plan covers the other chunk indices.
  std::vector<int64_t> candidates;
  std::vector<int64_t> state_bytes;  // per candidate
  int64_t resident_model_bytes = 0;  // chunks the forward and backward need on the device
  for (int64_t i = 0; i < n; ++i) {
    if (host_only_[i]) continue;
    candidates.push_back(i);
    state_bytes.push_back(store_->chunk_bytes(store_->chunk_id(ChunkKind::kMomentum, i)) +
                          store_->chunk_bytes(store_->chunk_id(ChunkKind::kVariance, i)) +
                          (mixed_ ? store_->chunk_bytes(store_->chunk_id(ChunkKind::kParamFp32, i))
                                  : 0));
    resident_model_bytes += store_->chunk_bytes(store_->chunk_id(ChunkKind::kParam, i));
    if (grad_space_) resident_model_bytes += store_->chunk_bytes(store_->chunk_id(ChunkKind::kGrad, i));
  }
  int64_t peak_non_model = probe_->peak_bytes();
  for (const Moment& m : recorder_->current_trace().moments) {
    peak_non_model = std::max(peak_non_model, m.non_model_bytes);
  }
  // The margin: what the device keeps free even at the peak of activations with every parameter
  // chunk resident. Optimizer states placed there never need to move.
  const int64_t planning = static_cast<int64_t>(std::floor(
                               static_cast<double>(config_.device.capacity_bytes) *
                               config_.mem_tracer.overall_gpu_mem_ratio)) -
                           config_.scheduler.reserve_bytes;
  const int64_t margin = static_cast<int64_t>(
      static_cast<double>(planning - peak_non_model - resident_model_bytes) *
      config_.mem_tracer.margin_use_ratio);
  const bool hybrid = config_.optimizer.use_hybrid_adam &&
                      config_.scheduler.policy != EvictionPolicy::kStatic;
  const PlacementPlan plan = hybrid ? plan_placement(state_bytes, margin) : all_on_host(state_bytes);
  adam_on_device_.assign(static_cast<size_t>(n), false);
  for (size_t k = 0; k < candidates.size(); ++k) adam_on_device_[candidates[k]] = plan.on_device[k];
  placement_decided_ = true;
}

IterationReport Engine::run_adam() {
  torch::NoGradGuard no_grad;
  const int64_t n = store_->chunks_per_kind();
  auto id_of = [&](ChunkKind kind, int64_t i) { return store_->chunk_id(kind, i); };

  // The step moment: chunks whose Adam runs on the device are accessed there. The warm-up runs
  // every update on the host (its chunk budget is the conservative one) but records the steady
  // state's accesses, so that from the next iteration on the schedule knows when the optimizer
  // states are used.
  const bool warmup = !scheduler_->has_trace();
  std::vector<bool> on_device = adam_on_device_;
  if (warmup) on_device.assign(on_device.size(), false);
  std::vector<int64_t> device_chunks;
  for (int64_t i = 0; i < n; ++i) {
    if (!adam_on_device_[i]) continue;
    device_chunks.push_back(id_of(ChunkKind::kParam, i));
    if (mixed_) device_chunks.push_back(id_of(ChunkKind::kParamFp32, i));
    device_chunks.push_back(id_of(ChunkKind::kMomentum, i));
    device_chunks.push_back(id_of(ChunkKind::kVariance, i));
    if (grad_space_) device_chunks.push_back(id_of(ChunkKind::kGrad, i));
  }
  // The rest update on the host: their gradients and weights go there (the states live there
  // already). The trace records the steady state's host chunks, so the schedule and the OPT bound
  // know these chunks leave the device at the step.
  auto host_chunks = [&](const std::vector<bool>& device_side) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n; ++i) {
      if (device_side[i]) continue;
      for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kGrad}) {
        if (store_->has_kind(kind)) ids.push_back(id_of(kind, i));
      }
    }
    return ids;
  };
  const std::vector<int64_t> to_host = host_chunks(on_device);
  int64_t adam_host_d2h_bytes = 0;
  for (int64_t c : to_host) {
    if (store_->tier(c) == Tier::kDevice) adam_host_d2h_bytes += store_->chunk_bytes(c);
  }
  close_moment();
  const int64_t m = recorder_->tick(MomentKind::kStep, "step");
  for (int64_t c : device_chunks) recorder_->record_access(c);
  for (int64_t c : host_chunks(adam_on_device_)) recorder_->record_host(c);
  scheduler_->at_moment(m, MomentKind::kStep, warmup ? std::vector<int64_t>{} : device_chunks,
                        *mover_, probe_->live_bytes(), to_host);

  // Views: one AdamChunk per run of consecutive tensors that received a gradient.
  std::vector<AdamChunk> runs;
  PlacementPlan plan;
  for (int64_t i = 0; i < n; ++i) {
    const auto tensors = store_->layout().tensors_in_chunk(i);
    size_t k = 0;
    while (k < tensors.size()) {
      if (!params_[tensors[k]].has_grad) {
        ++k;
        continue;
      }
      const int64_t begin = store_->layout().placement(tensors[k]).offset_elems;
      int64_t end = begin;
      while (k < tensors.size() && params_[tensors[k]].has_grad &&
             store_->layout().placement(tensors[k]).offset_elems == end) {
        end += store_->layout().numel(tensors[k]);
        ++k;
      }
      auto slice = [&](ChunkKind kind) {
        return store_->chunk_view(id_of(kind, i)).narrow(0, begin, end - begin);
      };
      AdamChunk run;
      run.exp_avg = slice(ChunkKind::kMomentum);
      run.exp_avg_sq = slice(ChunkKind::kVariance);
      if (mixed_) {
        run.half_param_grad = slice(ChunkKind::kParam);
        run.master = slice(ChunkKind::kParamFp32);
        // With a gradient space the accumulated gradient goes to the half slot for the update.
        if (grad_space_) run.half_param_grad.copy_(slice(ChunkKind::kGrad));
      } else {
        run.master = slice(ChunkKind::kParam);
        run.grad_fp32 = slice(ChunkKind::kGrad);
      }
      runs.push_back(run);
      plan.on_device.push_back(on_device[i]);
    }
  }
  IterationReport report;
  report.adam_host_d2h_bytes = adam_host_d2h_bytes;
  StepReport step = adam_->step(runs, plan);
  report.skipped = step.skipped;
  report.loss_scale = step.loss_scale;
  report.grad_norm = step.grad_norm;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bytes = store_->chunk_bytes(id_of(ChunkKind::kMomentum, i)) * (mixed_ ? 3 : 2);
    if (on_device[i]) {
      ++report.adam.chunks_device;
      report.adam.bytes_device += bytes;
    } else {
      ++report.adam.chunks_host;
      report.adam.bytes_host += bytes;
    }
  }
  return report;
}

IterationReport Engine::step() {
  TORCH_CHECK(phase_ == Phase::kBackwardDone,
              "patrickstar: step() without a backward since the last ",
              phase_ == Phase::kIdle ? "step" : "forward (call backward(loss) first)");
  TORCH_CHECK(backwards_since_step_ == config_.gradient_accumulation_steps,
              "patrickstar: step() after ", backwards_since_step_, " backward pass",
              backwards_since_step_ == 1 ? "" : "es", " but gradient_accumulation_steps is ",
              config_.gradient_accumulation_steps);
  if (!placement_decided_) decide_adam_placement();
  IterationReport report = run_adam();

  for (Param& p : params_) {
    if (store_->state(p.id, ChunkKind::kParam) == TensorState::kHoldAfterBwd) {
      store_->set_state(p.id, ChunkKind::kParam, TensorState::kHold);
    }
    if (grad_space_ && store_->state(p.id, ChunkKind::kGrad) == TensorState::kHoldAfterBwd) {
      store_->set_state(p.id, ChunkKind::kGrad, TensorState::kHold);
    }
    p.has_grad = false;
  }
  recorder_->end_iteration();
  const bool warmup = iteration_ == 0 || !scheduler_->has_trace();
  if (warmup) scheduler_->set_trace(recorder_->warmup_trace(), mover_.get());
  const IterationStats& stats = scheduler_->current_stats();
  report.evictions = stats.evictions;
  report.prefetches = stats.prefetches;
  scheduler_->end_iteration();

  const MoveCounters now = store_->move_counters();
  report.iteration = iteration_;
  report.warmup = warmup;
  report.h2d_bytes = now.h2d_bytes - counters_at_iteration_start_.h2d_bytes;
  report.d2h_bytes = now.d2h_bytes - counters_at_iteration_start_.d2h_bytes;
  report.device_chunk_peak_bytes = device_->peak_bytes();
  for (const Moment& m : recorder_->current_trace().moments) {
    report.non_model_peak_bytes = std::max(report.non_model_peak_bytes, m.non_model_bytes);
  }
  report.non_model_peak_bytes =
      std::max(report.non_model_peak_bytes, recorder_->current_trace().tail_non_model_bytes);
  history_.push_back(report);

  ++iteration_;
  in_iteration_ = false;
  backwards_since_step_ = 0;
  phase_ = Phase::kIdle;
  return report;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::fp32_state_dict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const ChunkKind master = mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam;
  for (const Param& p : params_) out.emplace_back(p.name, store_->view(p.id, master).clone());
  return out;
}

namespace {
// Writes `module`'s parameters (from `values` by full name) and buffers into `archive`, with one
// nested archive per child, the layout torch::nn::Module::save uses: torch::load reads it back.
void write_module(const torch::nn::Module& module, const std::string& prefix,
                  const std::map<std::string, at::Tensor>& values,
                  const std::unordered_map<const c10::TensorImpl*, std::string>& name_of,
                  torch::serialize::OutputArchive& archive) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    const auto canonical = name_of.at(item.value().unsafeGetTensorImpl());
    archive.write(item.key(), values.at(canonical));
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    archive.write(item.key(), item.value(), /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    torch::serialize::OutputArchive child_archive;
    write_module(*child.value(), prefix + child.key() + ".", values, name_of, child_archive);
    archive.write(child.key(), child_archive);
  }
}
}  // namespace

void Engine::save_weights(const std::string& path) const {
  std::map<std::string, at::Tensor> values;
  for (auto& [name, t] : fp32_state_dict()) values.emplace(name, t);
  std::unordered_map<const c10::TensorImpl*, std::string> name_of;
  for (const Param& p : params_) name_of[p.tensor.unsafeGetTensorImpl()] = p.name;
  torch::serialize::OutputArchive archive;
  write_module(*model_, "", values, name_of, archive);
  archive.save_to(path);
}

namespace {
at::Tensor text_tensor(const std::string& text) {
  return at::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, at::kChar)
      .clone();
}
std::string tensor_text(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}
}  // namespace

// Archive keys are plain identifiers (LibTorch archives reject dots), so tensors are stored by
// registration index and the parameter names once, newline-separated, to check on load.
void Engine::save_checkpoint(const std::string& path) const {
  TORCH_CHECK(phase_ == Phase::kIdle, "patrickstar: save_checkpoint() in the middle of an "
              "iteration; call it after step()");
  torch::serialize::OutputArchive archive;
  archive.write("format", at::tensor(kCheckpointFormat));
  archive.write("config_json", text_tensor(config_.to_json().dump()));
  std::string names;
  for (const Param& p : params_) names += p.name + "\n";
  archive.write("names", text_tensor(names));
  archive.write("adam_step", at::tensor(adam_->step_count()));
  archive.write("iteration", at::tensor(iteration_));
  const LossScalerState scaler = adam_->loss_scaler().state();
  archive.write("scaler", at::tensor({scaler.scale, static_cast<double>(scaler.step),
                                      static_cast<double>(scaler.last_overflow_step),
                                      static_cast<double>(scaler.hysteresis_left)},
                                     at::kDouble));
  const ChunkKind master = mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam;
  for (const Param& p : params_) {
    const std::string i = std::to_string(p.id);
    archive.write("master_" + i, store_->view(p.id, master).clone());
    archive.write("exp_avg_" + i, store_->view(p.id, ChunkKind::kMomentum).clone());
    archive.write("exp_avg_sq_" + i, store_->view(p.id, ChunkKind::kVariance).clone());
  }
  archive.save_to(path);
}

void Engine::load_checkpoint(const std::string& path) {
  TORCH_CHECK(phase_ == Phase::kIdle, "patrickstar: load_checkpoint() in the middle of an "
              "iteration; call it before a forward or after step()");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "patrickstar: cannot read checkpoint \"", path, "\": ",
                e.what_without_backtrace());
  }
  at::Tensor format, names_tensor;
  TORCH_CHECK(archive.try_read("format", format) && format.numel() == 1 &&
                  format.item<int64_t>() == kCheckpointFormat &&
                  archive.try_read("names", names_tensor),
              "patrickstar: \"", path, "\" is not a patrickstar checkpoint (format ",
              kCheckpointFormat, ")");
  // Read and check everything first: a checkpoint of another model changes nothing.
  std::vector<std::string> names;
  {
    const std::string text = tensor_text(names_tensor);
    size_t from = 0;
    for (size_t at = text.find('\n'); at != std::string::npos; at = text.find('\n', from)) {
      names.push_back(text.substr(from, at - from));
      from = at + 1;
    }
  }
  TORCH_CHECK(names.size() == params_.size(), "patrickstar: checkpoint \"", path,
              "\" is from another model: it has ", names.size(), " parameters, this model ",
              params_.size());
  struct Entry {
    at::Tensor master, exp_avg, exp_avg_sq;
  };
  std::vector<Entry> entries(params_.size());
  for (const Param& p : params_) {
    TORCH_CHECK(names[static_cast<size_t>(p.id)] == p.name, "patrickstar: checkpoint \"", path,
                "\" is from another model: parameter ", p.id, " is ", names[static_cast<size_t>(p.id)],
                " there but ", p.name, " here");
    const std::string i = std::to_string(p.id);
    Entry& e = entries[static_cast<size_t>(p.id)];
    archive.read("master_" + i, e.master);
    archive.read("exp_avg_" + i, e.exp_avg);
    archive.read("exp_avg_sq_" + i, e.exp_avg_sq);
    for (const at::Tensor* t : {&e.master, &e.exp_avg, &e.exp_avg_sq}) {
      TORCH_CHECK(t->sizes() == store_->layout().sizes(p.id) && t->scalar_type() == at::kFloat,
                  "patrickstar: checkpoint \"", path, "\" is from another model: parameter ",
                  p.name, " has shape ", t->sizes(), " there but ", store_->layout().sizes(p.id),
                  " here");
    }
  }
  at::Tensor adam_step, iteration, scaler;
  archive.read("adam_step", adam_step);
  archive.read("iteration", iteration);
  archive.read("scaler", scaler);
  torch::NoGradGuard no_grad;
  const ChunkKind master = mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam;
  for (const Param& p : params_) {
    const Entry& e = entries[static_cast<size_t>(p.id)];
    store_->view(p.id, master).copy_(e.master);
    if (mixed_) store_->view(p.id, ChunkKind::kParam).copy_(e.master);
    store_->view(p.id, ChunkKind::kMomentum).copy_(e.exp_avg);
    store_->view(p.id, ChunkKind::kVariance).copy_(e.exp_avg_sq);
  }
  adam_->set_step_count(adam_step.item<int64_t>());
  auto s = scaler.accessor<double, 1>();
  LossScalerState state;
  state.scale = s[0];
  state.step = static_cast<int64_t>(s[1]);
  state.last_overflow_step = static_cast<int64_t>(s[2]);
  state.hysteresis_left = static_cast<int>(s[3]);
  adam_->loss_scaler().load_state(state);
  if (grad_space_) zero_grad();
}

}  // namespace patrickstar
