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
    : model_(std::move(model)), config_(std::move(config)), comm_(std::move(comm)) {
  TORCH_CHECK(model_ != nullptr, "patrickstar::Engine: the model is null");
  if (comm_ == nullptr) comm_ = make_local_communicator();
  rank_ = comm_->rank();
  world_ = comm_->world_size();
  // A Config built in code skips from_json's check of this pair; before the device's own checks,
  // so it is refused the same on every machine.
  TORCH_CHECK(config_.device.type == DeviceType::kEmulated ||
                  config_.scheduler.copy_delay_max_us == 0,
              "patrickstar::Engine: client.scheduler.copy_delay_max_us is ",
              config_.scheduler.copy_delay_max_us,
              ": injected copy delays test the emulated device's copy thread; on device type "
              "\"cuda\" copies run on a CUDA stream (set it to 0)");
  const std::string unavailable = device_unavailable_reason(config_);
  TORCH_CHECK(unavailable.empty(), "patrickstar::Engine: device type \"cuda\": ", unavailable,
              "; the emulated device trains on any machine (\"client\": {\"device\": {\"type\": "
              "\"emulated\"}})");
  TORCH_CHECK(config_.device.type == DeviceType::kEmulated || world_ == 1,
              "patrickstar::Engine: device type \"cuda\" with ", world_,
              " ranks: data parallel on GPUs is not wired yet (one process per engine on CUDA; "
              "data parallel runs on the emulated device)");
  // From here on config().device.capacity_bytes is the capacity in use, never "auto".
  config_.device.capacity_bytes = resolved_device_capacity(config_);
  // Other ranks' chunks are never allocated here (PatrickStar's release_after_init is always on):
  // their param chunks are gathered when a door needs them.
  mixed_ = config_.precision() != Precision::kFp32;
  grad_space_ = !mixed_ || config_.gradient_accumulation_steps > 1;
  // Non-model memory is what LibTorch's CPU allocator serves; the counter must see it from now on.
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  if (config_.device.type == DeviceType::kCuda) {
    // On a GPU it is the caching allocator's: chunk payloads do not come from it (the CUDA tier
    // allocates them itself), so everything it counts is non-model memory.
    probe_ = make_cuda_memory_probe(0);
    probe_->reset_peak();
  } else {
    auto probe = std::make_unique<CpuMemoryProbe>(counter);
    cpu_probe_ = probe.get();
    probe_ = std::move(probe);
  }
  if (world_ > 1) {
    auto gathered = std::make_unique<GatheredBytesProbe>(std::move(probe_));
    gathered_probe_ = gathered.get();
    probe_ = std::move(gathered);
  }
  report_config_warnings();
  // A module belongs to one engine: refuse before anything moves.
  for (const auto& item : model_->named_modules("", /*include_self=*/true)) {
    ModuleHookHandler* owner = handler_for(*item.value());
    TORCH_CHECK(owner == nullptr || owner == active_module_hook_handler(), "patrickstar::Engine: module ",
                item.key().empty() ? "<root>" : item.key(),
                " already belongs to another engine; a module can be trained by one engine only");
  }
  try {
    register_parameters();
    zero_grad_marker_ = at::zeros({1}).requires_grad_();
    zero_grad_marker_grad_ = at::zeros({1});
    arm_zero_grad_marker();
  } catch (...) {
    // A failing allocation after the parameters moved (register_parameters restores them itself
    // when it fails mid-way): the model gets its weights back, as from a destroyed engine.
    give_back_model(/*may_gather=*/false);
    throw;
  }
  // From now on the doors of the model's modules find this engine.
  for (const auto& [module, name] : module_names_) register_module_handler(*module, this);
}

namespace {
std::string outside_door_message(const std::string& param, const std::string& owner) {
  return absl::StrCat(
      "patrickstar: parameter '", param, "' (", owner,
      ") was read outside its door: the engine keeps it in a chunk, and outside the doors it has "
      "no data. In a forward, call the module through its door (patrickstar::call(module, x)), or "
      "open a patrickstar::ModuleScope on the module whose forward uses the parameter directly; "
      "outside a forward, a patrickstar::GatheredParameters scope makes parameters real fp32 "
      "tensors for values (saving, re-initialization, a penalty's value; a loss term computed in "
      "such a scope cannot be back-propagated after it: put it behind the module's door)");
}
}  // namespace

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
  for (const auto& [module, name] : module_names_) unregister_module_handler(*module, this);
  if (!gathered_scopes_.empty()) {
    TORCH_WARN("patrickstar: the engine is destroyed while ", gathered_scopes_.size(),
               " GatheredParameters scope", gathered_scopes_.size() == 1 ? " is" : "s are",
               " open: their values are not written back (the model gets the fp32 master weights)");
    for (GatheredParameters* scope : gathered_scopes_) scope->engine_ = nullptr;
  }
  give_back_model(/*may_gather=*/std::uncaught_exceptions() == 0);
}

void EngineCore::give_back_model(bool may_gather) {
  if (store_ == nullptr) return;
  for (Param& p : params_) p.grad_consumed = false;
  clear_gradient_handles();  // no grad() may keep pointing into a chunk
  // The model gets ordinary fp32 parameters back, with the master weights: it trains on with plain
  // LibTorch. Nothing may keep pointing into the payloads the store is about to free.
  torch::NoGradGuard no_grad;
  const ChunkKind master = master_kind();
  // Data parallel: every rank destroys its engine, and the masters come from their owners. Not
  // while an exception unwinds (the other ranks are elsewhere): then, and when the gather fails,
  // the parameters keep their fences (reading one throws) and nothing points at the engine.
  std::vector<at::Tensor> masters(static_cast<size_t>(store_->chunks_per_kind()));
  if (distributed()) {
    std::string failure;
    if (!may_gather) {
      failure = "an exception is unwinding on this rank";
    } else {
      try {
        for (int64_t i = 0; i < store_->chunks_per_kind(); ++i) masters[i] = master_chunk_everywhere(i);
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    if (!failure.empty()) {
      TORCH_WARN("patrickstar: the engine was destroyed without gathering the fp32 weights from "
                 "the other ranks (", failure, "); the model's parameters are left without values");
      for (const Param& p : params_) {
        if (!p.tensor.defined()) continue;
        if (p.tensor.requires_grad() && p.tensor.is_leaf()) clear_post_accumulate_grad_hook(p.tensor);
        point_at_nothing(p);
      }
      for (const at::Tensor& b : cast_buffers_) b.set_data(b.to(at::kFloat));
      return;
    }
  }
  int64_t lost = 0;  // parameters whose value could not be allocated (out of memory)
  // One chunk at a time: its tensors get their values, then (one process) its payloads of every
  // kind go back to the system, so the host holds the model data plus one chunk's fp32 values at
  // most, not the model data plus the whole model in fp32 (megatron_1.3B: 18.5 GB + 5.3 GB).
  if (!distributed()) {
    try {
      store_->finish_copies();
    } catch (const std::exception&) {
      // A failed copy's chunk has no readable payload: its tensors are counted as lost below.
    }
  }
  for (int64_t index = 0; index < store_->chunks_per_kind(); ++index) {
    for (TensorId id : store_->layout().tensors_in_chunk(index)) {
      const Param& p = params_[static_cast<size_t>(id)];
      if (!p.tensor.defined()) continue;
      if (p.tensor.requires_grad() && p.tensor.is_leaf()) clear_post_accumulate_grad_hook(p.tensor);
      const TensorPlacement& where = store_->layout().placement(p.id);
      at::Tensor value;
      try {
        value = distributed()
                    ? masters[where.chunk_index].narrow(0, where.offset_elems, where.numel)
                          .view(p.tensor.sizes()).clone()
                    : host_copy(state_view(p.id, master));
      } catch (const std::exception&) {
        ++lost;
      }
      if (!p.gathered) point_at_nothing(p);
      if (value.defined()) p.tensor.set_data(value);
    }
    if (distributed()) continue;
    try {
      finish_state_views();  // read only: frees the disk tier's staged states (if any)
    } catch (const std::exception&) {
    }
    for (int k = 0; k < kChunkKindCount; ++k) {
      const auto kind = static_cast<ChunkKind>(k);
      if (!store_->has_kind(kind)) continue;
      try {
        store_->release(store_->chunk_id(kind, index));
      } catch (const std::exception&) {
        // A tensor still in COMPUTE: the payload goes with the store.
      }
    }
    host_->empty_cache();
    device_->empty_cache();
  }
  for (const at::Tensor& b : cast_buffers_) {
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
  if (lost > 0) {
    TORCH_WARN("patrickstar: the engine could not give ", lost, " of the model's tensors their "
               "fp32 values back (out of memory, or a chunk lost to a failed copy); they are left "
               "without values");
  }
}

void EngineCore::register_parameters() {
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
  // Data parallel: every rank starts from rank 0's weights and buffers (as DDP does).
  if (distributed()) broadcast_initial_state(unique);
  // use_cpu_embedding: the parameters of embedding modules get chunks of their own (layout group
  // 1) that stay on the host; the embedding reads them there and its Adam runs on the host.
  std::unordered_set<const c10::TensorImpl*> embedding_params;
  // Where each parameter is used, for the error an operator reading it outside its door throws.
  std::unordered_map<const c10::TensorImpl*, std::string> owner_of;
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
      owner_of.emplace(t.unsafeGetTensorImpl(),
                       absl::StrCat("module '", module_names_[module], "', ", module->name()));
    }
    metrics_.registration().largest_module_param_bytes =
        std::max(metrics_.registration().largest_module_param_bytes, 4 * own);
  }
  Layout layout(world_);
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
  if (!config_.chunk_size_auto && layout.waste_fraction() > 0.5) {
    TORCH_WARN("patrickstar: default_chunk_size ", config_.default_chunk_size, " leaves ",
               static_cast<int>(layout.waste_fraction() * 1000.0) / 10.0,
               "% of the chunk bytes empty for this model (", layout.total_numel(),
               " parameters in ", layout.chunk_count(), " chunk", layout.chunk_count() == 1 ? "" : "s",
               " per kind): every move and every byte of model data pays for the waste; leave "
               "\"default_chunk_size\" out of the config (or set \"auto\") and the engine picks "
               "the size with the least waste");
  }

  // 2. Memory: tiers and chunks, every payload on the host to start with (but optimizer states
  //    the host budget cannot hold: on the device for good, or in the disk tier's files).
  const at::ScalarType half = param_dtype(config_.precision());
  std::vector<ChunkKindSpec> kinds = {{ChunkKind::kParam, half}};
  if (mixed_) kinds.push_back({ChunkKind::kParamFp32, at::kFloat});
  kinds.push_back({ChunkKind::kMomentum, at::kFloat});
  kinds.push_back({ChunkKind::kVariance, at::kFloat});
  if (grad_space_) kinds.push_back({ChunkKind::kGrad, at::kFloat});
  const int64_t host_capacity = config_.device.host_capacity_bytes > 0
                                    ? config_.device.host_capacity_bytes
                                    : MemoryTier::kUnlimited;
  using Pin = HostTier::Pinning;  // pinned for CUDA only: an emulated run must not start CUDA
  const bool on_cuda = config_.device.type == DeviceType::kCuda;
  host_ = std::make_unique<HostTier>(host_capacity, on_cuda ? Pin::kAuto : Pin::kNever);
  device_ = make_device_tier(config_);
  store_ = std::make_unique<ChunkStore>(std::move(layout), kinds, *host_, *device_);
  if (config_.scheduler.async_moves) {
    copy_queue_ = make_copy_engine(config_);
    store_->set_copy_queue(copy_queue_.get());
  }
  const Layout* placed = &store_->layout();
  host_only_.assign(static_cast<size_t>(placed->chunk_count()), false);
  for (int64_t i = 0; i < placed->chunk_count(); ++i) host_only_[i] = placed->chunk_group(i) == 1;
  // This rank's share of the model data (every chunk with one process).
  int64_t owned_bytes = 0;
  for (ChunkId id = 0; id < store_->chunk_count(); ++id) {
    if (owns(store_->index_of(id))) owned_bytes += store_->chunk_bytes(id);
  }
  // The disk tier: the optimizer states (every index's, until a step's placement brings the device
  // Adam's home) live in files; the host holds at most three indices' states at once (the one
  // Adam updates, the next one read ahead, the last one written behind).
  std::vector<ChunkKind> disk_kinds;
  int64_t disk_state_bytes = 0;
  int64_t staging_bytes = 0;
  if (config_.offload_optimizer.nvme) {
    if (distributed()) {
      store_.reset();
      param_of_impl_.clear();
      TORCH_CHECK(false, "patrickstar::Engine: the disk tier (zero_optimization.offload_optimizer "
                  "\"nvme\") runs with one process; this job has ", world_, " ranks");
    }
    if (mixed_) disk_kinds.push_back(ChunkKind::kParamFp32);
    disk_kinds.push_back(ChunkKind::kMomentum);
    disk_kinds.push_back(ChunkKind::kVariance);
    int64_t largest = 0;
    for (int64_t i = 0; i < placed->chunk_count(); ++i) {
      int64_t bytes = 0;
      for (ChunkKind kind : disk_kinds) bytes += store_->chunk_bytes(store_->chunk_id(kind, i));
      disk_state_bytes += bytes;
      largest = std::max(largest, bytes);
    }
    staging_bytes = std::min<int64_t>(3, placed->chunk_count()) * largest;
  }
  int64_t host_need = owned_bytes - disk_state_bytes + staging_bytes;
  // What the host budget cannot hold: optimizer states on the device for good, where allowed.
  std::string no_device_placement;
  adam_placement_.init(store_->chunk_count(), placed->chunk_count());
  if (host_->capacity_bytes() != MemoryTier::kUnlimited &&
      host_->used_bytes() + host_need > host_->capacity_bytes()) {
    no_device_placement =
        place_states_on_device(host_->used_bytes() + host_need - host_->capacity_bytes());
    host_need -= metrics_.registration().device_state_bytes;
  }
  // It must fit the host before anything moves: a model is either untouched or fully registered.
  if (host_->capacity_bytes() != MemoryTier::kUnlimited &&
      host_->used_bytes() + host_need > host_->capacity_bytes()) {
    const int64_t have = host_->capacity_bytes() - host_->used_bytes();
    store_.reset();
    param_of_impl_.clear();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "patrickstar::Engine: the model data needs ", host_need,
                     " bytes of host memory but the host budget has ", have,
                     " bytes left (config key client.device.host_capacity_bytes)",
                     disk_state_bytes > 0
                         ? absl::StrCat("; that is with ", disk_state_bytes, " bytes of optimizer "
                                        "states in the disk tier and ", staging_bytes,
                                        " bytes of host staging for them")
                         : std::string(),
                     no_device_placement, "; nothing was registered");
  }
  if (!disk_kinds.empty()) {
    try {
      disk_ = std::make_unique<DiskStates>(config_.offload_optimizer.nvme_path, *store_, disk_kinds);
    } catch (...) {
      store_.reset();
      param_of_impl_.clear();
      throw;
    }
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
  ScopedPeakWindow window(counter);  // this registration's own (another engine may be training)
  int64_t& init_peak = metrics_.registration().host_peak_bytes_during_init;
  auto sample = [&] {
    // What the process holds beyond what it held before registration began, plus the model's
    // own fp32 weights (there at the start).
    init_peak = std::max(init_peak, window.peak_bytes() - live_at_start + model_bytes_at_start +
                                        host_->used_bytes());
    window.reset();
  };
  sample();
  params_.resize(unique.size());
  std::vector<TensorId> moved;  // parameters whose storage is now the engine's fence
  moved.reserve(unique.size());
  // A failing system allocation mid-way (the budget was checked): the parameters already moved
  // get their values back from the chunks, which hold them exactly (the fp32 copy in mixed
  // precision). Data parallel: another rank's values never came here, so those cannot.
  auto restore_moved = [&]() -> bool {
    bool all = true;
    for (TensorId id : moved) {
      Param& p = params_[static_cast<size_t>(id)];
      try {
        TORCH_CHECK(owns(placed->placement(id).chunk_index), "another rank's parameter");
        p.tensor.set_data(
            host_copy(state_view(id, master_kind())));
      } catch (...) {
        all = false;
      }
    }
    return all;
  };
  auto give_up = [&] {
    const bool restored = restore_moved();
    disk_.reset();  // its files go
    store_.reset();
    param_of_impl_.clear();
    params_.clear();
    return restored;
  };
  try {
    for (int64_t index = 0; index < store_->chunks_per_kind(); ++index) {
      // Another rank's chunk: its tensors only get their fences (its values live at the owner).
      const bool mine = owns(index);
      if (mine) {
        store_->allocate(store_->chunk_id(ChunkKind::kParam, index), Tier::kHost);
        if (mixed_) {
          const ChunkId master = store_->chunk_id(ChunkKind::kParamFp32, index);
          store_->allocate(master, adam_placement_.state_on_device(master) ? Tier::kDevice
                                                                                 : Tier::kHost);
        }
      }
      sample();
      for (TensorId id : placed->tensors_in_chunk(index)) {
        const auto& [name, t] = unique[static_cast<size_t>(id)];
        Param& p = params_[static_cast<size_t>(id)];
        p.name = name;
        p.tensor = t;
        p.id = id;
        p.trainable = t.requires_grad();
        if (mine) {
          store_->view(p.id, ChunkKind::kParam).copy_(t);
          if (mixed_) store_->view(p.id, ChunkKind::kParamFp32).copy_(t);
        }
        const int64_t nbytes = t.numel() * static_cast<int64_t>(c10::elementSize(half));
        // A CPU embedding's parameters compute on the host; the others where the device tier is.
        const c10::Device where = host_only_[static_cast<size_t>(index)] ? c10::Device(c10::kCPU)
                                                                        : device_->device();
        p.live = storage_without_memory(nbytes, where);
        p.fence = fence_storage(
            nbytes, outside_door_message(name, owner_of[t.unsafeGetTensorImpl()]), where);
        t.set_data(tensor_over(p.fence, t.sizes(), half));
        moved.push_back(id);
      }
      sample();
      for (ChunkKind kind : {ChunkKind::kMomentum, ChunkKind::kVariance, ChunkKind::kGrad}) {
        if (!mine || !store_->has_kind(kind)) continue;
        const ChunkId id = store_->chunk_id(kind, index);
        store_->allocate(id, adam_placement_.state_on_device(id) ? Tier::kDevice : Tier::kHost);
      }
      sample();
      if (disk_ != nullptr) disk_->spill(index);  // written to its files, its payloads freed
    }
  } catch (c10::Error& e) {
    const bool restored = give_up();
    e.add_context(restored ? "patrickstar::Engine: registration stopped; the model's parameters "
                             "are as they were"
                           : "patrickstar::Engine: registration stopped and some of the model's "
                             "parameters could not be given back their values");
    throw;
  } catch (...) {
    give_up();
    throw;
  }
  for (const Param& p : params_) {
    if (!p.trainable) continue;
    const TensorId id = p.id;
    set_post_accumulate_grad_hook(p.tensor, [this, id](const at::Tensor& t) { on_gradient(id, t); });
  }
  // Mixed precision: floating-point buffers (BatchNorm's running statistics) take the compute
  // dtype, as DeepSpeed's module.half()/bfloat16() does: LibTorch's operators want them to match
  // the half weights. The engine gives them back in fp32 when it goes.
  // Buffers live where the model computes (on CUDA: the GPU; the engine gives them back on the
  // CPU). Inputs are the trainer's to move, as in LibTorch.
  for (const at::Tensor& b : model_->buffers(/*recurse=*/true)) {
    const bool cast = mixed_ && b.scalar_type() == at::kFloat;
    if (cast) cast_buffers_.push_back(b);
    if (cast || b.device() != device_->device()) {
      b.set_data(b.to(device_->device(), cast ? half : b.scalar_type()));
    }
  }

  // 4. Scheduler, tracer, optimizer.
  // Data parallel: other ranks' param chunks on the device are the doors' (gathered with their
  // group, dropped after use), not the scheduler's; their bytes reach its budgets as non-model
  // bytes of the trace. Other ranks' gradient chunks are scheduled (they carry gradients).
  std::map<int64_t, ChunkInfo> chunk_table;
  for (ChunkId id = 0; id < store_->chunk_count(); ++id) {
    if (store_->kind_of(id) == ChunkKind::kParam && !owns(store_->index_of(id)) &&
        !host_only_[store_->index_of(id)]) {
      continue;
    }
    chunk_table[id] = ChunkInfo{store_->chunk_bytes(id),
                                store_->kind_of(id) == ChunkKind::kParam &&
                                    !host_only_[store_->index_of(id)],
                                adam_placement_.state_on_device(id)};
  }
  SchedulerOptions options;
  options.capacity_bytes = config_.device.capacity_bytes;
  options.overall_ratio = config_.mem_tracer.overall_gpu_mem_ratio;
  options.reserve_bytes = config_.scheduler.reserve_bytes;
  options.warmup_ratio = config_.mem_tracer.warmup_gpu_chunk_mem_ratio;
  options.policy = config_.scheduler.policy;
  options.prefetch_depth = config_.scheduler.prefetch_depth;
  scheduler_ = std::make_unique<Scheduler>(options, std::move(chunk_table));
  if (copy_queue_ != nullptr) {
    // One clock for the scheduler's moves and the copy thread's spans (chunks().copy_queue()'s
    // set_record_spans), so that a trace shows both on one time line (no spans on CUDA).
    const std::function<int64_t()> now_us = microseconds_since_now();
    scheduler_->set_clock(now_us);
    copy_queue_->set_clock(now_us);
  }
  recorder_ = std::make_unique<TraceRecorder>(probe_.get());
  mover_ = std::make_unique<Mover>(*store_, /*lazy_grads=*/distributed());

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
  if (distributed()) {
    // (Each step agrees on the gradient norm across ranks: step() installs the reducer.)
    const int64_t groups = placed->chunk_count() / world_;
    std::vector<int64_t> tensors(static_cast<size_t>(groups), 0);
    for (int64_t i = 0; i < placed->chunk_count(); ++i) {
      tensors[static_cast<size_t>(placed->comm_group(i))] +=
          static_cast<int64_t>(placed->tensors_in_chunk(i).size());
    }
    groups_.init(world_, tensors);
    reduced_grads_.resize(static_cast<size_t>(placed->chunk_count()));
  }

  // 5. Figures.
  RegistrationReport& r = metrics_.registration();
  r.tensors = static_cast<int64_t>(params_.size());
  r.params = placed->total_numel();
  for (const Param& p : params_) {
    if (p.trainable) r.trainable_params += placed->numel(p.id);
  }
  r.chunk_elems = placed->chunk_elems();
  r.chunks_per_kind = placed->chunk_count();
  r.chunk_waste_elems = placed->waste_elems();
  r.chunk_waste_fraction = placed->waste_fraction();
  r.model_data_bytes = owned_bytes;  // this rank's share (everything with one process)
  r.model_data_bytes_per_param =
      static_cast<double>(r.model_data_bytes) / static_cast<double>(std::max<int64_t>(1, r.params));
  r.disk_bytes = disk_ != nullptr ? disk_->disk_bytes() : 0;
  // With a disk tier the host holds the rest, plus one index's states while they are written.
  r.init_goal_bytes = r.model_data_bytes - r.disk_bytes - r.device_state_bytes +
                      r.largest_module_param_bytes +
                      (disk_ != nullptr ? staging_bytes / std::min<int64_t>(3, r.chunks_per_kind) : 0);
}

}  // namespace patrickstar
