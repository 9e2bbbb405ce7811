// save_checkpoint and load_checkpoint in format 4 (checkpoint_index.h): each rank streams the
// tensors it owns into a data file of its own, rank 0 writes the index once every data file is on
// the disk, and a loader reads, of the data files, the byte ranges of the tensors it owns in its
// own layout. Format-3 files (one archive per rank) still load with the ranks that wrote them
// (engine_state_io.cpp).
#include "engine_core.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "checkpoint_file.h"
#include "checkpoint_index.h"
#include "disk_states.h"
#include "engine_internal.h"
#include "patrickstar/engine/atomic_file.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

namespace checkpoint_io {

// The columns of a save's table of tensors: one row per parameter, filled by the rank that wrote
// it, summed over the ranks.
enum Column : int64_t {
  kWriter,
  kOffset,
  kMoments,
  kMasterSum,
  kMomentumSum,
  kVarianceSum,
  kColumns
};
// The columns of the table of data files: one row per rank.
enum FileColumn : int64_t { kWrote, kFileBytes, kFileSum, kSaveId, kFileColumns };

// Removes the data files beside `path` of any earlier save (the index no longer lists them) and of
// saves killed before their index was written.
void remove_unlisted_data_files(const std::string& path, const CheckpointIndex& index) {
  const std::string folder = index_folder(path);
  DIR* dir = ::opendir(folder.empty() ? "." : folder.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> doomed;
  std::vector<std::string> temporaries;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    // A data file's temporary (<data file>.tmp-<pid>): removed when its process is gone.
    const size_t tmp = name.rfind(".tmp-");
    if (tmp != std::string::npos && is_data_file_of(name.substr(0, tmp), path)) {
      temporaries.push_back(name.substr(0, tmp));
    }
    if (!is_data_file_of(name, path)) continue;
    bool listed = false;
    for (const IndexFile& f : index.files) listed = listed || f.name == name;
    if (!listed) doomed.push_back(name);
  }
  ::closedir(dir);
  for (const std::string& name : doomed) std::remove((folder + name).c_str());
  for (const std::string& name : temporaries) remove_stale_temporaries(folder + name);
}

}  // namespace checkpoint_io
using namespace checkpoint_io;  // NOLINT: this file's helpers

void EngineCore::save_checkpoint(const std::string& path) const {
  TORCH_CHECK(tracker_.between_iterations(),
              "patrickstar: save_checkpoint() in the middle of an "
              "iteration; call it after step()");
  // Each rank's data file has a save id of its own (its clock, pid and rank), reported to rank 0
  // with the file's size and checksum: a save never overwrites a file the index in place lists,
  // and no collective comes before the first agreement.
  const auto save_id = static_cast<uint64_t>(
      (std::chrono::system_clock::now().time_since_epoch().count() ^
       (static_cast<int64_t>(::getpid()) << 40) ^ (static_cast<int64_t>(dp_.rank()) << 20)) &
      INT64_MAX);
  const std::string mine =
      index_folder(path) + data_file_name(path, save_id, dp_.rank(), dp_.world());
  const bool writes = dp_.first_replica();  // hybrid sharding: one replica writes each shard
  at::Tensor table, files;
  std::string error;
  try {
    // The states as they were before the backward, with the delayed update in flight written in.
    const StateAccess access = pipeline_->access();
    table = at::zeros({static_cast<int64_t>(params_.size()), kColumns}, at::kLong);
    files = at::zeros({dp_.world(), kFileColumns}, at::kLong);
    if (writes) write_data_file(access, mine, save_id, table, files);
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  auto fail_if = [&](const std::string& agreed) {
    if (agreed.empty()) return;
    std::remove(mine.c_str());
    TORCH_CHECK(false, "patrickstar: save_checkpoint(\"", path, "\") failed",
                dp_.with_ranks(" on "), dp_.distributed() ? agreed : ": " + agreed,
                "; the checkpoint there before, if any, is unchanged");
  };
  fail_if(dp_.first_error(error));
  if (dp_.distributed()) {
    const ScopeTimer timer = dp_.timed();
    dp_.comm().all_reduce(table, ReduceOp::kSum);
    dp_.comm().all_reduce(files, ReduceOp::kSum);
  }
  // Rank 0 writes the index: the checkpoint changes from the old one to the new one at its rename.
  std::string index_error;
  CheckpointIndex index;
  if (dp_.rank() == 0) {
    try {
      index = describe_save(path, table, files);
      save_sealed_text(checkpoint_index_text(index), path);
    } catch (const std::exception& e) {
      index_error = error_text(e);
    }
  }
  fail_if(dp_.first_error(index_error));
  if (dp_.rank() != 0) return;
  try {  // the new checkpoint is in place: what is left is tidying up
    remove_unlisted_data_files(path, index);
  } catch (const std::exception& e) {
    TORCH_WARN("patrickstar: save_checkpoint(\"", path, "\") saved the checkpoint but could not ",
               "remove earlier data files beside it (", error_text(e), ")");
  }
}

void EngineCore::write_data_file(const StateAccess& access, const std::string& file,
                                 uint64_t save_id, at::Tensor& table, at::Tensor& files) const {
  SealedFileWriter out(file);
  int64_t* rows = table.data_ptr<int64_t>();
  for (TensorId tid : tensors_in_chunk_order(store().layout())) {
    if (!owns(store().layout().placement(tid).chunk_index)) continue;
    int64_t* row = rows + tid * kColumns;
    row[kWriter] = dp_.rank() + 1;
    row[kOffset] = out.offset();
    // One tensor at a time: the host holds one copy of one tensor beyond the chunks.
    auto put = [&](const at::Tensor& t, Column column) {
      const at::Tensor c = fp32_copy(t).contiguous();
      row[column] = static_cast<int64_t>(checksum_of(c));
      out.write(c.data_ptr(), c.nbytes());
    };
    if (lean_param(tid)) {  // its weights alone (widened from the half weight in mixed precision)
      put(access.weight(tid), kMasterSum);
      continue;
    }
    // bf16 states are written widened to fp32 (exact).
    row[kMoments] = 1;
    put(access.state(tid, master_kind()), kMasterSum);
    put(access.state(tid, ChunkKind::kMomentum), kMomentumSum);
    put(access.state(tid, ChunkKind::kVariance), kVarianceSum);
  }
  access.finish_views();
  const int64_t bytes = out.offset();
  const uint64_t sum = out.commit();
  int64_t* mine = files.data_ptr<int64_t>() + kFileColumns * dp_.rank();
  mine[kWrote] = 1;
  mine[kFileBytes] = bytes;
  mine[kFileSum] = static_cast<int64_t>(sum);
  mine[kSaveId] = static_cast<int64_t>(save_id);
}

CheckpointIndex EngineCore::describe_save(const std::string& path, const at::Tensor& table,
                                          const at::Tensor& files) const {
  CheckpointIndex index;
  index.config_json = config_.to_json().dump();
  index.precision = std::string(to_string(config_.precision()));
  index.world_size = dp_.world();
  index.shard_group_size = dp_.shard_size();
  index.chunk_elems = store().chunk_elems();
  index.iteration = tracker_.iteration();
  index.retraces = tracker_.retraces();
  index.adam_step = pipeline_->adam().step_count();
  index.scaler = pipeline_->adam().loss_scaler().state();
  std::vector<int64_t> file_of(static_cast<size_t>(dp_.world()), -1);
  const int64_t* columns = files.data_ptr<int64_t>();
  for (int r = 0; r < dp_.world(); ++r) {
    const int64_t* f = columns + kFileColumns * r;
    if (f[kWrote] == 0) continue;
    file_of[static_cast<size_t>(r)] = static_cast<int64_t>(index.files.size());
    index.files.push_back(
        IndexFile{data_file_name(path, static_cast<uint64_t>(f[kSaveId]), r, dp_.world()),
                  f[kFileBytes], static_cast<uint64_t>(f[kFileSum])});
  }
  const int64_t* rows = table.data_ptr<int64_t>();
  for (const Param& p : params_) {
    const int64_t* row = rows + p.id * kColumns;
    // Exactly one rank wrote each tensor (the sum over ranks of writer + 1 is then in range).
    TORCH_CHECK(row[kWriter] > 0 && row[kWriter] <= dp_.world() &&
                    file_of[static_cast<size_t>(row[kWriter] - 1)] >= 0,
                "patrickstar: internal: parameter ", p.name,
                " was not written by exactly one rank");
    IndexTensor t;
    t.name = p.name;
    t.shape = store().layout().sizes(p.id).vec();
    t.numel = store().layout().placement(p.id).numel;
    t.trainable = p.tensor.requires_grad();
    t.adam_steps = p.adam_steps;
    describe_group_options(t, p.id);
    t.chunk = store().layout().placement(p.id).chunk_index;
    t.file = file_of[static_cast<size_t>(row[kWriter] - 1)];
    t.master = IndexRange{row[kOffset], static_cast<uint64_t>(row[kMasterSum])};
    if (row[kMoments] != 0) {
      t.exp_avg = IndexRange{row[kOffset] + t.bytes(), static_cast<uint64_t>(row[kMomentumSum])};
      t.exp_avg_sq =
          IndexRange{row[kOffset] + 2 * t.bytes(), static_cast<uint64_t>(row[kVarianceSum])};
    }
    index.tensors.push_back(std::move(t));
  }
  return index;
}

void EngineCore::load_checkpoint(const std::string& path) {
  // The states as they were before the backward, with the delayed update in flight written in.
  const StateAccess access = pipeline_->access();
  zero_grad_if_marker_reset();
  TORCH_CHECK(tracker_.between_iterations(),
              "patrickstar: load_checkpoint() in the middle of an "
              "iteration; call it before a forward or after step()");
  const int64_t held = params_.gathered();
  TORCH_CHECK(held == 0,
              "patrickstar: load_checkpoint() while a GatheredParameters scope "
              "holds ",
              held, " parameter", held == 1 ? "" : "s", "; end the scope first");
  if (!is_checkpoint_index(path)) {
    load_checkpoint_format3(access, path);
    return;
  }
  // Read and check everything this rank will load first: a damaged checkpoint, or one of another
  // model, changes nothing on any rank.
  CheckpointIndex index;
  std::vector<const IndexTensor*> entries(params_.size(), nullptr);
  at::Tensor buffer;  // the largest tensor this rank loads: the copying pass allocates nothing
  // Opened by the checking pass, kept for the copying one: a data file removed in between (another
  // save to this path) stays readable.
  std::unique_ptr<DataFileReader> reader;
  std::vector<AdamHyperparameters> group_options;  // each param group's, as restored
  std::string error;
  try {
    index = read_checkpoint_index(path);
    match_checkpoint(path, index, entries);
    group_options = checkpoint_group_options(path, entries);
    int64_t largest = 1;
    for (const Param& p : params_) {
      if (owns(store().layout().placement(p.id).chunk_index)) {
        largest = std::max(largest, entries[static_cast<size_t>(p.id)]->numel);
      }
    }
    buffer = at::empty({largest}, at::kFloat);
    reader = std::make_unique<DataFileReader>(path, index);
    for (const Param& p : params_) {
      if (!owns(store().layout().placement(p.id).chunk_index)) continue;
      const IndexTensor& t = *entries[static_cast<size_t>(p.id)];
      reader->read(t, t.master, buffer);
      if (lean_param(p.id) || !t.exp_avg.present()) continue;
      reader->read(t, t.exp_avg, buffer);
      reader->read(t, t.exp_avg_sq, buffer);
    }
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  const std::string agreed = dp_.first_error(error);
  TORCH_CHECK(agreed.empty(), dp_.distributed()
                                  ? "patrickstar: load_checkpoint(\"" + path + "\") failed on " +
                                        agreed + "; nothing was loaded on any rank"
                                  : agreed);
  dp_.release_remote(/*discard=*/true);  // data parallel: gathered copies of the old weights go
  apply_checkpoint(access, path, *reader, entries, buffer);
  pipeline_->adam().set_step_count(index.adam_step);
  for (const Param& p : params_) {
    params_.set_adam_steps(p.id, entries[static_cast<size_t>(p.id)]->adam_steps);
  }
  pipeline_->adam().loss_scaler().load_state(index.scaler);
  pipeline_->set_group_options(checked_group_options(group_options));
  groups_.note_options(group_options);
  if (gradients_.space()) zero_grad();
}

void EngineCore::match_checkpoint(const std::string& path, const CheckpointIndex& index,
                                  std::vector<const IndexTensor*>& entries) const {
  std::map<std::string, const IndexTensor*> by_name;
  for (const IndexTensor& t : index.tensors) by_name.emplace(t.name, &t);
  TORCH_CHECK(index.tensors.size() == params_.size(), "patrickstar: checkpoint \"", path,
              "\" is from another model: it has ", index.tensors.size(), " parameters, this model ",
              params_.size(), "; nothing was loaded");
  const std::string here(to_string(config_.precision()));
  TORCH_CHECK(index.precision == here, "patrickstar: checkpoint \"", path, "\" was saved by a ",
              index.precision, " engine and this engine is ", here,
              ": resume with the precision "
              "that saved it (save_weights writes fp32 weights that any engine's model can start "
              "from); nothing was loaded");
  for (const Param& p : params_) {
    auto it = by_name.find(p.name);
    TORCH_CHECK(it != by_name.end(), "patrickstar: checkpoint \"", path,
                "\" is from another "
                "model: it has no parameter ",
                p.name, "; nothing was loaded");
    TORCH_CHECK(c10::IntArrayRef(it->second->shape) == store().layout().sizes(p.id),
                "patrickstar: checkpoint \"", path, "\" is from another model: parameter ", p.name,
                " has shape ", c10::IntArrayRef(it->second->shape), " there but ",
                store().layout().sizes(p.id), " here; nothing was loaded");
    entries[static_cast<size_t>(p.id)] = it->second;
  }
  // The disk tier's files are read while the states are written: all there, or nothing loads.
  if (storage_.disk() != nullptr) storage_.disk()->check_files();
  try {
    pipeline_->adam().loss_scaler().check_state(index.scaler);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "patrickstar: checkpoint \"", path,
                "\" does not suit this engine's loss "
                "scaler (",
                e.what_without_backtrace(), "); nothing was loaded");
  }
}

void EngineCore::apply_checkpoint(const StateAccess& access, const std::string& path,
                                  DataFileReader& reader,
                                  const std::vector<const IndexTensor*>& entries,
                                  const at::Tensor& buffer) {
  torch::NoGradGuard no_grad;
  const ChunkKind master = master_kind();
  std::string error;
  try {
    for (TensorId id : tensors_in_chunk_order(store().layout())) {
      if (!owns(store().layout().placement(id).chunk_index)) continue;
      const IndexTensor& t = *entries[static_cast<size_t>(id)];
      // One tensor at a time, through the one buffer.
      if (lean_param(id)) {  // its weights alone; saved moments (if any) have nowhere to go
        store().view(id, ChunkKind::kParam).copy_(reader.read(t, t.master, buffer));
        continue;
      }
      const at::Tensor weights = reader.read(t, t.master, buffer);
      access.state(id, master, /*write=*/true).copy_(weights);
      if (mixed()) store().view(id, ChunkKind::kParam).copy_(weights);
      // Saved lean (frozen, without moments): it starts from none, as it would have trained.
      for (auto [kind, range] : {std::pair{ChunkKind::kMomentum, &t.exp_avg},
                                 std::pair{ChunkKind::kVariance, &t.exp_avg_sq}}) {
        at::Tensor view = access.state(id, kind, /*write=*/true);
        if (range->present()) {
          view.copy_(reader.read(t, *range, buffer));  // bf16 states: rounded to nearest even
        } else {
          view.zero_();
        }
      }
    }
    access.finish_views();
  } catch (const std::exception& e) {
    // Every range was read and checked a moment ago: the files changed since (or the disk tier
    // failed).
    error = error_text(e);
    try {
      access.finish_views();
    } catch (const std::exception&) {  // the first error is the one to report
    }
  }
  const std::string agreed = dp_.first_error(error);
  TORCH_CHECK(agreed.empty(), "patrickstar: load_checkpoint(\"", path, "\") failed while copying",
              dp_.with_ranks(" on "), dp_.distributed() ? agreed : ": " + agreed,
              "; the engine's state is partly loaded", dp_.with_ranks(" on every rank"),
              ": load a checkpoint again before training on");
}

}  // namespace patrickstar
