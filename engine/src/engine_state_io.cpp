#include "engine_core.h"

#include <map>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <nlohmann/json.hpp>

#include "checkpoint_file.h"
#include "disk_states.h"
#include "engine_internal.h"
#include "patrickstar/engine/atomic_file.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

std::vector<std::pair<std::string, at::Tensor>> EngineCore::fp32_state_dict() const {
  // The states as they were before the backward, with the delayed update in flight written in.
  return fp32_values(pipeline_->access());
}

std::vector<std::pair<std::string, at::Tensor>> EngineCore::fp32_values(
    const StateAccess& access) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!dp_.values_from_owners()) {
    std::vector<at::Tensor> values(params_.size());  // by tensor id, which is params_'s index
    for (TensorId id : tensors_in_chunk_order(store().layout())) {
      values[static_cast<size_t>(id)] = fp32_copy(access.weight(id));
    }
    access.finish_views();
    for (const Param& p : params_) out.emplace_back(p.name, values[static_cast<size_t>(p.id)]);
    return out;
  }
  // Data parallel: each chunk's master comes from its owner (a collective: every rank calls).
  std::vector<at::Tensor> chunks(static_cast<size_t>(store().chunks_per_kind()));
  for (int64_t i = 0; i < store().chunks_per_kind(); ++i)
    chunks[i] = dp_.master_chunk_everywhere(access, i, master_kind());
  for (const Param& p : params_) {
    out.emplace_back(
        p.name, DataParallel::value_in(store().layout(),
                                       chunks[store().layout().placement(p.id).chunk_index], p.id));
  }
  return out;
}

namespace {
// Writes `module`'s parameters (from `values` by full name) and buffers into `archive`, with one
// nested archive per child, the layout torch::nn::Module::save uses: torch::load reads it back.
void write_module(const torch::nn::Module& module, const std::string& prefix,
                  const std::map<std::string, at::Tensor>& values,
                  const std::unordered_map<const c10::TensorImpl*, std::string>& name_of,
                  const std::unordered_set<const c10::TensorImpl*>& cast,
                  torch::serialize::OutputArchive& archive) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    const auto canonical = name_of.at(item.value().unsafeGetTensorImpl());
    archive.write(item.key(), values.at(canonical));
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    // Buffers the engine cast to the compute dtype are saved in fp32, as the parameters are.
    const at::Tensor& b = item.value();
    // Host tensors on every device (on CUDA the buffers live on the GPU).
    archive.write(item.key(),
                  b.to(at::kCPU, cast.count(b.unsafeGetTensorImpl()) ? at::kFloat : b.scalar_type()),
                  /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    torch::serialize::OutputArchive child_archive;
    write_module(*child.value(), prefix + child.key() + ".", values, name_of, cast, child_archive);
    archive.write(child.key(), child_archive);
  }
}
}  // namespace

void EngineCore::save_weights(const std::string& path) const {
  // The states as they were before the backward, with the delayed update in flight written in.
  const StateAccess access = pipeline_->access();
  std::map<std::string, at::Tensor> values;
  for (auto& [name, t] : fp32_values(access)) values.emplace(name, t);
  std::unordered_map<const c10::TensorImpl*, std::string> name_of;
  for (const Param& p : params_) name_of[p.tensor.unsafeGetTensorImpl()] = p.name;
  torch::serialize::OutputArchive archive;
  std::unordered_set<const c10::TensorImpl*> cast;
  for (const at::Tensor& b : params_.cast_buffers()) cast.insert(b.unsafeGetTensorImpl());
  write_module(*model_, "", values, name_of, cast, archive);
  // Data parallel: one consolidated archive, from rank 0. Written to a temporary file and renamed
  // over `path`: an interrupted save leaves the previous file as it was.
  if (dp_.rank() == 0) save_archive_atomically(archive, path);
}

// Format-3 checkpoints (before checkpoint_io.cpp's format 4): CheckpointContents in a sealed file
// (checkpoint_file.h), one per rank; they load with the ranks that wrote them.
namespace {
// Data parallel: each rank's shard has a file of its own next to `path`.
std::string shard_path(const std::string& path, int rank, int world) {
  return world == 1 ? path : path + ".rank" + std::to_string(rank) + "-of-" + std::to_string(world);
}
}  // namespace

void EngineCore::load_checkpoint_format3(const StateAccess& access, const std::string& path_given) {
  const std::string path = shard_path(path_given, dp_.rank(), dp_.world());
  // Read and check everything first: a damaged checkpoint, or one of another model, changes
  // nothing.
  CheckpointContents c;
  std::string error;
  try {
    c = read_checkpoint_file(path);
    TORCH_CHECK(c.names.size() == params_.size(), "patrickstar: checkpoint \"", path,
                "\" is from another model: it has ", c.names.size(), " parameters, this model ",
                params_.size());
    TORCH_CHECK(c.world_size == dp_.world() && c.rank == dp_.rank(), "patrickstar: checkpoint \"", path,
                "\" is rank ", c.rank, "'s shard of ", c.world_size, " rank(s); this is rank ",
                dp_.rank(), " of ", dp_.world(), ": resume with the number of ranks that saved it");
    const std::string here(to_string(config_.precision()));
    TORCH_CHECK(c.precision == here, "patrickstar: checkpoint \"", path, "\" was saved by a ",
                c.precision, " engine and this engine is ", here, ": resume with the precision that "
                "saved it (save_weights writes fp32 weights that any engine's model can start from)");
    TORCH_CHECK(c.chunk_elems == store().chunk_elems() || dp_.world() == 1, "patrickstar: checkpoint \"",
                path, "\" was saved with chunks of ", c.chunk_elems, " elements, this engine has ",
                store().chunk_elems(),
                ": with several ranks the chunk size decides which rank owns what; use the config "
                "that saved it");
    for (const Param& p : params_) {
      const std::string& saved = c.names[static_cast<size_t>(p.id)];
      TORCH_CHECK(saved == p.name, "patrickstar: checkpoint \"", path, "\" is from another model: "
                  "parameter ", p.id, " is ", saved, " there but ", p.name, " here");
      if (!owns(store().layout().placement(p.id).chunk_index)) continue;
      auto it = c.params.find(p.id);
      TORCH_CHECK(it != c.params.end(), "patrickstar: checkpoint \"", path,
                  "\" has no optimizer "
                  "state for parameter ",
                  p.name,
                  dp_.with_ranks(" (another rank owned it there: the checkpoint's chunk layout is "
                                 "not this engine's, from another default_chunk_size or "
                                 "zero_optimization.frozen_parameters; use the config that saved "
                                 "it)"));
      TORCH_CHECK(it->second.master.sizes() == store().layout().sizes(p.id),
                  "patrickstar: checkpoint \"", path, "\" is from another model: parameter ",
                  p.name, " has shape ", it->second.master.sizes(), " there but ",
                  store().layout().sizes(p.id), " here");
    }
    // The disk tier's files are read while the states are written: all there, or nothing loads.
    if (storage_.disk() != nullptr) storage_.disk()->check_files();
    try {
      pipeline_->adam().loss_scaler().check_state(c.scaler);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "patrickstar: checkpoint \"", path, "\" does not suit this engine's loss "
                  "scaler (", e.what_without_backtrace(), "); nothing was loaded");
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Data parallel: every rank loads or none does (a rank that trained on from other weights would
  // leave the ranks apart for good).
  const std::string agreed = dp_.first_error(error);
  TORCH_CHECK(agreed.empty(), dp_.distributed() ? "patrickstar: load_checkpoint(\"" + path_given +
                                                      "\") failed on " + agreed +
                                                      "; nothing was loaded on any rank"
                                                : agreed);
  dp_.release_remote(/*discard=*/true);  // data parallel: gathered copies of the old weights go
  torch::NoGradGuard no_grad;
  const ChunkKind master = master_kind();
  for (TensorId id : tensors_in_chunk_order(store().layout())) {
    const Param& p = params_[id];
    if (!owns(store().layout().placement(p.id).chunk_index)) continue;
    const CheckpointParam& saved = c.params.at(p.id);
    if (lean_param(p.id)) {  // its weights alone; saved moments (if any) have nowhere to go
      store().view(p.id, ChunkKind::kParam).copy_(saved.master);
      continue;
    }
    access.state(p.id, master, /*write=*/true).copy_(saved.master);
    if (mixed()) store().view(p.id, ChunkKind::kParam).copy_(saved.master);
    // Saved lean (frozen, without moments): it starts from none, as it would have trained.
    for (auto [kind, moment] : {std::pair{ChunkKind::kMomentum, &saved.exp_avg},
                                std::pair{ChunkKind::kVariance, &saved.exp_avg_sq}}) {
      at::Tensor view = access.state(p.id, kind, /*write=*/true);
      if (moment->defined()) {
        view.copy_(*moment);
      } else {
        view.zero_();
      }
    }
  }
  access.finish_views();
  pipeline_->adam().set_step_count(c.adam_step);
  for (const Param& p : params_) {
    params_.set_adam_steps(
        p.id, c.param_steps.empty() ? c.adam_step : c.param_steps[static_cast<size_t>(p.id)]);
  }
  pipeline_->adam().loss_scaler().load_state(c.scaler);
  if (gradients_.space()) zero_grad();
}

}  // namespace patrickstar
