#include "activation_plan.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <limits>
#include <utility>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "patrickstar/memtracer/simulator.h"

namespace patrickstar {

namespace {

template <typename... Args>
std::string format(const char* pattern, Args... args) {
  char line[512];
  std::snprintf(line, sizeof(line), pattern, args...);
  return line;
}

}  // namespace

std::string ActivationPlanReport::text() const {
  std::string out = absl::StrCat("activation plan (policy \"", policy, "\"",
                                 planned ? ", planned after the warm-up" : "", "):\n");
  for (const ActivationCallPlan& c : calls) {
    out += format("  call %3lld  %-9s  input %10lld B  kept %11lld B  forward %.3f ms%s\n",
                  static_cast<long long>(c.call), c.choice.c_str(),
                  static_cast<long long>(c.input_bytes), static_cast<long long>(c.kept_bytes),
                  c.forward_seconds * 1e3, c.named ? "" : "  (unnamed)");
  }
  if (!candidates.empty()) {
    out +=
        format("  cost model: copies %.2f GB/s (%s), common compute %.4f s\n",
               copy_bytes_per_s / 1e9, copies_overlap ? "overlapped" : "exposed", common_seconds);
  }
  if (!run_plan_instead.empty()) {
    out += format("  the run plan (\"plan\": \"auto\") runs %s instead of the choice below\n",
                  run_plan_instead.c_str());
  }
  for (const ActivationCandidate& c : candidates) {
    if (c.fits) {
      out += format("  %-28s predicted %.4f s  non-model peak %lld B  chunk moves %lld B\n",
                    c.name.c_str(), c.predicted_seconds,
                    static_cast<long long>(c.non_model_peak_bytes),
                    static_cast<long long>(c.traffic_bytes));
    } else {
      out += format("  %-28s does not fit: %.300s\n", c.name.c_str(), c.why_not.c_str());
    }
  }
  return out;
}

namespace engine_detail {
namespace {

constexpr ActivationChoice kChoices[] = {ActivationChoice::kRecompute, ActivationChoice::kOffload,
                                         ActivationChoice::kKeep};

}  // namespace

ActivationPlanner::ActivationPlanner(const ActivationConfig& config) : policy_(config.policy) {
  // (from_json checks these; a Config built in C++ is checked here.)
  TORCH_CHECK(config.calls.empty() || policy_ == ActivationPolicy::kAuto,
              "patrickstar::Engine: activation_checkpointing.calls pins the \"auto\" policy's "
              "choice; the policy is \"",
              to_string(policy_), "\"");
  for (const std::string& way : config.calls) {
    TORCH_CHECK(way == "keep" || way == "recompute" || way == "offload",
                "patrickstar::Engine: activation_checkpointing.calls: \"", way,
                "\" is not \"keep\", \"recompute\" or \"offload\"");
    pinned_.push_back(activation_choice_named(way));
  }
}

ActivationChoice ActivationPlanner::default_choice(bool named) const {
  switch (policy_) {
    case ActivationPolicy::kOffload:
      return ActivationChoice::kOffload;
    case ActivationPolicy::kNone:
      return named ? ActivationChoice::kKeep : ActivationChoice::kRecompute;
    case ActivationPolicy::kAuto:
      // Measured offloaded (the least device memory: if any way trains, this one does), then
      // as planned.
      return ActivationChoice::kOffload;
    case ActivationPolicy::kRecompute:
      break;
  }
  return ActivationChoice::kRecompute;
}

void ActivationPlanner::restart() {
  if (measuring_ && static_cast<int64_t>(calls_.size()) > next_call_) calls_.resize(next_call_);
  next_call_ = 0;
  forward_start_call_ = 0;
}

ModuleHookHandler::CheckpointPlan ActivationPlanner::plan(bool named, std::optional<bool> offload,
                                                          int64_t moment) {
  const int64_t call = next_call_++;
  ActivationChoice choice = default_choice(named);
  if (planned_ && call < static_cast<int64_t>(choices_.size())) choice = choices_[call];
  if (choice == ActivationChoice::kKeep && !named) {
    // Keeping needs the engine asked before the block runs, which an unnamed call cannot be.
    TORCH_WARN_ONCE(
        "patrickstar: \"activation_checkpointing\": a checkpoint call that does not "
        "name its block (checkpoint(fn, x) rather than checkpoint(block, fn, x)) "
        "cannot keep its activations: it recomputes them");
    choice = ActivationChoice::kRecompute;
  }
  if (offload.has_value()) {
    choice = *offload ? ActivationChoice::kOffload : ActivationChoice::kRecompute;
  }
  if (measuring_) {
    if (static_cast<int64_t>(calls_.size()) <= call) calls_.resize(call + 1);
    calls_[call].named = named;
    calls_[call].forced = offload.has_value();
    calls_[call].plan_moment = moment;
    calls_[call].measured = choice;
  }
  if (static_cast<int64_t>(report_.calls.size()) <= call) {
    report_.calls.resize(call + 1);
    report_.calls[call].call = call;
  }
  report_.calls[call].named = named;
  report_.calls[call].choice = activation_choice_name(choice);
  return {call, choice};
}

void ActivationPlanner::forward_done(int64_t call, int64_t input_bytes, double seconds,
                                     int64_t moment) {
  if (!measuring_ || call < 0 || call >= static_cast<int64_t>(calls_.size())) return;
  Call& c = calls_[call];
  c.input_bytes = input_bytes;
  c.forward_seconds = seconds;
  c.forward_moment = moment;
}

void ActivationPlanner::recompute_begins(int64_t call, int64_t moment, int64_t live_bytes) {
  if (!measuring_ || call < 0 || call >= static_cast<int64_t>(calls_.size())) return;
  calls_[call].recompute_begin = moment;
  calls_[call].live_at_recompute = live_bytes;
}

void ActivationPlanner::recompute_done(int64_t call, double seconds, int64_t moment,
                                       int64_t live_bytes) {
  if (!measuring_ || call < 0 || call >= static_cast<int64_t>(calls_.size())) return;
  Call& c = calls_[call];
  c.recompute_end = moment;
  c.kept_bytes = std::max<int64_t>(0, live_bytes - c.live_at_recompute);
  c.forward_seconds = c.forward_seconds > 0 ? std::min(c.forward_seconds, seconds) : seconds;
}

bool ActivationPlanner::wants_plan() const {
  if (policy_ != ActivationPolicy::kAuto || planned_ || !measuring_ || calls_.empty()) return false;
  // Every call measured in full (a forward without its backward leaves it unplanned).
  return std::all_of(calls_.begin(), calls_.end(), [](const Call& c) {
    return c.forward_moment >= 0 && c.recompute_begin >= 0 && c.recompute_end >= 0;
  });
}

ActivationPlanner::Shaped ActivationPlanner::shape(const Trace& warmup,
                                                   const std::vector<ActivationChoice>& choices,
                                                   double bw, bool copies_overlap) const {
  Trace trace = warmup;
  const int64_t moments = trace.size();
  std::vector<bool> dropped(static_cast<size_t>(moments), false);
  auto adjust = [&](int64_t from, int64_t to, int64_t bytes) {  // moments (from, to]
    for (int64_t m = std::max<int64_t>(from + 1, 0); m <= std::min(to, moments - 1); ++m) {
      int64_t& b = trace.moments[m].non_model_bytes;
      b = std::max<int64_t>(0, b + bytes);
    }
  };
  Shaped out;
  const int64_t n = static_cast<int64_t>(calls_.size());
  std::vector<ActivationChoice> measured;
  for (const Call& c : calls_) measured.push_back(c.measured);
  for (int64_t i = 0; i < n; ++i) {
    const Call& c = calls_[i];
    // An offloaded input leaves the device when the next call's forward is done and comes back
    // when that call's recompute begins (its own take, where that call is kept). The next call
    // must come before this one's backward (with gradient accumulation, the next micro-batch's
    // first call does not). The trace has it away where the warm-up offloaded it.
    const Call* next =
        i + 1 < n && calls_[i + 1].forward_moment < c.recompute_begin ? &calls_[i + 1] : nullptr;
    auto back = [&](const std::vector<ActivationChoice>& ways) {
      return ways[i + 1] == ActivationChoice::kKeep ? c.recompute_begin : next->recompute_begin;
    };
    if (next != nullptr && measured[i] == ActivationChoice::kOffload) {
      adjust(next->forward_moment, back(measured), c.input_bytes);
    }
    if (next != nullptr && choices[i] == ActivationChoice::kOffload) {
      adjust(next->forward_moment, back(choices), -c.input_bytes);
      const double copy = bw > 0 ? static_cast<double>(c.input_bytes) / bw : 0;
      out.exposed += copies_overlap ? 2 * std::max(0.0, copy - next->forward_seconds) : 2 * copy;
    }
    if (choices[i] == ActivationChoice::kKeep) {
      // From its forward's start (its own moments hold what it builds) to its backward.
      adjust(c.plan_moment >= 0 ? c.plan_moment : c.forward_moment, c.recompute_begin,
             c.kept_bytes);
      for (int64_t m = c.recompute_begin + 1; m <= c.recompute_end && m < moments; ++m) {
        dropped[m] = true;  // no recompute: its doors' moments do not happen
      }
      continue;
    }
    out.recomputed += c.forward_seconds;
  }
  out.trace.tail_non_model_bytes = trace.tail_non_model_bytes;
  for (int64_t m = 0; m < moments; ++m) {
    if (dropped[m]) continue;
    out.trace.moments.push_back(std::move(trace.moments[m]));
    out.from.push_back(m);
  }
  for (const Moment& m : out.trace.moments) out.peak = std::max(out.peak, m.non_model_bytes);
  out.peak = std::max(out.peak, out.trace.tail_non_model_bytes);
  return out;
}

ActivationPlanner::Evaluation ActivationPlanner::evaluate(
    const PlanInputs& in, const std::vector<ActivationChoice>& choices) const {
  const double bw = in.copy_bytes_per_s;
  Shaped shaped = shape(*in.trace, choices, bw, in.copies_overlap);
  Evaluation e;
  e.peak = shaped.peak;
  try {
    in.scheduler->check_trace(shaped.trace);
    const TrafficBound bound = opt_traffic_bound(shaped.trace, in.chunks, in.scheduler->options());
    e.traffic = bound.h2d_bytes + bound.d2h_bytes;
    e.fits = true;
  } catch (const c10::Error& error) {
    e.why_not = error.what_without_backtrace();
    return e;
  }
  e.seconds = common_seconds_ + shaped.recomputed + (bw > 0 ? e.traffic / bw : 0) + shaped.exposed;
  return e;
}

void ActivationPlanner::make_plan(const PlanInputs& in) {
  TORCH_CHECK(in.trace != nullptr && in.scheduler != nullptr, "ActivationPlanner: no trace");
  const int64_t n = static_cast<int64_t>(calls_.size());
  report_.copy_bytes_per_s = in.copy_bytes_per_s;
  report_.copies_overlap = in.copies_overlap;
  // What every plan shares: the warm-up less what the model predicts for the way it ran (its
  // recomputes, its chunk moves, its copies).
  std::vector<ActivationChoice> measured;
  for (const Call& c : calls_) measured.push_back(c.measured);
  common_seconds_ = 0;
  common_seconds_ = std::max(0.0, in.warmup_seconds - evaluate(in, measured).seconds);
  report_.common_seconds = common_seconds_;

  std::vector<ActivationChoice> best = measured;
  bool pinned = false;
  if (!pinned_.empty() && pinned_.size() != calls_.size()) {
    TORCH_WARN("patrickstar: activation_checkpointing.calls pins ", pinned_.size(),
               " calls' ways, and the iteration made ", calls_.size(),
               " checkpoint calls: \"auto\" chooses them");
  } else if (!pinned_.empty()) {
    // (Pinned: what the run plan chose on the trace it ran, which this model only approximates.)
    const Evaluation e = candidate(in, "pinned (calls)", runs_as(pinned_));
    if (!e.fits) {
      TORCH_WARN(
          "patrickstar: the activation plan's model says the ways "
          "activation_checkpointing.calls pins do not fit the device (",
          e.why_not, "); they run as pinned");
    }
    best = runs_as(pinned_);
    pinned = true;
  }
  if (!pinned) best = search(in, measured);
  const Evaluation best_e = evaluate(in, best);
  report_.candidates.push_back(ActivationCandidate{"chosen", best_e.fits, best_e.why_not,
                                                   best_e.peak, best_e.traffic, best_e.seconds});
  report_.predicted_step_seconds = best_e.seconds;
  choices_ = best;
  own_choices_ = best;
  warmup_ = *in.trace;
  copy_bytes_per_s_ = in.copy_bytes_per_s;
  copies_overlap_ = in.copies_overlap;
  planned_ = true;
  measuring_ = false;
  for (int64_t i = 0; i < n && i < static_cast<int64_t>(report_.calls.size()); ++i) {
    report_.calls[i].choice = activation_choice_name(choices_[i]);
  }
  report_.planned = true;
}

ActivationPlanner::Evaluation ActivationPlanner::candidate(
    const PlanInputs& in, std::string name, const std::vector<ActivationChoice>& choices) {
  const Evaluation e = evaluate(in, choices);
  report_.candidates.push_back(
      ActivationCandidate{std::move(name), e.fits, e.why_not, e.peak, e.traffic, e.seconds});
  return e;
}

std::vector<ActivationChoice> ActivationPlanner::search(const PlanInputs& in,
                                                        std::vector<ActivationChoice> best) {
  // The way the warm-up ran trained: the plan to fall back on.
  Evaluation best_e = evaluate(in, best);
  for (ActivationChoice uniform : whole_model_ways()) {
    const std::vector<ActivationChoice> choices = every_call(uniform);
    const Evaluation e =
        candidate(in, absl::StrCat("every call: ", activation_choice_name(uniform)), choices);
    if (e.fits && (!best_e.fits || e.seconds < best_e.seconds)) {
      best = choices;
      best_e = e;
    }
  }
  // Then one call at a time, while the predicted step gets shorter.
  if (!best_e.fits) return best;
  return search_ways(std::move(best), ways_of_calls(),
                     [&](const std::vector<ActivationChoice>& c) {
                       const Evaluation e = evaluate(in, c);
                       return e.fits ? e.seconds : std::numeric_limits<double>::infinity();
                     })
      .best;
}

std::vector<uint8_t> ActivationPlanner::choices() const {
  std::vector<uint8_t> out(calls_.size(), static_cast<uint8_t>(ActivationChoice::kRecompute));
  for (size_t i = 0; i < out.size() && i < choices_.size(); ++i) {
    out[i] = static_cast<uint8_t>(choices_[i]);
  }
  return out;
}

void ActivationPlanner::set_choices(const std::vector<uint8_t>& choices) {
  planned_ = true;
  measuring_ = false;
  report_.planned = true;
  choices_.clear();
  for (uint8_t c : choices) choices_.push_back(static_cast<ActivationChoice>(c));
  own_choices_ = choices_;
  for (size_t i = 0; i < choices_.size() && i < report_.calls.size(); ++i) {
    report_.calls[i].choice = activation_choice_name(choices_[i]);
  }
}

std::vector<ActivationChoice> ActivationPlanner::whole_model_ways() const {
  const bool all_named =
      std::all_of(calls_.begin(), calls_.end(), [](const Call& c) { return c.named; });
  std::vector<ActivationChoice> out(std::begin(kChoices), std::end(kChoices));
  if (!all_named) std::erase(out, ActivationChoice::kKeep);
  return out;
}

std::vector<ActivationChoice> ActivationPlanner::every_call(ActivationChoice every) const {
  return runs_as(std::vector<ActivationChoice>(calls_.size(), every));
}

std::vector<ActivationChoice> ActivationPlanner::runs_as(
    std::vector<ActivationChoice> choices) const {
  // A call's own option wins (plan()); an unnamed call is never kept.
  for (size_t i = 0; i < choices.size() && i < calls_.size(); ++i) {
    if (calls_[i].forced) choices[i] = calls_[i].measured;
    if (choices[i] == ActivationChoice::kKeep && !calls_[i].named) {
      choices[i] = ActivationChoice::kRecompute;
    }
  }
  return choices;
}

ActivationPlanReport ActivationPlanner::report() const {
  ActivationPlanReport r = report_;
  r.policy = std::string(to_string(policy_));
  for (size_t i = 0; i < r.calls.size() && i < calls_.size(); ++i) {
    r.calls[i].input_bytes = calls_[i].input_bytes;
    r.calls[i].kept_bytes = calls_[i].kept_bytes;
    r.calls[i].forward_seconds = calls_[i].forward_seconds;
  }
  return r;
}

double measure_copy_bandwidth(MemoryTier& device, MemoryTier& host, const c10::Device& where,
                              int64_t bytes) {
  void* block = nullptr;
  try {
    block = host.allocate(bytes);
  } catch (const std::exception&) {
    return 0;
  }
  double best = 0;
  try {  // (a device that cannot spare the target: 0, the plan goes on without moves' cost)
    at::Tensor target = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(where));
    for (int i = 0; i < 3; ++i) {
      const auto start = std::chrono::steady_clock::now();
      device.copy(target.mutable_data_ptr(), block, bytes, CopyDirection::kHostToDevice);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (s > 0) best = std::max(best, static_cast<double>(bytes) / s);
    }
  } catch (const std::exception&) {
    best = 0;
  }
  host.deallocate(block);
  return best;
}

}  // namespace engine_detail
}  // namespace patrickstar
