// The source that streams the host Adam's states from the disk tier's files, and ModelStorage's
// out-of-line members (here, where DiskStates is complete).
#include "disk_states.h"
#include "model_storage.h"

namespace patrickstar {
namespace engine_detail {

ModelStorage::ModelStorage() = default;
ModelStorage::~ModelStorage() = default;  // the members go in reverse order (model_storage.h)

void ModelStorage::attach_disk(std::unique_ptr<DiskStates> disk) { disk_ = std::move(disk); }

void ModelStorage::drop_chunks() {
  disk_.reset();
  store_.reset();
}

DiskAdamSource::DiskAdamSource(DiskStates& disk, ChunkStore& store, std::vector<DiskRun> runs,
                               std::function<void()> staged)
    : disk_(disk), store_(store), runs_(std::move(runs)), staged_(std::move(staged)) {
  disk_.finish_views();  // a pass of views that an error cut short leaves no index staged
}

DiskAdamSource::~DiskAdamSource() {
  try {
    disk_.drain();
  } catch (const std::exception&) {
    // Only reached while another error unwinds (finish() drains on the normal path).
  }
}

void DiskAdamSource::acquire(size_t k, AdamChunk& chunk) {
  const DiskRun& run = runs_.at(k);
  disk_.stage(run.index);  // waits for its read ahead, or reads it now
  // The next index on disk is read while this one updates.
  for (size_t j = k + 1; j < runs_.size(); ++j) {
    if (runs_[j].index == run.index || !runs_[j].from_disk) continue;
    disk_.read_ahead(runs_[j].index);
    break;
  }
  auto slice = [&](ChunkKind kind) {
    return store_.chunk_view(store_.chunk_id(kind, run.index)).narrow(0, run.begin, run.end - run.begin);
  };
  chunk.exp_avg = slice(ChunkKind::kMomentum);
  chunk.exp_avg_sq = slice(ChunkKind::kVariance);
  if (run.mixed) chunk.master = slice(ChunkKind::kParamFp32);
  if (staged_) staged_();
}

void DiskAdamSource::release(size_t k, bool updated) {
  const DiskRun& run = runs_.at(k);
  updated_ = updated_ || updated;
  // The index's later runs still need its states.
  if (k + 1 < runs_.size() && runs_[k + 1].index == run.index) return;
  disk_.unstage(run.index, /*write_back=*/updated_);
  updated_ = false;
}

void DiskAdamSource::finish() { disk_.drain(); }

}  // namespace engine_detail
}  // namespace patrickstar
