// Registration: the model's parameters packed into chunks, one chunk index at a time, with the
// tiers, the disk tier, the scheduler, the tracer and the optimizer built around them. When this
// throws, nothing stays registered and the parameters that moved get their values back from the
// chunks; the error says when some could not (another rank's, with data parallel). Data parallel:
// the values are rank 0's from the start (broadcast before anything moves).
//
// register_parameters() runs the stages below in order; engine_core.h says what each leaves for the
// next. Until the chunks are filled a stage that throws undoes what registration did so far (the
// parameter table before the store exists, every chunk after: abandon_registration); after that,
// the constructor gives the model back as a destroyed engine does (give_back_model).
#include "engine_core.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>

#include "absl/strings/str_cat.h"
#include "patrickstar/memtracer/counting_allocator.h"

#include "deferred_values.h"
#include "disk_states.h"
#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

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

// What one stage of registration hands to the next. It lives as long as register_parameters(),
// as these did when they were its locals.
struct EngineCore::Registration {
  explicit Registration(const torch::nn::Module& model) : initializers(model) {}

  // collect_parameters: the initializers of deferred parameters (deferred_init.h), the parameters
  // once each in named_parameters() order (tied ones once; the position is the id), a CPU
  // embedding's parameters, and where each parameter is used (for its fence's message).
  const InitializerLookup initializers;
  std::vector<std::pair<std::string, at::Tensor>> unique;
  std::unordered_set<const c10::TensorImpl*> embedding_params;
  std::unordered_map<const c10::TensorImpl*, std::string> owner_of;
  // pack_layout: the training dtype (the param kind's), the chunk kinds, whether frozen chunk
  // indices are lean (the config's "frozen_parameters"), and the layout, until the store takes it.
  at::ScalarType half = at::kFloat;
  std::vector<ChunkKindSpec> kinds;
  bool lean = false;
  Layout layout;
  // place_model_data: this rank's share of the model data, and the host staging for the disk
  // tier's states (for the report).
  int64_t owned_bytes = 0;
  int64_t staging_bytes = 0;
  // fill_chunks: which parameters were deferred (by id), and the parameters whose storage is the
  // engine's fence now (what restore_moved gives back).
  std::vector<bool> was_deferred;
  std::vector<TensorId> moved;
};

void EngineCore::abandon_registration() {
  storage_.drop_chunks();
  params_.clear();
}

void EngineCore::register_parameters() {
  Registration reg(*model_);
  collect_parameters(reg);
  pack_layout(reg);
  build_store(reg);
  place_model_data(reg);
  // From the first copy into a chunk to the end of registration, autograd records nothing.
  torch::NoGradGuard no_grad;
  fill_chunks(reg);
  attach_model(reg);
  build_scheduling();
  build_optimizer();
  report_registration(reg);
}

void EngineCore::collect_parameters(Registration& reg) {
  // Collect and check, touching nothing. A deferred parameter (deferred_init.h) has no data yet:
  // its initializer gives its value when its chunk index is filled (fill_chunks).
  // Data parallel: the ranks agree on these checks before the broadcast below (a rank refused here
  // alone would leave the others waiting in it).
  std::string error;
  try {
    for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
      const at::Tensor& t = item.value();
      if (params_.id_of(t) >= 0) continue;  // tied: registered once
      if (!t.device().is_cpu() || t.scalar_type() != at::kFloat) {
        params_.clear();
        TORCH_CHECK(false, "patrickstar::Engine: parameter ", item.key(), " is ", t.scalar_type(),
                    " on ", t.device(),
                    "; build the model in fp32 on the CPU (the engine places it)");
      }
      if (is_deferred(t)) {
        try {
          reg.initializers.check(item.key());
        } catch (...) {
          params_.clear();
          throw;
        }
      }
      params_.add(t);
      reg.unique.emplace_back(item.key(), t);
    }
    // Each parameter's optimizer group: a group that takes nothing (or a predicate that throws)
    // refuses the model here, before anything moves, and the ranks agree on it below.
    if (!reg.unique.empty()) groups_.assign(config_.optimizer, *model_, reg.unique);
  } catch (const std::exception& e) {
    if (!dp_.distributed()) {
      params_.clear();
      throw;
    }
    error = error_text(e);
  } catch (...) {  // a param group's predicate may throw anything
    if (!dp_.distributed()) {
      params_.clear();
      throw;
    }
    error = "an exception that is not a std::exception, from a param group's predicate";
  }
  const std::string agreed = dp_.first_error(error);
  if (!agreed.empty()) {
    params_.clear();
    TORCH_CHECK(false, kRegistrationFailed, agreed, kNoRankRegistered);
  }
  TORCH_CHECK(!reg.unique.empty(), "patrickstar::Engine: the model has no parameters to train");
  // Data parallel: every rank starts from rank 0's weights and buffers (as DDP does).
  dp_.broadcast_initial_state(reg.unique, *model_);  // rank 0's values everywhere
  // use_cpu_embedding: the parameters of embedding modules get chunks of their own (layout group
  // 1) that stay on the host; the embedding reads them there and its Adam runs on the host.
  for (const auto& item : model_->named_modules("", /*include_self=*/true)) {
    const torch::nn::Module* module = item.value().get();
    params_.name_module(module, item.key().empty() ? "<root>" : item.key());
    const bool cpu_embedding =
        config_.use_cpu_embedding &&
        (dynamic_cast<const torch::nn::EmbeddingImpl*>(module) != nullptr ||
         dynamic_cast<const torch::nn::EmbeddingBagImpl*>(module) != nullptr);
    int64_t own = 0;
    for (const at::Tensor& t : module->parameters(/*recurse=*/false)) {
      own += t.numel();
      if (cpu_embedding) reg.embedding_params.insert(t.unsafeGetTensorImpl());
      reg.owner_of.emplace(
          t.unsafeGetTensorImpl(),
          absl::StrCat("module '", params_.module_name(module), "', ", module->name()));
    }
    metrics_.registration().largest_module_param_bytes =
        std::max(metrics_.registration().largest_module_param_bytes, 4 * own);
  }
}

void EngineCore::pack_layout(Registration& reg) {
  // The chunk kinds, and what one element of a chunk index costs in all of them (and lean: its
  // param kind alone).
  reg.half = param_dtype(config_.precision());
  std::vector<ChunkKindSpec> kinds = {{ChunkKind::kParam, reg.half}};
  if (mixed()) kinds.push_back({ChunkKind::kParamFp32, at::kFloat});
  const at::ScalarType moments =
      config_.optimizer.state_dtype == StateDtype::kBf16 ? at::kBFloat16 : at::kFloat;
  kinds.push_back({ChunkKind::kMomentum, moments});
  kinds.push_back({ChunkKind::kVariance, moments});
  if (gradients_.space()) kinds.push_back({ChunkKind::kGrad, at::kFloat});
  int64_t full_elem_bytes = 0;
  for (const ChunkKindSpec& spec : kinds) full_elem_bytes += chunk_element_bytes(spec.dtype);
  const int64_t lean_elem_bytes = chunk_element_bytes(reg.half);

  // Layout groups: bit 0, a CPU embedding's (kept on the host); bit 1, frozen at registration.
  // Frozen parameters get chunks of their own, so that a step moves none of those chunks (nothing
  // in them is updated), a backward writes no gradient into them, and (lean, the default) they
  // hold the weights alone. With data parallel a sharded layout rounds each group up to world_size
  // full chunks: a few adapters in a group of their own cost up to world_size chunks of every kind,
  // which lean frozen chunks repay only when the frozen base is large next to a chunk. So there
  // the split is made when it takes fewer bytes than frozen and trained parameters sharing chunks
  // (all of them with full state), and never with "full_state".
  reg.lean = config_.frozen_parameters == FrozenParameters::kLean;
  const bool lean = reg.lean;
  auto pack = [&](bool split_frozen) {
    Layout layout(dp_.shard_size());
    for (const auto& [name, t] : reg.unique) {
      const int group = (reg.embedding_params.count(t.unsafeGetTensorImpl()) ? 1 : 0) |
                        (t.requires_grad() || !split_frozen ? 0 : 2);
      layout.add_tensor(name, t.sizes(), group);
    }
    if (dp_.one_process()) retry_.keep_base(layout);  // "auto"'s retry packs other sizes from it
    try {
      if (config_.chunk_size_auto) {
        const SizeGrid grid = auto_size_grid(layout.max_numel());
        layout.finalize_search(grid.min_elems, grid.max_elems, grid.step_elems);
      } else {
        layout.finalize(config_.default_chunk_size);
      }
    } catch (c10::Error& e) {
      params_.clear();
      e.add_context(
          "while packing the model's parameters into chunks (config key "
          "\"default_chunk_size\")");
      throw;
    }
    return layout;
  };
  auto chunk_bytes_with_lean = [&](const Layout& l) {
    int64_t bytes = 0;
    for (int64_t i = 0; i < l.chunk_count(); ++i) {
      const bool lean_index = lean && (l.chunk_group(i) & 2) != 0;
      bytes += l.chunk_capacity(i) * (lean_index ? lean_elem_bytes : full_elem_bytes);
    }
    return bytes;
  };
  Layout layout = pack(/*split_frozen=*/dp_.one_process() || lean);
  const bool any_frozen = std::any_of(reg.unique.begin(), reg.unique.end(), [](const auto& item) {
    return !item.second.requires_grad();
  });
  if (!dp_.one_process() && lean && any_frozen) {
    Layout shared = pack(/*split_frozen=*/false);
    if (chunk_bytes_with_lean(shared) < chunk_bytes_with_lean(layout)) layout = std::move(shared);
  }
  if (!config_.chunk_size_auto && layout.waste_fraction() > 0.5) {
    TORCH_WARN("patrickstar: default_chunk_size ", config_.default_chunk_size, " leaves ",
               static_cast<int>(layout.waste_fraction() * 1000.0) / 10.0,
               "% of the chunk bytes empty for this model (", layout.total_numel(),
               " parameters in ", layout.chunk_count(), " chunk",
               layout.chunk_count() == 1 ? "" : "s",
               " per kind): every move and every byte of model data pays for the waste; leave "
               "\"default_chunk_size\" out of the config (or set \"auto\") and the engine picks "
               "the size with the least waste");
  }
  reg.kinds = std::move(kinds);
  reg.layout = std::move(layout);
}

void EngineCore::build_store(Registration& reg) {
  // Memory: tiers and chunks, every payload on the host to start with (but optimizer states the
  // host budget cannot hold: on the device for good, or in the disk tier's files, which
  // place_model_data decides). No payload is allocated here.
  const int64_t host_capacity = config_.device.host_capacity_bytes > 0
                                    ? config_.device.host_capacity_bytes
                                    : MemoryTier::kUnlimited;
  using Pin = HostTier::Pinning;  // pinned for CUDA only: an emulated run must not start CUDA
  const bool on_cuda = config_.device.type == DeviceType::kCuda;
  // A CPU embedding's chunk indices stay on the host; frozen ones (group bit 1) are lean unless the
  // config keeps full state for them, and then only their param chunk holds bytes from here on.
  auto host = std::make_unique<HostTier>(host_capacity, on_cuda ? Pin::kAuto : Pin::kNever);
  auto device = make_device_tier(config_);
  auto copy_queue = config_.scheduler.async_moves ? make_copy_engine(config_) : nullptr;
  storage_.build(std::move(host), std::move(device), std::move(reg.layout), reg.kinds,
                 std::move(copy_queue), reg.lean);
}

void EngineCore::place_model_data(Registration& reg) {
  const Layout* placed = &store().layout();
  // This rank's share of the model data (every chunk with one process).
  for (ChunkId id = 0; id < store().chunk_count(); ++id) {
    if (owns(store().index_of(id))) reg.owned_bytes += store().chunk_bytes(id);
  }
  // The disk tier: the optimizer states (every index's, until a step's placement brings the device
  // Adam's home) live in files; the host holds at most three indices' states at once (the one
  // Adam updates, the next one read ahead, the last one written behind).
  std::vector<ChunkKind> disk_kinds;
  int64_t disk_state_bytes = 0;
  if (config_.offload_optimizer.nvme) {
    if (!dp_.one_process()) {
      abandon_registration();
      TORCH_CHECK(false,
                  "patrickstar::Engine: the disk tier (zero_optimization.offload_optimizer "
                  "\"nvme\") runs with one process; this job has ",
                  dp_.world(), " ranks");
    }
    disk_kinds = state_kinds();
    int64_t largest = 0;
    for (int64_t i = 0; i < placed->chunk_count(); ++i) {
      int64_t bytes = 0;
      for (ChunkKind kind : disk_kinds) bytes += store().chunk_bytes(store().chunk_id(kind, i));
      disk_state_bytes += bytes;
      largest = std::max(largest, bytes);
    }
    reg.staging_bytes = std::min<int64_t>(3, placed->chunk_count()) * largest;
  }
  int64_t host_need = reg.owned_bytes - disk_state_bytes + reg.staging_bytes;
  // What the host budget cannot hold: optimizer states on the device for good, where allowed.
  std::string no_device_placement;
  pipeline_->placement().init(store().chunk_count(), placed->chunk_count());
  if (storage_.host()->capacity_bytes() != MemoryTier::kUnlimited &&
      storage_.host()->used_bytes() + host_need > storage_.host()->capacity_bytes()) {
    no_device_placement = place_states_on_device(storage_.host()->used_bytes() + host_need -
                                                 storage_.host()->capacity_bytes());
    host_need -= metrics_.registration().device_state_bytes;
  }
  // It must fit the host before anything moves: a model is either untouched or fully registered.
  if (storage_.host()->capacity_bytes() != MemoryTier::kUnlimited &&
      storage_.host()->used_bytes() + host_need > storage_.host()->capacity_bytes()) {
    const int64_t have = storage_.host()->capacity_bytes() - storage_.host()->used_bytes();
    abandon_registration();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "patrickstar::Engine: the model data needs ",
                     host_need, " bytes of host memory but the host budget has ", have,
                     " bytes left (config key client.device.host_capacity_bytes)",
                     disk_state_bytes > 0
                         ? absl::StrCat("; that is with ", disk_state_bytes,
                                        " bytes of optimizer "
                                        "states in the disk tier and ",
                                        reg.staging_bytes, " bytes of host staging for them")
                         : std::string(),
                     no_device_placement, "; nothing was registered");
  }
  if (!disk_kinds.empty()) {
    try {
      storage_.attach_disk(
          std::make_unique<DiskStates>(config_.offload_optimizer.nvme_path, store(), disk_kinds));
    } catch (...) {
      abandon_registration();
      throw;
    }
  }
}

void EngineCore::fill_chunks(Registration& reg) {
  // Values into chunks, one chunk index at a time: its weight payloads are allocated, its tensors
  // copied in and their original storage freed, and only then its optimizer payloads are
  // allocated. So the host holds at most the model data plus one chunk of fp32 weights still
  // waiting (RegistrationReport::host_peak_bytes_during_init measures it).
  const Layout* placed = &store().layout();
  CountingCpuAllocator& counter = *CountingCpuAllocator::installed();
  int64_t model_bytes_at_start = 0;
  // Deferred parameters (no data yet), by id: their values come from their initializers.
  reg.was_deferred.resize(reg.unique.size());
  for (size_t k = 0; k < reg.unique.size(); ++k) {
    reg.was_deferred[k] = is_deferred(reg.unique[k].second);
    if (!reg.was_deferred[k]) model_bytes_at_start += reg.unique[k].second.nbytes();
  }
  const int64_t live_at_start = counter.live_bytes();
  ScopedPeakWindow window(counter);  // this registration's own (another engine may be training)
  int64_t& init_peak = metrics_.registration().host_peak_bytes_during_init;
  auto sample = [&] {
    // What the process holds beyond what it held before registration began, plus the model's
    // own fp32 weights (there at the start).
    init_peak = std::max(init_peak, window.peak_bytes() - live_at_start + model_bytes_at_start +
                                        storage_.host()->used_bytes());
    window.reset();
  };
  sample();
  params_.create_entries();
  reg.moved.reserve(reg.unique.size());
  auto give_up = [&] {
    const bool restored = restore_moved(reg);
    abandon_registration();  // the disk tier's files go too
    return restored;
  };
  try {
    for (int64_t index = 0; index < store().chunks_per_kind(); ++index) {
      // Another rank's chunk: its tensors only get their fences (its values live at the owner).
      const bool mine = owns(index);
      const bool full = !storage_.lean()[static_cast<size_t>(index)];
      if (mine) {
        store().allocate(store().chunk_id(ChunkKind::kParam, index), Tier::kHost);
        if (mixed() && full) {
          const ChunkId master = store().chunk_id(ChunkKind::kParamFp32, index);
          store().allocate(master,
                           pipeline_->placement().state_on_device(master) ? Tier::kDevice : Tier::kHost);
        }
      }
      sample();
      for (TensorId id : placed->tensors_in_chunk(index)) {
        const auto& [name, t] = reg.unique[static_cast<size_t>(id)];
        const int64_t nbytes = t.numel() * static_cast<int64_t>(c10::elementSize(reg.half));
        // A CPU embedding's parameters compute on the host; the others where the device tier is.
        const c10::Device where = storage_.host_only()[static_cast<size_t>(index)]
                                      ? c10::Device(c10::kCPU)
                                      : storage_.device()->device();
        params_.fill(
            id, name, t, storage_without_memory(nbytes, where),
            fence_storage(nbytes, outside_door_message(name, reg.owner_of[t.unsafeGetTensorImpl()]),
                          where));
        const Param& p = params_[id];
        if (mine) {
          // A deferred parameter's value exists from here to its copies (one parameter at a time).
          const at::Tensor value = reg.was_deferred[static_cast<size_t>(id)]
                                       ? reg.initializers.value_of(name, t.sizes())
                                       : t;
          store().view(p.id, ChunkKind::kParam).copy_(value);
          if (mixed() && full) store().view(p.id, ChunkKind::kParamFp32).copy_(value);
        }
        t.set_data(tensor_over(p.fence, t.sizes(), reg.half));
        reg.moved.push_back(id);
      }
      sample();
      for (ChunkKind kind : {ChunkKind::kMomentum, ChunkKind::kVariance, ChunkKind::kGrad}) {
        if (!mine || !full || !store().has_kind(kind)) continue;
        const ChunkId id = store().chunk_id(kind, index);
        store().allocate(id, pipeline_->placement().state_on_device(id) ? Tier::kDevice : Tier::kHost);
      }
      sample();
      if (storage_.disk() != nullptr && full)
        storage_.disk()->spill(index);  // written to its files, its payloads freed
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
}

bool EngineCore::restore_moved(const Registration& reg) {
  // A failing system allocation mid-way (the budget was checked): the parameters already moved
  // get their values back from the chunks, which hold them exactly (the fp32 copy in mixed
  // precision). Data parallel: another rank's values never came here, so those cannot. A deferred
  // parameter is deferred again (its initializer gives the same value to the next registration).
  const Layout* placed = &store().layout();
  // (Nothing trained yet: there is nothing to take back or land.)
  const StateAccess access = pipeline_->access();
  bool all = true;
  for (TensorId id : reg.moved) {
    const Param& p = params_[id];
    if (reg.was_deferred[static_cast<size_t>(id)]) {
      p.tensor.set_data(deferred_tensor(p.tensor.sizes(), at::kFloat));
      continue;
    }
    try {
      TORCH_CHECK(owns(placed->placement(id).chunk_index), "another rank's parameter");
      p.tensor.set_data(fp32_copy(access.weight(id)));
    } catch (...) {
      all = false;
    }
  }
  return all;
}

void EngineCore::attach_model(const Registration& reg) {
  for (const Param& p : params_) {
    if (!p.trainable) continue;
    const TensorId id = p.id;
    set_post_accumulate_grad_hook(p.tensor,
                                  [this, id](const at::Tensor& t) { on_gradient(id, t); });
  }
  // Mixed precision: floating-point buffers (BatchNorm's running statistics) take the compute
  // dtype, as DeepSpeed's module.half()/bfloat16() does: LibTorch's operators want them to match
  // the half weights. The engine gives them back in fp32 when it goes.
  // Buffers live where the model computes (on CUDA: the GPU; the engine gives them back on the
  // CPU). Inputs are the trainer's to move, as in LibTorch.
  for (const at::Tensor& b : model_->buffers(/*recurse=*/true)) {
    const bool cast = mixed() && b.scalar_type() == at::kFloat;
    if (cast) params_.add_cast_buffer(b);
    if (cast || b.device() != storage_.device()->device()) {
      b.set_data(b.to(storage_.device()->device(), cast ? reg.half : b.scalar_type()));
    }
  }
}

int64_t EngineCore::delayed_copy_bytes() const {
  // Of the gradients, in fp32 also of the weights (a lean parameter never has a gradient to copy).
  int64_t elements = 0;
  for (const Param& p : params_) {
    if (!lean_param(p.id)) elements += store().layout().numel(p.id);
  }
  return elements * (!mixed() ? 8 : gradients_.space() ? 6 : 2);
}

void EngineCore::build_scheduling() {
  // "auto" retries a warm-up whose trace does not fit with a smaller chunk size
  // (engine_layout.cpp), where moving the model between layouts is simple: one process, no disk
  // tier's files, no states on the device for good, and no delayed update unless "plan": "auto"
  // holds it (the move lands the update in flight first; its buffers follow the runs' sizes).
  retry_.arm(config_.chunk_size_auto && dp_.one_process() && storage_.disk() == nullptr &&
             (!config_.delayed_update.enabled || plan_.enabled()) &&
             metrics_.registration().device_state_bytes == 0 &&
             config_.scheduler.policy != EvictionPolicy::kStatic);
  // One clock for the scheduler's moves, the copy thread's spans (chunks().copy_queue()'s
  // set_record_spans; none on CUDA) and the optimizer thread's, so that a trace shows them on one
  // time line.
  clock_ = microseconds_since_now();
  build_scheduler();
  if (storage_.copy_queue() != nullptr) storage_.copy_queue()->set_clock(clock_);
  recorder_ = std::make_unique<TraceRecorder>(probe_->get());
  // The optimizer threads' buffers are host-tier blocks (pinned on CUDA): within its capacity, and
  // outside the CPU allocator whose bytes the emulated device's probe measures as activations.
  MemoryTier* host = storage_.host();
  auto host_blocks = [host](int64_t numel, at::ScalarType dtype) {
    const int64_t bytes = std::max<int64_t>(1, numel * c10::elementSize(dtype));
    void* memory = host->allocate(bytes);
    return at::from_blob(
        memory, {numel}, [host](void* p) { host->deallocate(p); },
        at::TensorOptions().dtype(dtype));
  };
  int64_t delayed_bytes = 0;  // the delayed update's copies (host tier, beyond the chunks)
  if (config_.delayed_update.enabled) {
    TORCH_CHECK(dp_.one_process(),
                "patrickstar: zero_optimization.delayed_param_update runs in one "
                "process; this is data parallel over ",
                dp_.world(), " processes");
    // Its copies take what the host holds beyond every chunk: evictions to the host must always
    // find room.
    const int64_t copies = delayed_copy_bytes();
    if (host->capacity_bytes() != MemoryTier::kUnlimited) {
      const int64_t room = host->capacity_bytes() - store().total_chunk_bytes();
      TORCH_CHECK(copies <= room,
                  "patrickstar: zero_optimization.delayed_param_update keeps "
                  "copies of ",
                  copies, " bytes (", !mixed() ? "the gradients and weights" : "the gradients",
                  ") in host memory, but the host tier holds only ", std::max<int64_t>(room, 0),
                  " bytes beyond the model's chunks; raise "
                  "host_capacity_bytes or turn the delayed update off");
    }
    pipeline_->build_thread(StepPipeline::Thread::kDelayed, 0, host_blocks, clock_);
    delayed_bytes = copies;
  }
  // "plan": "auto" with the delayed update allowed chooses between it and the overlapped step:
  // both threads, one of them on.
  if ((!config_.delayed_update.enabled || plan_.enabled()) && !config_.offload_optimizer.nvme) {
    // The overlapped step's optimizer thread (started by its first job): no disk tier. The undo
    // buffers take only what the chunks never need: with a host capacity, what it holds beyond
    // every chunk (evictions to the host must always find room).
    int64_t max_bytes = config_.overlap_step.max_bytes;
    if (host->capacity_bytes() != MemoryTier::kUnlimited) {
      max_bytes = std::clamp<int64_t>(
          host->capacity_bytes() - store().total_chunk_bytes() - delayed_bytes, 0, max_bytes);
    }
    pipeline_->build_thread(StepPipeline::Thread::kOverlap, max_bytes, host_blocks, clock_);
  }

  build_mover();
}

void EngineCore::build_optimizer() {
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
  pipeline_->build_adam(adam_options, std::move(scaler), gradients_.space());
  pipeline_->set_group_options(groups_.initial_options(config_.optimizer, adam_options));
  dp_.start_groups(store().layout());
}

void EngineCore::report_registration(const Registration& reg) {
  const Layout* placed = &store().layout();
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
  r.model_data_bytes = reg.owned_bytes;  // this rank's share (everything with one process)
  r.model_data_bytes_per_param =
      static_cast<double>(r.model_data_bytes) / static_cast<double>(std::max<int64_t>(1, r.params));
  r.disk_bytes = storage_.disk() != nullptr ? storage_.disk()->disk_bytes() : 0;
  // With a disk tier the host holds the rest, plus one index's states while they are written.
  const int64_t staging =
      storage_.disk() != nullptr ? reg.staging_bytes / std::min<int64_t>(3, r.chunks_per_kind) : 0;
  r.init_goal_bytes = r.model_data_bytes - r.disk_bytes - r.device_state_bytes +
                      r.largest_module_param_bytes + staging;
}

}  // namespace patrickstar
