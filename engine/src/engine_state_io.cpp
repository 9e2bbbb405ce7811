#include "patrickstar/engine/engine.h"

#include <map>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "engine_internal.h"
#include "patrickstar/engine/atomic_file.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

std::vector<std::pair<std::string, at::Tensor>> Engine::fp32_state_dict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const ChunkKind master = mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam;
  if (!distributed()) {
    for (const Param& p : params_) out.emplace_back(p.name, store_->view(p.id, master).clone());
    return out;
  }
  // Data parallel: each chunk's master comes from its owner (a collective: every rank calls).
  std::vector<at::Tensor> chunks(static_cast<size_t>(store_->chunks_per_kind()));
  for (int64_t i = 0; i < store_->chunks_per_kind(); ++i) chunks[i] = master_chunk_everywhere(i);
  for (const Param& p : params_) {
    const TensorPlacement& where = store_->layout().placement(p.id);
    out.emplace_back(p.name, chunks[where.chunk_index]
                                 .narrow(0, where.offset_elems, where.numel)
                                 .view(store_->layout().sizes(p.id))
                                 .clone());
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
    archive.write(item.key(), cast.count(b.unsafeGetTensorImpl()) ? b.to(at::kFloat) : b,
                  /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    torch::serialize::OutputArchive child_archive;
    write_module(*child.value(), prefix + child.key() + ".", values, name_of, cast, child_archive);
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
  std::unordered_set<const c10::TensorImpl*> cast;
  for (const at::Tensor& b : cast_buffers_) cast.insert(b.unsafeGetTensorImpl());
  write_module(*model_, "", values, name_of, cast, archive);
  // Data parallel: one consolidated archive, from rank 0. Written to a temporary file and renamed
  // over `path`: an interrupted save leaves the previous file as it was.
  if (rank_ == 0) save_archive_atomically(archive, path);
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
namespace {
// Data parallel: each rank's shard has a file of its own next to `path`.
std::string shard_path(const std::string& path, int rank, int world) {
  return world == 1 ? path : path + ".rank" + std::to_string(rank) + "-of-" + std::to_string(world);
}
}  // namespace

void Engine::save_checkpoint(const std::string& path) const {
  TORCH_CHECK(phase_ == Phase::kIdle, "patrickstar: save_checkpoint() in the middle of an "
              "iteration; call it after step()");
  torch::serialize::OutputArchive archive;
  archive.write("format", at::tensor(kCheckpointFormat));
  archive.write("config_json", text_tensor(config_.to_json().dump()));
  std::string names;
  for (const Param& p : params_) names += p.name + "\n";
  archive.write("names", text_tensor(names));
  archive.write("world_size", at::tensor(static_cast<int64_t>(world_)));
  archive.write("rank", at::tensor(static_cast<int64_t>(rank_)));
  archive.write("chunk_elems", at::tensor(store_->chunk_elems()));
  archive.write("adam_step", at::tensor(adam_->step_count()));
  archive.write("iteration", at::tensor(iteration_));
  const LossScalerState scaler = adam_->loss_scaler().state();
  archive.write("scaler", at::tensor({scaler.scale, static_cast<double>(scaler.step),
                                      static_cast<double>(scaler.last_overflow_step),
                                      static_cast<double>(scaler.hysteresis_left)},
                                     at::kDouble));
  const ChunkKind master = mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam;
  for (const Param& p : params_) {
    if (!owns(store_->layout().placement(p.id).chunk_index)) continue;  // another rank's shard
    const std::string i = std::to_string(p.id);
    archive.write("master_" + i, store_->view(p.id, master).clone());
    archive.write("exp_avg_" + i, store_->view(p.id, ChunkKind::kMomentum).clone());
    archive.write("exp_avg_sq_" + i, store_->view(p.id, ChunkKind::kVariance).clone());
  }
  std::string error;
  try {
    save_archive_atomically(archive, shard_path(path, rank_, world_));
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Data parallel: a rank that could not write makes every rank throw (none trains on believing
  // the checkpoint complete).
  if (distributed() && !all_ranks_agree(error.empty()) && error.empty()) {
    error = "another rank could not write its shard";
  }
  TORCH_CHECK(error.empty(), "patrickstar: save_checkpoint(\"", path, "\") failed: ", error);
}

void Engine::load_checkpoint(const std::string& path_given) {
  const std::string path = shard_path(path_given, rank_, world_);
  zero_grad_if_marker_reset();
  TORCH_CHECK(phase_ == Phase::kIdle, "patrickstar: load_checkpoint() in the middle of an "
              "iteration; call it before a forward or after step()");
  TORCH_CHECK(gathered_ == 0, "patrickstar: load_checkpoint() while a GatheredParameters scope "
              "holds ", gathered_, " parameter", gathered_ == 1 ? "" : "s", "; end the scope first");
  struct Entry {
    at::Tensor master, exp_avg, exp_avg_sq;
  };
  std::vector<Entry> entries(params_.size());
  at::Tensor adam_step, iteration, scaler;
  std::string error;
  try {
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
    at::Tensor world, rank, chunk_elems;
    const int64_t saved_world = archive.try_read("world_size", world) ? world.item<int64_t>() : 1;
    const int64_t saved_rank = archive.try_read("rank", rank) ? rank.item<int64_t>() : 0;
    TORCH_CHECK(saved_world == world_ && saved_rank == rank_, "patrickstar: checkpoint \"", path,
                "\" is rank ", saved_rank, "'s shard of ", saved_world, " rank(s); this is rank ",
                rank_, " of ", world_, ": resume with the number of ranks that saved it");
    TORCH_CHECK(!archive.try_read("chunk_elems", chunk_elems) ||
                    chunk_elems.item<int64_t>() == store_->chunk_elems() || world_ == 1,
                "patrickstar: checkpoint \"", path, "\" was saved with chunks of ",
                chunk_elems.item<int64_t>(), " elements, this engine has ", store_->chunk_elems(),
                ": with several ranks the chunk size decides which rank owns what; use the config "
                "that saved it");
    for (const Param& p : params_) {
      TORCH_CHECK(names[static_cast<size_t>(p.id)] == p.name, "patrickstar: checkpoint \"", path,
                  "\" is from another model: parameter ", p.id, " is ", names[static_cast<size_t>(p.id)],
                  " there but ", p.name, " here");
      if (!owns(store_->layout().placement(p.id).chunk_index)) continue;
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
    archive.read("adam_step", adam_step);
    archive.read("iteration", iteration);
    archive.read("scaler", scaler);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Data parallel: every rank loads or none does (a rank that trained on from other weights would
  // leave the ranks apart for good).
  if (distributed() && !all_ranks_agree(error.empty()) && error.empty()) {
    error = "patrickstar: another rank could not load its shard of checkpoint \"" + path_given +
            "\"; nothing was loaded";
  }
  TORCH_CHECK(error.empty(), error);
  release_remote(/*discard=*/true);  // data parallel: gathered copies of the old weights go
  torch::NoGradGuard no_grad;
  const ChunkKind master = mixed_ ? ChunkKind::kParamFp32 : ChunkKind::kParam;
  for (const Param& p : params_) {
    if (!owns(store_->layout().placement(p.id).chunk_index)) continue;
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
