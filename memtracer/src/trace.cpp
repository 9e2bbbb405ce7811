#include "patrickstar/memtracer/trace.h"

#include <sstream>

#include <algorithm>

#include <c10/util/Exception.h>

#include "patrickstar/memtracer/memory_probe.h"

namespace patrickstar {

const char* moment_kind_name(MomentKind kind) {
  switch (kind) {
    case MomentKind::kPreForward:
      return "pre_forward";
    case MomentKind::kPreBackward:
      return "pre_backward";
    case MomentKind::kStep:
      return "step";
  }
  return "unknown";
}

int64_t Trace::next_non_model_bytes(int64_t m) const {
  TORCH_CHECK(m >= 0 && m < size(), "moment ", m, " is outside the trace of ", size(), " moments");
  if (m + 1 < size()) {
    return moments[m + 1].non_model_bytes;
  }
  return std::max(tail_non_model_bytes, moments.front().non_model_bytes);
}

bool Trace::same_moments(const Trace& other) const {
  if (moments.size() != other.moments.size()) {
    return false;
  }
  for (size_t m = 0; m < moments.size(); ++m) {
    const Moment& a = moments[m];
    const Moment& b = other.moments[m];
    if (a.kind != b.kind || a.label != b.label || a.chunk_ids != b.chunk_ids ||
        a.host_chunk_ids != b.host_chunk_ids) {
      return false;
    }
  }
  return true;
}

NextUseIndex::NextUseIndex(const Trace& trace) : moments_(trace.size()) {
  int64_t position = 0;
  for (int64_t m = 0; m < trace.size(); ++m) {
    for (int64_t id : trace.moments[m].chunk_ids) uses_[id].emplace_back(m, position++);
    for (int64_t id : trace.moments[m].host_chunk_ids) host_moments_[id].push_back(m);
  }
  accesses_per_iteration_ = position;
}

int64_t NextUseIndex::next_use(int64_t chunk_id, int64_t m) const {
  auto it = uses_.find(chunk_id);
  if (it == uses_.end()) return kNever;
  const auto& uses = it->second;
  auto later = std::upper_bound(uses.begin(), uses.end(), std::make_pair(m, kNever));
  // The next access, as a moment on a line that continues into the next iteration.
  const bool wraps = later == uses.end();
  const int64_t use_moment = wraps ? uses.front().first + moments_ : later->first;
  const int64_t position = wraps ? uses.front().second + accesses_per_iteration_ : later->second;
  auto host = host_moments_.find(chunk_id);
  if (host != host_moments_.end()) {
    const auto& at = host->second;
    auto next_host = std::upper_bound(at.begin(), at.end(), m);
    const int64_t host_moment = next_host != at.end() ? *next_host : at.front() + moments_;
    if (host_moment < use_moment) return kNever;
  }
  return position;
}

bool NextUseIndex::host_before_use(int64_t chunk_id, int64_t m) const {
  auto host = host_moments_.find(chunk_id);
  if (host == host_moments_.end()) return false;
  const auto& at = host->second;
  auto next_host = std::upper_bound(at.begin(), at.end(), m);
  const int64_t host_moment = next_host != at.end() ? *next_host : at.front() + moments_;
  auto it = uses_.find(chunk_id);
  if (it == uses_.end()) return true;
  const auto& uses = it->second;
  auto later = std::upper_bound(uses.begin(), uses.end(), std::make_pair(m, kNever));
  const int64_t use_moment = later != uses.end() ? later->first : uses.front().first + moments_;
  return host_moment < use_moment;
}

std::vector<int64_t> NextUseIndex::accessed_chunks() const {
  std::vector<int64_t> ids;
  for (const auto& [id, list] : uses_) ids.push_back(id);
  return ids;
}

TraceRecorder::TraceRecorder(MemoryProbe* probe) : probe_(probe) {}

int64_t TraceRecorder::take_peak() {
  if (probe_ == nullptr) {
    return 0;
  }
  const int64_t peak = probe_->peak_bytes();
  probe_->reset_peak();
  return peak;
}

void TraceRecorder::begin_iteration() {
  TORCH_CHECK(!in_iteration_, "TraceRecorder::begin_iteration: iteration ", iteration_,
              " has not ended (call end_iteration first)");
  ++iteration_;
  in_iteration_ = true;
  current_moment_ = -1;
  current_ = Trace{};
  // The first moment's window starts here: memory of the previous iteration's end is its tail.
  take_peak();
}

int64_t TraceRecorder::tick(MomentKind kind, const std::string& label) {
  TORCH_CHECK(in_iteration_, "TraceRecorder::tick(", moment_kind_name(kind), " '", label,
              "') outside an iteration (call begin_iteration first)");
  const int64_t m = current_moment_ + 1;
  if (has_warmup_) {
    TORCH_CHECK(m < warmup_.size(), "iteration ", iteration_, " reached moment ", m, " (",
                moment_kind_name(kind), " '", label, "') but the warm-up iteration had only ",
                warmup_.size(),
                " moments: the model's control flow changed; call rewarm() to record a new trace");
    const Moment& expected = warmup_.moments[m];
    TORCH_CHECK(expected.kind == kind && expected.label == label, "iteration ", iteration_,
                ", moment ", m, ": expected ", moment_kind_name(expected.kind), " '",
                expected.label, "' as in the warm-up iteration but got ", moment_kind_name(kind),
                " '", label,
                "': the model's control flow changed; call rewarm() to record a new trace");
  }
  const int64_t peak = take_peak();
  current_.moments.push_back(Moment{kind, label, peak, {}, {}});
  current_moment_ = m;
  return m;
}

void TraceRecorder::record_access(int64_t chunk_id) {
  TORCH_CHECK(in_iteration_ && current_moment_ >= 0, "TraceRecorder::record_access(chunk ",
              chunk_id, ") before the first moment of an iteration (call tick first)");
  std::vector<int64_t>& ids = current_.moments.back().chunk_ids;
  if (std::find(ids.begin(), ids.end(), chunk_id) == ids.end()) {
    ids.push_back(chunk_id);
  }
}

void TraceRecorder::record_host(int64_t chunk_id) {
  TORCH_CHECK(in_iteration_ && current_moment_ >= 0, "TraceRecorder::record_host(chunk ",
              chunk_id, ") before the first moment of an iteration (call tick first)");
  std::vector<int64_t>& ids = current_.moments.back().host_chunk_ids;
  if (std::find(ids.begin(), ids.end(), chunk_id) == ids.end()) {
    ids.push_back(chunk_id);
  }
}

void TraceRecorder::end_iteration() {
  TORCH_CHECK(in_iteration_, "TraceRecorder::end_iteration without begin_iteration");
  in_iteration_ = false;
  current_.tail_non_model_bytes = take_peak();
  if (!has_warmup_) {
    TORCH_CHECK(!current_.moments.empty(), "the warm-up iteration ", iteration_,
                " had no moment: no module with parameters ran and no step was taken");
    warmup_ = current_;
    has_warmup_ = true;
    return;
  }
  TORCH_CHECK(current_.size() == warmup_.size(), "iteration ", iteration_, " ended after ",
              current_.size(), " moments but the warm-up iteration had ", warmup_.size(),
              ": the model's control flow changed; call rewarm() to record a new trace");
}

void TraceRecorder::abort_iteration() {
  if (!in_iteration_) return;
  in_iteration_ = false;
  --iteration_;
  current_moment_ = -1;
  current_ = Trace{};
}

bool TraceRecorder::matches_next(MomentKind kind, const std::string& label,
                                 std::string* why) const {
  if (!has_warmup_) return true;
  const int64_t m = current_moment_ + 1;
  std::ostringstream out;
  if (m >= warmup_.size()) {
    out << "iteration " << iteration_ << " reached moment " << m << " (" << moment_kind_name(kind)
        << " '" << label << "') but the recorded trace has " << warmup_.size() << " moments";
  } else {
    const Moment& expected = warmup_.moments[m];
    if (expected.kind == kind && expected.label == label) return true;
    out << "iteration " << iteration_ << ", moment " << m << ": the trace expects "
        << moment_kind_name(expected.kind) << " '" << expected.label << "' but got "
        << moment_kind_name(kind) << " '" << label << "'";
  }
  if (why != nullptr) *why = out.str();
  return false;
}

void TraceRecorder::rewind_to(int64_t moments) {
  TORCH_CHECK(in_iteration_ && moments >= 0 && moments <= current_moment_ + 1,
              "TraceRecorder::rewind_to(", moments, "): the iteration in progress has ",
              current_moment_ + 1, " moments");
  current_.moments.resize(static_cast<size_t>(moments));
  current_moment_ = moments - 1;
}

void TraceRecorder::rewarm() {
  warmup_ = Trace{};
  has_warmup_ = false;
}

}  // namespace patrickstar
