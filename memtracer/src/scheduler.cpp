#include "patrickstar/memtracer/scheduler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include <c10/util/Exception.h>

#include "patrickstar/chunk/copy_queue.h"

namespace patrickstar {
namespace {

constexpr int64_t kNever = NextUseIndex::kNever;  // what next_use() says of a chunk not needed again

// During the warm-up the chunk budget keeps, next to the moment's own chunks, this many of the
// chunks used most recently before it, where they fit.
constexpr size_t kWarmupRecentChunks = 3;

int64_t scaled_bytes(int64_t bytes, double ratio) {
  return static_cast<int64_t>(std::floor(static_cast<double>(bytes) * ratio));
}

}  // namespace

Scheduler::Scheduler(SchedulerOptions options, std::map<int64_t, ChunkInfo> chunks)
    : options_(options), chunks_(std::move(chunks)) {
  TORCH_CHECK(options_.capacity_bytes > 0, "Scheduler: capacity_bytes must be positive, got ",
              options_.capacity_bytes);
  TORCH_CHECK(options_.overall_ratio > 0.0 && options_.overall_ratio <= 1.0,
              "Scheduler: overall_ratio must be in (0, 1], got ", options_.overall_ratio);
  TORCH_CHECK(options_.warmup_ratio > 0.0 && options_.warmup_ratio <= 1.0,
              "Scheduler: warmup_ratio must be in (0, 1], got ", options_.warmup_ratio);
  TORCH_CHECK(options_.reserve_bytes >= 0, "Scheduler: reserve_bytes must be >= 0, got ",
              options_.reserve_bytes);
  TORCH_CHECK(options_.prefetch_depth >= 0, "Scheduler: prefetch_depth must be >= 0, got ",
              options_.prefetch_depth);
  for (const auto& [id, chunk] : chunks_) {
    TORCH_CHECK(chunk.bytes > 0, "Scheduler: chunk ", id, " has ", chunk.bytes,
                " bytes; chunk sizes must be positive");
  }
  now_us_ = microseconds_since_now();
}

void Scheduler::replace_chunks(std::map<int64_t, ChunkInfo> chunks) {
  TORCH_CHECK(!in_iteration_, "Scheduler::replace_chunks inside an iteration");
  for (const auto& [id, chunk] : chunks) {
    TORCH_CHECK(chunk.bytes > 0, "Scheduler: chunk ", id, " has ", chunk.bytes,
                " bytes; chunk sizes must be positive");
  }
  chunks_ = std::move(chunks);
  trace_ = Trace{};
  has_trace_ = false;
  index_ = NextUseIndex();
  resident_.clear();
  resident_bytes_ = 0;
  last_access_.clear();
  prefetched_.clear();
  warmup_floor_bytes_ = 0;
  warmup_window_bytes_ = 0;
  warmup_non_model_bytes_ = 0;
  warmup_previous_non_model_bytes_ = -1;
  warmup_growth_bytes_ = 0;
  last_moment_ = 0;
}

void Scheduler::set_chunk(int64_t chunk_id, ChunkInfo info) {
  TORCH_CHECK(info.bytes > 0, "Scheduler::set_chunk: chunk ", chunk_id, " has ", info.bytes,
              " bytes; chunk sizes must be positive");
  TORCH_CHECK(resident_.count(chunk_id) == 0 || chunks_.at(chunk_id).bytes == info.bytes,
              "Scheduler::set_chunk: chunk ", chunk_id,
              " is on the device; its size cannot change there");
  chunks_[chunk_id] = info;
}

void Scheduler::set_clock(std::function<int64_t()> now_us) {
  TORCH_CHECK(now_us, "Scheduler::set_clock: empty clock");
  now_us_ = std::move(now_us);
}

void Scheduler::clear_timeline() {
  moves_.clear();
  moment_records_.clear();
}

const ChunkInfo& Scheduler::info(int64_t chunk_id) const {
  auto it = chunks_.find(chunk_id);
  TORCH_CHECK(it != chunks_.end(), "Scheduler: chunk ", chunk_id,
              " is unknown (register it with the chunk table or set_chunk)");
  return it->second;
}

std::string Scheduler::describe_moment(int64_t m) const {
  std::ostringstream out;
  out << "moment " << m;
  if (has_trace_ && m >= 0 && m < trace_.size()) {
    out << " (" << moment_kind_name(trace_.moments[m].kind) << " '" << trace_.moments[m].label
        << "')";
  }
  if (iteration_ >= 0) {
    out << " of iteration " << iteration_;
  }
  return out.str();
}

int64_t Scheduler::budget_bytes(int64_t m) const {
  const int64_t usable = scaled_bytes(options_.capacity_bytes, options_.overall_ratio);
  if (!has_trace_) {
    // The warm-up ratio is a floor, not a wall: a moment whose chunks alone need more gets what
    // the device has left next to the live non-model bytes. The chunks of the last few moments
    // may stay too, in what is left once the largest growth of the non-model bytes from one
    // moment to the next seen so far is set aside.
    // kStatic keeps its chunks wherever they land, so it has no use for a conservative share.
    const int64_t cap = usable - warmup_non_model_bytes_;
    const int64_t window = std::min(warmup_window_bytes_, cap - warmup_growth_bytes_);
    const int64_t share =
        options_.policy == EvictionPolicy::kStatic
            ? usable
            : std::max({scaled_bytes(usable, options_.warmup_ratio), warmup_floor_bytes_, window});
    return std::min(share, cap) - options_.reserve_bytes;
  }
  TORCH_CHECK(m >= 0 && m < trace_.size(), "Scheduler::budget_bytes: moment ", m,
              " is outside the trace of ", trace_.size(), " moments");
  const int64_t non_model =
      std::max(trace_.moments[m].non_model_bytes, trace_.next_non_model_bytes(m));
  return usable - non_model - options_.reserve_bytes;
}

void Scheduler::set_trace(const Trace& trace, ChunkMover* mover) {
  TORCH_CHECK(mover == nullptr || in_iteration_,
              "Scheduler::set_trace with a mover moves chunks: call it before the warm-up's "
              "end_iteration() so the moves count in that iteration");
  // Validate before changing anything: a rejected trace leaves the scheduler as it was.
  check_trace(trace);
  install_trace(trace, mover);
}

void Scheduler::drop_trace() {
  trace_ = Trace{};
  has_trace_ = false;
  index_ = NextUseIndex();
  prefetched_.clear();
  warmup_previous_non_model_bytes_ = -1;
  if (in_iteration_) stats_.warmup = true;
}

void Scheduler::check_trace(const Trace& trace) const {
  TORCH_CHECK(trace.size() > 0, "Scheduler::set_trace: the trace has no moment");
  const int64_t usable = scaled_bytes(options_.capacity_bytes, options_.overall_ratio);
  // Non-model bytes alone: name the moment whose interval measured them.
  auto check_non_model = [&](int64_t non_model, const std::string& where) {
    TORCH_CHECK(non_model + options_.reserve_bytes <= usable, where,
                " activations and temporaries (non-model data) need ", non_model,
                " bytes but the device offers ", usable, " bytes (capacity ",
                options_.capacity_bytes, " x overall_ratio ", options_.overall_ratio,
                ") with a reserve of ", options_.reserve_bytes,
                ": use a smaller batch or activation checkpointing");
  };
  for (int64_t m = 0; m < trace.size(); ++m) {
    const Moment& moment = trace.moments[m];
    check_non_model(moment.non_model_bytes, "up to moment " + std::to_string(m) + " (" +
                                                moment_kind_name(moment.kind) + " '" +
                                                moment.label + "')");
  }
  check_non_model(trace.tail_non_model_bytes, "after the last moment of the iteration");
  int64_t device_only = 0;  // on the device at every moment
  for (const auto& [id, chunk] : chunks_) {
    if (chunk.device_only) device_only += chunk.bytes;
  }
  for (int64_t m = 0; m < trace.size(); ++m) {
    const Moment& moment = trace.moments[m];
    const int64_t non_model = std::max(moment.non_model_bytes, trace.next_non_model_bytes(m));
    const int64_t budget = usable - non_model - options_.reserve_bytes;
    int64_t needed = 0;
    int64_t fixed = device_only;  // the device-only chunks the moment does not access
    for (int64_t id : std::set<int64_t>(moment.chunk_ids.begin(), moment.chunk_ids.end())) {
      needed += info(id).bytes;
      if (info(id).device_only) fixed -= info(id).bytes;
    }
    for (int64_t id : moment.host_chunk_ids) {
      info(id);
      TORCH_CHECK(std::find(moment.chunk_ids.begin(), moment.chunk_ids.end(), id) ==
                      moment.chunk_ids.end(),
                  "Scheduler::set_trace: moment ", m, " both accesses chunk ", id,
                  " and sends it to the host");
    }
    TORCH_CHECK(needed + fixed <= budget, "at moment ", m, " (", moment_kind_name(moment.kind),
                " '", moment.label, "') the ", moment.chunk_ids.size(), " chunks accessed need ",
                needed, " bytes",
                fixed > 0 ? " next to " + std::to_string(fixed) +
                                " bytes of chunks that never leave the device (optimizer states "
                                "placed there because the host budget could not hold them)"
                          : std::string(),
                " but the chunk budget is ", budget, " bytes (capacity ",
                options_.capacity_bytes, ", non-model ", non_model, ", reserve ",
                options_.reserve_bytes,
                "): use a smaller chunk size, a smaller batch or activation checkpointing");
  }
}

void Scheduler::install_trace(const Trace& trace, ChunkMover* mover) {
  trace_ = trace;
  has_trace_ = true;
  index_ = NextUseIndex(trace_);

  if (mover == nullptr || options_.policy == EvictionPolicy::kStatic) {
    return;
  }
  // Warm start: bring back chunks in order of first use while they fit every moment's budget, so a
  // device that holds everything has no traffic after the warm-up.
  refresh_residency(*mover);
  int64_t smallest_budget = std::numeric_limits<int64_t>::max();
  for (int64_t m = 0; m < trace_.size(); ++m) {
    smallest_budget = std::min(smallest_budget, budget_bytes(m));
  }
  const int64_t last = trace_.size() - 1;
  for (int64_t m = 0; m < trace_.size(); ++m) {
    for (int64_t id : trace_.moments[m].chunk_ids) {
      if (resident_.count(id) == 0 && resident_bytes_ + info(id).bytes <= smallest_budget) {
        load(id, last, /*prefetch=*/true, *mover);
        stats_.warm_start_h2d_bytes += info(id).bytes;
      }
    }
  }
}

std::string Scheduler::warmup_advice(int64_t chunk_bytes) const {
  // The warm-up budget is min(max(share, the moment's chunks), usable - live non-model): say which
  // setting would make room for `chunk_bytes`.
  const int64_t usable = scaled_bytes(options_.capacity_bytes, options_.overall_ratio);
  std::ostringstream out;
  out << "; warm-up: client.mem_tracer.warmup_gpu_chunk_mem_ratio " << options_.warmup_ratio
      << " gives chunks " << scaled_bytes(usable, options_.warmup_ratio) << " of " << usable
      << " usable bytes, and non-model data holds " << warmup_non_model_bytes_ << " now";
  const int64_t room = usable - warmup_non_model_bytes_ - options_.reserve_bytes;
  if (chunk_bytes <= room && usable > 0) {
    // The smallest ratio (rounded up to a hundredth) that gives the chunks this much.
    const double ratio = std::min(
        1.0, std::ceil(100.0 * static_cast<double>(chunk_bytes + options_.reserve_bytes) /
                       static_cast<double>(usable)) /
                 100.0);
    out << "; set client.mem_tracer.warmup_gpu_chunk_mem_ratio to " << ratio << " or more";
  } else {
    out << "; the device is too small for these chunks next to the non-model data (raise "
           "client.device.capacity_bytes or client.mem_tracer.overall_gpu_mem_ratio)";
  }
  return out.str();
}

void Scheduler::begin_iteration() {
  TORCH_CHECK(!in_iteration_, "Scheduler::begin_iteration: iteration ", iteration_,
              " has not ended");
  ++iteration_;
  in_iteration_ = true;
  stats_ = IterationStats{};
  stats_.iteration = iteration_;
  stats_.warmup = !has_trace_;
}

void Scheduler::end_iteration() {
  TORCH_CHECK(in_iteration_, "Scheduler::end_iteration without begin_iteration");
  in_iteration_ = false;
  history_.push_back(stats_);
  if (history_.size() > kHistoryKept) history_.erase(history_.begin());
}

void Scheduler::abort_iteration() {
  if (!in_iteration_) return;
  in_iteration_ = false;
  --iteration_;
  stats_ = IterationStats{};
}

void Scheduler::refresh_residency(ChunkMover& mover) {
  resident_.clear();
  resident_bytes_ = 0;
  for (const auto& [id, chunk] : chunks_) {
    if (mover.on_device(id)) {
      resident_.insert(id);
      resident_bytes_ += chunk.bytes;
    }
  }
  for (auto it = prefetched_.begin(); it != prefetched_.end();) {
    it = resident_.count(*it) != 0 ? std::next(it) : prefetched_.erase(it);
  }
}

int64_t Scheduler::next_use(int64_t chunk_id, int64_t m) const {
  return index_.next_use(chunk_id, m);
}

void Scheduler::load(int64_t chunk_id, int64_t m, bool prefetch, ChunkMover& mover) {
  const int64_t bytes = info(chunk_id).bytes;
  const int64_t start = now_us_();
  mover.to_device(chunk_id);
  const int64_t end = now_us_();
  resident_.insert(chunk_id);
  resident_bytes_ += bytes;
  stats_.h2d_bytes += bytes;
  stats_.loads += 1;
  if (prefetch) {
    stats_.prefetches += 1;
    prefetched_.insert(chunk_id);
  }
  stats_.peak_chunk_bytes = std::max(stats_.peak_chunk_bytes, resident_bytes_);
  if (record_timeline_) {
    moves_.push_back(MoveEvent{iteration_, m, chunk_id, bytes, true, prefetch, start, end - start});
  }
}

void Scheduler::evict(int64_t chunk_id, int64_t m, ChunkMover& mover) {
  const int64_t bytes = info(chunk_id).bytes;
  const int64_t start = now_us_();
  mover.to_host(chunk_id);
  const int64_t end = now_us_();
  resident_.erase(chunk_id);
  resident_bytes_ -= bytes;
  prefetched_.erase(chunk_id);
  stats_.d2h_bytes += bytes;
  stats_.evictions += 1;
  if (record_timeline_) {
    moves_.push_back(MoveEvent{iteration_, m, chunk_id, bytes, false, false, start, end - start});
  }
}

struct Scheduler::Candidate {
  int64_t chunk_id;
  int64_t rank;  // larger is evicted first
  int64_t bytes;
  bool operator<(const Candidate& other) const {  // "evicted before other"
    if (rank != other.rank) return rank > other.rank;
    if (bytes != other.bytes) return bytes > other.bytes;
    return chunk_id > other.chunk_id;
  }
};

bool Scheduler::evict_to_fit(int64_t bytes_to_add, int64_t budget, int64_t m,
                             const std::set<int64_t>& pinned, int64_t prefetch_next_use,
                             ChunkMover& mover) {
  if (resident_bytes_ + bytes_to_add <= budget) {
    return true;
  }
  const bool belady = has_trace_ && options_.policy == EvictionPolicy::kOpt;
  std::vector<Candidate> candidates;
  int64_t freeable = 0;
  for (int64_t id : resident_) {
    if (pinned.count(id) != 0) continue;
    const ChunkInfo& chunk = info(id);
    if (options_.policy == EvictionPolicy::kStatic && chunk.static_on_device) continue;
    if (chunk.device_only) continue;
    int64_t rank;
    if (belady) {
      rank = next_use(id, m);
      if (rank <= prefetch_next_use) continue;  // a prefetch never evicts a chunk needed sooner
    } else {
      auto it = last_access_.find(id);
      rank = -(it == last_access_.end() ? -1 : it->second);  // least recent: largest rank
    }
    if (!mover.movable(id)) continue;
    candidates.push_back(Candidate{id, rank, chunk.bytes});
    freeable += chunk.bytes;
  }
  if (resident_bytes_ - freeable + bytes_to_add > budget) {
    return false;  // nothing is evicted when it would not be enough
  }
  std::sort(candidates.begin(), candidates.end());
  for (const Candidate& victim : candidates) {
    if (resident_bytes_ + bytes_to_add <= budget) break;
    evict(victim.chunk_id, m, mover);
  }
  return true;
}

bool Scheduler::make_room(int64_t bytes, ChunkMover& mover) {
  refresh_residency(mover);
  if (bytes <= 0) return true;
  return evict_to_fit(0, resident_bytes_ - bytes, last_moment_, {}, -1, mover);
}

void Scheduler::measure_warmup_moment(const std::vector<int64_t>& accessed) {
  if (warmup_previous_non_model_bytes_ >= 0) {
    warmup_growth_bytes_ =
        std::max(warmup_growth_bytes_, warmup_non_model_bytes_ - warmup_previous_non_model_bytes_);
  }
  warmup_previous_non_model_bytes_ = warmup_non_model_bytes_;
  const std::set<int64_t> distinct(accessed.begin(), accessed.end());
  for (int64_t id : distinct) warmup_floor_bytes_ += info(id).bytes;
  // Chunks that never leave the device stay next to the moment's own.
  for (int64_t id : resident_) {
    if (info(id).device_only && distinct.count(id) == 0) warmup_floor_bytes_ += info(id).bytes;
  }
  warmup_floor_bytes_ += options_.reserve_bytes;
  // The working set of the last few chunks used, not of this moment alone: a GPT block straddles
  // two chunks and neighbouring moments alternate between them (and a chunk of small shared
  // parameters), so keeping one moment's chunks sends chunks back and forth at every moment
  // (megatron_1.3B on a 2 GiB device: the warm-up's own loads were 11x a steady iteration's).
  // Recency rather than a window of moments: with one moment per submodule, a block's moments
  // can go several in a row without touching a chunk it comes back to.
  std::vector<std::pair<int64_t, int64_t>> recent;  // (last access, chunk), other chunks
  for (const auto& [id, clock] : last_access_) {
    if (distinct.count(id) == 0) recent.emplace_back(clock, id);
  }
  const size_t keep = std::min(recent.size(), kWarmupRecentChunks);
  std::partial_sort(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(keep),
                    recent.end(), std::greater<>());
  warmup_window_bytes_ = warmup_floor_bytes_ - options_.reserve_bytes;
  for (size_t i = 0; i < keep; ++i) warmup_window_bytes_ += info(recent[i].second).bytes;
  warmup_window_bytes_ += options_.reserve_bytes;
}

int64_t Scheduler::load_accessed(int64_t m, const std::vector<int64_t>& accessed,
                                 const std::set<int64_t>& pinned, int64_t budget,
                                 ChunkMover& mover) {
  int64_t needed = 0;
  int64_t missing = 0;
  for (int64_t id : pinned) {
    const int64_t bytes = info(id).bytes;
    needed += bytes;
    if (resident_.count(id) == 0) missing += bytes;
  }
  // "auto" chunk size: the warm-up goes on past the budget where the device itself has room,
  // and measures every moment for the choice of a size that fits (SchedulerOptions).
  const bool may_overdraw = !has_trace_ && options_.warmup_overdraft;
  const int64_t room = options_.capacity_bytes - warmup_non_model_bytes_ - options_.reserve_bytes;
  auto overdraw = [&] {
    if (!may_overdraw || budget >= room) return false;
    stats_.overdrafts += 1;
    budget = room;
    stats_.budget_bytes.back() = budget;
    return true;
  };
  if (needed > budget && needed <= room) overdraw();
  TORCH_CHECK(needed <= budget, describe_moment(m), " accesses ", pinned.size(), " chunks of ",
              needed, " bytes in all but the chunk budget is ", budget, " bytes (capacity ",
              options_.capacity_bytes, ", reserve ", options_.reserve_bytes,
              has_trace_ ? "" : warmup_advice(needed),
              "): use a smaller chunk size, a smaller batch or activation checkpointing");
  bool fits = evict_to_fit(missing, budget, m, pinned, -1, mover);
  if (!fits && overdraw()) fits = evict_to_fit(missing, budget, m, pinned, -1, mover);
  TORCH_CHECK(fits, describe_moment(m), " needs ", missing, " more chunk bytes on the device with ",
              resident_bytes_, " resident and a budget of ", budget,
              " bytes, but not enough resident chunks may move (in COMPUTE, kept on the "
              "device by the static policy, or optimizer states that never leave it)",
              has_trace_ ? std::string() : warmup_advice(resident_bytes_ + missing));
  for (int64_t id : accessed) {
    if (resident_.count(id) == 0) load(id, m, /*prefetch=*/false, mover);
  }
  return budget;
}

void Scheduler::at_moment(int64_t m, MomentKind kind, const std::vector<int64_t>& accessed,
                          ChunkMover& mover, int64_t live_non_model_bytes,
                          const std::vector<int64_t>& to_host) {
  TORCH_CHECK(in_iteration_, "Scheduler::at_moment(", m,
              ") outside an iteration (call begin_iteration first)");
  TORCH_CHECK(!has_trace_ || (m >= 0 && m < trace_.size()), "Scheduler::at_moment: moment ", m,
              " is outside the warm-up trace of ", trace_.size(),
              " moments: the model's control flow changed; record a new trace");
  refresh_residency(mover);
  last_moment_ = m;
  warmup_non_model_bytes_ = has_trace_ ? 0 : std::max<int64_t>(live_non_model_bytes, 0);
  warmup_floor_bytes_ = 0;
  warmup_window_bytes_ = 0;
  if (!has_trace_) measure_warmup_moment(accessed);
  int64_t budget = budget_bytes(m);
  std::set<int64_t> pinned(accessed.begin(), accessed.end());
  stats_.budget_bytes.push_back(budget);
  for (int64_t id : accessed) {
    last_access_[id] = ++access_clock_;
    if (prefetched_.erase(id) != 0) stats_.prefetches_used += 1;
  }

  for (int64_t id : to_host) {
    TORCH_CHECK(pinned.count(id) == 0, describe_moment(m), " both accesses chunk ", id,
                " and sends it to the host");
    TORCH_CHECK(!info(id).device_only, describe_moment(m), " sends chunk ", id,
                " to the host but it never leaves the device");
    if (resident_.count(id) == 0) continue;
    TORCH_CHECK(mover.movable(id), describe_moment(m), " must send chunk ", id,
                " to the host but a tensor in it is in use (COMPUTE)");
    evict(id, m, mover);
  }
  if (options_.policy == EvictionPolicy::kStatic && kind == MomentKind::kStep) {
    // ZeRO-Offload style: the step runs on the host, so its chunks go there.
    for (int64_t id : accessed) {
      if (resident_.count(id) != 0) evict(id, m, mover);
    }
    TORCH_CHECK(evict_to_fit(0, budget, m, pinned, -1, mover), describe_moment(m), " has ",
                resident_bytes_, " chunk bytes on the device above the budget of ", budget,
                " bytes and the static policy may not move them: the chunks marked "
                "static_on_device do not fit; use a smaller batch or another policy");
  } else {
    budget = load_accessed(m, accessed, pinned, budget, mover);
  }
  if (has_trace_ && options_.policy != EvictionPolicy::kStatic && options_.prefetch_depth > 0 &&
      !options_.prefetch_after_compute) {
    prefetch_after(m, pinned, mover);
  }
  TORCH_INTERNAL_ASSERT(resident_bytes_ <= budget, "scheduler exceeded its budget at ",
                        describe_moment(m), ": ", resident_bytes_, " > ", budget);

  const int64_t non_model =
      has_trace_ ? std::max(trace_.moments[m].non_model_bytes, trace_.next_non_model_bytes(m)) : -1;
  stats_.peak_chunk_bytes = std::max(stats_.peak_chunk_bytes, resident_bytes_);
  if (non_model >= 0) {
    stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, resident_bytes_ + non_model);
  }
  if (record_timeline_) {
    moment_records_.push_back(MomentRecord{iteration_, m, kind,
                                           has_trace_ ? trace_.moments[m].label : std::string(),
                                           now_us_(), resident_bytes_, non_model, budget});
  }
}

void Scheduler::after_moment(int64_t m, ChunkMover& mover) {
  TORCH_CHECK(in_iteration_, "Scheduler::after_moment(", m,
              ") outside an iteration (call begin_iteration first)");
  if (!has_trace_ || options_.policy == EvictionPolicy::kStatic) return;
  TORCH_CHECK(m >= 0 && m < trace_.size(), "Scheduler::after_moment: moment ", m,
              " is outside the warm-up trace of ", trace_.size(), " moments");
  refresh_residency(mover);
  // Both moves below are optional: memory a tier refuses (an allocator with less room than the
  // budget says, a fragmented heap) ends them for this moment, and the chunks move at their use,
  // where a refusal is an error. After the step's moment this matters: Adam has updated the
  // weights, so an error here would report a step that was taken as not taken.
  try {
    if (options_.prefetch_depth > 0) prefetch_after(m, {}, mover);
    // Early offload: chunks whose device copy has no more use before the host needs them.
    const std::vector<int64_t> resident(resident_.begin(), resident_.end());
    for (int64_t id : resident) {
      if (index_.host_before_use(id, m) && !info(id).device_only && mover.movable(id)) {
        evict(id, m, mover);
      }
    }
  } catch (const c10::OutOfMemoryError&) {
    stats_.optional_moves_refused += 1;
  }
  const int64_t budget = budget_bytes(m);
  TORCH_INTERNAL_ASSERT(resident_bytes_ <= budget, "scheduler exceeded its budget after ",
                        describe_moment(m), ": ", resident_bytes_, " > ", budget);
  const int64_t non_model =
      std::max(trace_.moments[m].non_model_bytes, trace_.next_non_model_bytes(m));
  stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, resident_bytes_ + non_model);
  if (record_timeline_ && !moment_records_.empty() && moment_records_.back().moment == m) {
    moment_records_.back().chunk_bytes =
        std::max(moment_records_.back().chunk_bytes, resident_bytes_);
  }
}

void Scheduler::prefetch_after(int64_t m, const std::set<int64_t>& pinned, ChunkMover& mover) {
  const int64_t moments = trace_.size();
  // Next use after absolute moment a (a >= moments is in the next iteration), in the frame of this
  // iteration's positions.
  auto next_use_after = [&](int64_t id, int64_t a) {
    const int64_t use = next_use(id, a % moments);
    return a >= moments && use != kNever ? use + index_.accesses_per_iteration() : use;
  };
  int64_t window_budget = budget_bytes(m);
  // A prefetch for moment t evicts now what Belady would evict at t. Chunks accessed at m .. t-1
  // stay on the device until then, and at t Belady could pick one of them instead (its next use
  // after t-1 is far): so a prefetch may only evict chunks used later than all of those; otherwise
  // the chunk waits for its demand load. `window_next_use` is that threshold.
  int64_t window_next_use = -1;
  for (int64_t d = 1; d <= options_.prefetch_depth && d < moments; ++d) {
    const int64_t t = (m + d) % moments;
    // The chunk stays resident through the intervals after moments m .. m+d-1.
    window_budget = std::min(window_budget, budget_bytes((m + d - 1) % moments));
    // Evicting to fit a smaller budget before t than at t would evict chunks the demand load at t
    // keeps: a prefetch evicts only when t's budget is the tightest of the window.
    const bool may_evict = budget_bytes(t) <= window_budget;
    std::set<int64_t> protect = pinned;
    for (int64_t id : trace_.moments[t].chunk_ids) protect.insert(id);
    window_next_use = -1;
    for (int64_t a = pinned.empty() ? m + 1 : m; a < m + d; ++a) {
      for (int64_t id : trace_.moments[a % moments].chunk_ids) {
        if (protect.count(id) != 0 && pinned.count(id) == 0) continue;  // needed at t
        window_next_use = std::max(window_next_use, next_use_after(id, m + d - 1));
      }
    }
    for (int64_t id : trace_.moments[t].chunk_ids) {
      if (resident_.count(id) != 0) continue;
      if (next_use(id, m) == kNever) return;  // it goes to the host before its use: wait for it
      const int64_t bytes = info(id).bytes;
      bool fits;
      if (options_.policy == EvictionPolicy::kOpt && may_evict) {
        fits = evict_to_fit(bytes, window_budget, m, protect,
                            std::max(next_use(id, m), window_next_use), mover);
      } else {
        fits = resident_bytes_ + bytes <= window_budget;
      }
      if (!fits) return;  // keep access order: no later chunk jumps ahead of this one
      load(id, m, /*prefetch=*/true, mover);
    }
  }
}

}  // namespace patrickstar
