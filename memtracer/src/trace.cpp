#include "patrickstar/memtracer/trace.h"

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
    if (a.kind != b.kind || a.label != b.label || a.chunk_ids != b.chunk_ids) {
      return false;
    }
  }
  return true;
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
  current_.moments.push_back(Moment{kind, label, peak, {}});
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

void TraceRecorder::rewarm() {
  warmup_ = Trace{};
  has_warmup_ = false;
}

}  // namespace patrickstar
