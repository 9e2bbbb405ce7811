#include "run_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "patrickstar/memtracer/simulator.h"

namespace patrickstar {

std::string PlanReport::text() const {
  if (!planned) return "";
  std::string out = absl::StrCat("plan", replanned ? " (planned again)" : "", ": profile ",
                                 profile, "\n");
  int width = 46;  // the longest name's
  for (const PlanCandidateReport& c : candidates) {
    width = std::max(width, static_cast<int>(c.name.size()));
  }
  out += absl::StrFormat("  %-*s %13s %11s %11s %11s %13s %12s %12s\n", width, "candidate",
                         "predicted s", "compute s", "host Adam s", "copy wait s", "device peak B",
                         "h2d B/iter", "d2h B/iter");
  for (size_t i = 0; i < candidates.size(); ++i) {
    const PlanCandidateReport& c = candidates[i];
    const char* mark = static_cast<int>(i) == chosen ? "*" : " ";
    if (!c.fits) {
      out += absl::StrFormat("%s %-*s does not fit: %.240s\n", mark, width, c.name, c.why_not);
      continue;
    }
    out += absl::StrFormat("%s %-*s %13.5f %11.5f %11.5f %11.5f %13d %12d %12d\n", mark, width,
                           c.name, c.predicted_step_seconds, c.compute_seconds, c.host_adam_seconds,
                           c.exposed_copy_seconds, c.device_peak_bytes, c.h2d_bytes, c.d2h_bytes);
  }
  if (chosen >= 0) {
    out += absl::StrCat("  chosen: ", candidates[chosen].name, ": ", why, "\n");
  } else {
    out += absl::StrCat("  no plan: ", why, "; the config's settings stay\n");
  }
  if (!activation_search.empty()) out += absl::StrCat("  activations: ", activation_search, "\n");
  if (planning_seconds > 0) {
    out += absl::StrFormat("  planning took %.3f s for %d candidates\n", planning_seconds,
                           candidates.size());
  }
  if (!check.empty()) out += absl::StrCat("  check: ", check, "\n");
  return out;
}

std::string PlanReport::config_json() const {
  if (chosen < 0) return "";
  const PlanCandidateReport& c = candidates[static_cast<size_t>(chosen)];
  const nlohmann::json j = {
      {"plan", "off"},
      {"default_chunk_size", c.chunk_elems},
      {"zero_optimization",
       {{"overlap_step", c.schedule == "overlapped"},
        {"delayed_param_update", c.schedule == "delayed"}}},
      {"optimizer",
       {{"params",
         {{"use_hybrid_adam", c.adam != "host"}, {"stream_states", c.adam == "streamed"}}}}}};
  nlohmann::json out = j;
  if (!c.activations.empty() && c.activations != "per call") {
    out["activation_checkpointing"] = {{"policy", c.activations},
                                       {"calls", nlohmann::json::array()}};
  } else if (!c.activation_calls.empty()) {  // "auto"'s choice (its own, or the plan's search's)
    out["activation_checkpointing"] = {{"policy", "auto"}, {"calls", c.activation_calls}};
  }
  return out.dump(2);
}

namespace engine_detail {
namespace {

enum class Site { kMargin, kHost, kStreamed };

// " (2 keep, 3 recompute, 1 offload)": how many calls run each way.
std::string ways_counted(const std::vector<std::string>& calls) {
  std::string out;
  for (const char* way : {"keep", "recompute", "offload"}) {
    const auto n = std::count(calls.begin(), calls.end(), way);
    if (n > 0) absl::StrAppend(&out, out.empty() ? " (" : ", ", n, " ", way);
  }
  return out.empty() ? out : out + ")";
}

bool adam_on_device(const PlanIndex& index, Site site) {
  return index.device_only || (site == Site::kMargin && index.on_device) ||
         (site == Site::kStreamed && (index.on_device || index.streamed));
}

void add_once(std::vector<int64_t>& ids, const std::vector<int64_t>& add) {
  for (int64_t c : add) {
    if (std::find(ids.begin(), ids.end(), c) == ids.end()) ids.push_back(c);
  }
}

// The layout's trace with every index's Adam where `site` puts it: an index whose step moment
// shows the other side moves over (its device side accessed, or its host side on the host).
Trace candidate_trace(const PlanLayout& in, Site site, int64_t step) {
  Trace t = in.trace;
  if (step < 0) return t;
  Moment& moment = t.moments[static_cast<size_t>(step)];
  auto shows = [](const std::vector<int64_t>& side, const std::vector<int64_t>& there) {
    return !side.empty() && std::all_of(side.begin(), side.end(), [&](int64_t c) {
      return std::find(there.begin(), there.end(), c) != there.end();
    });
  };
  for (const PlanIndex& index : in.indices) {
    const bool on_device_side = shows(index.device_side, moment.chunk_ids);
    // An index the step does not update (no gradient in the measured iteration) shows neither.
    if (!on_device_side && !shows(index.host_side, moment.host_chunk_ids)) continue;
    const bool device = adam_on_device(index, site);
    if (device == on_device_side) continue;
    const std::vector<int64_t>& side = device ? index.device_side : index.host_side;
    std::set<int64_t> all(index.device_side.begin(), index.device_side.end());
    all.insert(index.host_side.begin(), index.host_side.end());
    std::erase_if(moment.chunk_ids, [&](int64_t c) { return all.count(c) > 0; });
    std::erase_if(moment.host_chunk_ids, [&](int64_t c) { return all.count(c) > 0; });
    add_once(device ? moment.chunk_ids : moment.host_chunk_ids, side);
  }
  return t;
}

double device_adam_seconds(const PlanIndex& index, const PlanProfile& profile) {
  if (profile.device_adam_params_per_s > 0) return index.params / profile.device_adam_params_per_s;
  return 2.0 * static_cast<double>(index.device_adam_bytes) / profile.device_memory_bytes_per_s;
}

GpuCostModel cost_model_of(const PlanProfile& profile) {
  GpuCostModel m;
  m.name = profile.name;
  m.peak_flops = 1;  // a moment's "flops" are its measured seconds
  m.compute_efficiency = 1;
  m.h2d_bytes_per_s = profile.h2d_bytes_per_s;
  m.d2h_bytes_per_s = profile.d2h_bytes_per_s;
  m.device_memory_bytes_per_s = 1;  // the device Adam's time is in its moment's seconds
  m.host_adam_params_per_s = profile.host_adam_params_per_s;
  return m;
}

struct Variant {
  StepSchedule schedule;
  Site site;
};

PlanCandidateReport evaluate_variant(const PlanInputs& in, const PlanLayout& layout,
                                     const PlanProfile& profile, const Variant& v) {
  PlanCandidateReport c;
  c.chunk_elems = layout.chunk_elems;
  c.schedule = v.schedule == StepSchedule::kSerial       ? "serial"
               : v.schedule == StepSchedule::kOverlapped ? "overlapped"
                                                         : "delayed";
  c.adam = v.site == Site::kHost ? "host" : v.site == Site::kStreamed ? "streamed" : "margin";
  const int64_t step = step_moment_of(layout.trace);
  const Trace trace = candidate_trace(layout, v.site, step);
  c.activations = layout.activations;
  c.activation_calls = layout.activation_calls;
  const std::vector<double>& compute =
      layout.compute_seconds.empty() ? in.compute_seconds : layout.compute_seconds;
  std::vector<MomentCost> costs(static_cast<size_t>(trace.size()));
  for (size_t m = 0; m < costs.size(); ++m) {
    costs[m].flops = compute[m] * profile.compute_scale;
  }
  std::vector<HostUpdate> updates;
  for (const PlanIndex& index : layout.indices) {
    if (adam_on_device(index, v.site)) {
      ++c.adam_device_indices;
      if (step >= 0) costs[static_cast<size_t>(step)].flops += device_adam_seconds(index, profile);
      continue;
    }
    if (step >= 0) costs[static_cast<size_t>(step)].host_adam_params += index.params;
    if (v.schedule == StepSchedule::kDelayed) {
      // The training thread copies at the hand-over and the landing (at the copy rate back).
      if (step >= 0) {
        costs[static_cast<size_t>(step)].flops +=
            index.params * in.delayed_bytes_per_param / profile.d2h_bytes_per_s;
      }
      updates.push_back({index.params, index.ready_after, index.host_side});
      continue;
    }
    // The overlapped step also copies what it updates ahead, to undo it (at the host's copy rate).
    const double undo_params = static_cast<double>(index.undo_bytes) / profile.d2h_bytes_per_s *
                               profile.host_adam_params_per_s;
    updates.push_back({index.params + undo_params, index.ready_after, index.host_side});
  }
  c.name = absl::StrCat("chunks ", c.chunk_elems, ", ", c.schedule, ", Adam ", c.adam, " (",
                        c.adam_device_indices, " of ", layout.indices.size(), " on the device)",
                        c.activations.empty() ? "" : ", activations ", c.activations,
                        c.activations == "per call" ? ways_counted(c.activation_calls) : "");
  try {
    SimulationOptions options;
    options.scheduler = in.scheduler;
    options.scheduler.warmup_overdraft = true;  // the simulated warm-up is not the question
    options.iterations = 3;
    const SimulationResult sim = simulate(trace, layout.chunks, options);
    std::vector<MoveEvent> moves;
    for (const MoveEvent& e : sim.moves) {
      if (e.iteration == sim.steady.iteration) moves.push_back(e);
    }
    const Prediction p = predict_iteration(trace, costs, moves, layout.chunks,
                                           cost_model_of(profile), v.schedule, updates);
    c.fits = true;
    c.compute_seconds = p.compute_seconds;
    c.host_adam_seconds = p.host_adam_seconds;
    c.exposed_copy_seconds = p.exposed_copy_seconds;
    c.device_peak_bytes = sim.steady.peak_device_bytes;
    c.h2d_bytes = sim.steady.h2d_bytes;
    c.d2h_bytes = sim.steady.d2h_bytes;
    // What the timeline runs beside compute; the share of it that takes compute's cores instead
    // adds to the step.
    const double copies = std::max(0.0, p.h2d_seconds + p.d2h_seconds - p.exposed_copy_seconds);
    // (The step's wait for the optimizer thread is in the step already.)
    const double thread = v.schedule != StepSchedule::kSerial
                              ? std::max(0.0, p.host_adam_seconds - p.adam_wait_seconds)
                              : 0.0;
    const double beside = in.async_moves ? profile.beside_compute : 0.0;
    c.beside_seconds = copies * beside + thread * profile.beside_compute;
    // (The activations' exposed copies, beyond the measured iteration's, hold up compute.)
    const double extra = layout.extra_seconds;
    c.compute_seconds += extra;
    c.predicted_step_seconds =
        p.step_seconds + extra + copies * (1 - beside) + thread * (1 - profile.beside_compute);
  } catch (const c10::Error& e) {
    c.fits = false;
    c.why_not = e.what_without_backtrace();
  }
  return c;
}

// The schedules and placements `layout` allows.
std::vector<Variant> variants_of(const PlanInputs& in, const PlanLayout& layout) {
  bool margin_differs = false;    // some index runs its Adam on the device by the margin's choice
  bool streamed_differs = false;  // some more by the streamed placement's
  bool any_host = false;          // under the margin's placement
  bool any_host_streamed = false;
  for (const PlanIndex& index : layout.indices) {
    margin_differs = margin_differs || (index.on_device && !index.device_only);
    streamed_differs =
        streamed_differs || (index.streamed && !adam_on_device(index, Site::kMargin));
    any_host = any_host || !adam_on_device(index, Site::kMargin);
    any_host_streamed = any_host_streamed || !adam_on_device(index, Site::kStreamed);
  }
  std::vector<Variant> variants = {{StepSchedule::kSerial, Site::kMargin}};
  const bool host = in.host_placement_possible && margin_differs;
  const bool streamed = in.streamed_possible && streamed_differs;
  if (host) variants.push_back({StepSchedule::kSerial, Site::kHost});
  if (streamed) variants.push_back({StepSchedule::kSerial, Site::kStreamed});
  if (in.overlap_possible && any_host)
    variants.push_back({StepSchedule::kOverlapped, Site::kMargin});
  if (in.overlap_possible && host) variants.push_back({StepSchedule::kOverlapped, Site::kHost});
  if (in.overlap_possible && streamed && any_host_streamed) {
    variants.push_back({StepSchedule::kOverlapped, Site::kStreamed});
  }
  // The delayed update runs every Adam on the host: not where some index's states live on the
  // device for good.
  const bool device_only = std::any_of(layout.indices.begin(), layout.indices.end(),
                                       [](const PlanIndex& x) { return x.device_only; });
  if (in.delayed_possible && layout.delayed_fits && !device_only && !layout.indices.empty()) {
    variants.push_back({StepSchedule::kDelayed, Site::kHost});
  }
  return variants;
}

}  // namespace

int64_t step_moment_of(const Trace& trace) {
  int64_t step = -1;
  for (int64_t m = 0; m < trace.size(); ++m) {
    if (trace.moments[static_cast<size_t>(m)].kind == MomentKind::kStep) step = m;
  }
  return step;
}

int64_t step_non_model_of(const Trace& trace) {
  const int64_t step = step_moment_of(trace);
  if (step < 0) return 0;
  return std::max(trace.moments[static_cast<size_t>(step)].non_model_bytes,
                  trace.next_non_model_bytes(step));
}

void find_ready_moments(PlanLayout& layout) {
  const int64_t step = step_moment_of(layout.trace);
  for (PlanIndex& x : layout.indices) {
    const std::set<int64_t> own(x.own.begin(), x.own.end());
    auto touches = [&](const std::vector<int64_t>& ids) {
      return std::any_of(ids.begin(), ids.end(), [&](int64_t c) { return own.count(c) > 0; });
    };
    x.ready_after = std::max<int64_t>(0, step - 1);
    for (int64_t m = step - 1; m >= 0; --m) {
      const Moment& moment = layout.trace.moments[static_cast<size_t>(m)];
      if (touches(moment.chunk_ids) || touches(moment.host_chunk_ids)) {
        x.ready_after = m;
        break;
      }
    }
  }
}

PlanEvaluation evaluate_plan(const PlanInputs& in, const PlanProfile& profile) {
  TORCH_CHECK(!in.layouts.empty(), "plan: no chunk size to plan");
  for (const PlanLayout& layout : in.layouts) {
    const size_t measured =
        layout.compute_seconds.empty() ? in.compute_seconds.size() : layout.compute_seconds.size();
    TORCH_CHECK(static_cast<int64_t>(measured) == layout.trace.size(), "plan: ", measured,
                " measured moments for a trace of ", layout.trace.size(), " (chunks of ",
                layout.chunk_elems, " elements)");
  }
  TORCH_CHECK(profile.h2d_bytes_per_s > 0 && profile.d2h_bytes_per_s > 0 &&
                  profile.host_adam_params_per_s > 0 &&
                  (profile.device_adam_params_per_s > 0 || profile.device_memory_bytes_per_s > 0),
              "plan: the profile \"", profile.name, "\" has a rate that is not positive");
  PlanEvaluation out;
  for (const PlanLayout& layout : in.layouts) {
    for (const Variant& v : variants_of(in, layout)) {
      out.candidates.push_back(evaluate_variant(in, layout, profile, v));
    }
  }
  out.chosen = choose_candidate(out.candidates, nullptr, out.why);
  return out;
}

std::string activation_key(const PlanCandidateReport& c) {
  return absl::StrCat(c.chunk_elems, " ", c.activations, " ",
                      absl::StrJoin(c.activation_calls, ","));
}

int choose_candidate(const std::vector<PlanCandidateReport>& candidates,
                     const std::function<bool(const PlanCandidateReport&)>& allowed,
                     std::string& why) {
  auto open = [&](const PlanCandidateReport& c) { return c.fits && (!allowed || allowed(c)); };
  double best = std::numeric_limits<double>::infinity();
  for (const PlanCandidateReport& c : candidates) {
    if (open(c)) best = std::min(best, c.predicted_step_seconds);
  }
  // Within 1% of the fastest, the first in the order of preference: serial holds no undo buffers,
  // the margin's placement moves fewer chunks at the step.
  constexpr double kTie = 0.01;
  int chosen = -1;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const PlanCandidateReport& c = candidates[i];
    if (open(c) && c.predicted_step_seconds <= best * (1 + kTie)) {
      chosen = static_cast<int>(i);
      break;
    }
  }
  if (chosen < 0) {
    why = "no candidate fits the device";
    return chosen;
  }
  const PlanCandidateReport& c0 = candidates[static_cast<size_t>(chosen)];
  std::string next;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const PlanCandidateReport& c = candidates[i];
    if (static_cast<int>(i) == chosen || !open(c)) continue;
    next = absl::StrFormat("; %s predicted %.4g s (%.3fx)", c.name, c.predicted_step_seconds,
                           c.predicted_step_seconds / c0.predicted_step_seconds);
    break;
  }
  why = c0.predicted_step_seconds > best
            ? absl::StrFormat(
                  "predicted step %.4g s, within 1%% of the fastest (%.4g s) and first in the "
                  "order of preference (the engine's own chunk size and activations, "
                  "serial, overlapped, delayed, the margin, the host)%s",
                  c0.predicted_step_seconds, best, next)
            : absl::StrFormat("the fastest predicted step, %.4g s%s", c0.predicted_step_seconds,
                              next);
  return chosen;
}

const PlanLayout* layout_of(const PlanInputs& inputs, const PlanCandidateReport& candidate) {
  for (const PlanLayout& layout : inputs.layouts) {
    if (layout.chunk_elems == candidate.chunk_elems &&
        layout.activations == candidate.activations &&
        layout.activation_calls == candidate.activation_calls) {
      return &layout;
    }
  }
  return nullptr;
}

PlanProfile named_plan_profile(const std::string& name) {
  const GpuCostModel gpu = gpu_cost_model(name);
  PlanProfile p;
  p.name = gpu.name;
  p.h2d_bytes_per_s = gpu.h2d_bytes_per_s;
  p.d2h_bytes_per_s = gpu.d2h_bytes_per_s;
  p.host_adam_params_per_s = gpu.host_adam_params_per_s;
  p.device_memory_bytes_per_s = gpu.device_memory_bytes_per_s;
  p.beside_compute = 1;
  p.sources = gpu.sources;
  return p;
}

void RunPlanner::note_moment(int64_t moment, const Mark& mark) {
  if (!measuring_) return;
  if (moment < 0 || moment > static_cast<int64_t>(marks_.size())) {
    measuring_ = false;  // a moment skipped: this iteration measures nothing
    return;
  }
  marks_.resize(static_cast<size_t>(moment));  // a forward rewound: its moments come again
  marks_.push_back(mark);
}

std::vector<double> RunPlanner::end_measuring(int64_t moments, int64_t step_moment,
                                              const Mark& mark, double adam_seconds,
                                              double copy_bytes_per_s, bool sync_moves) {
  const bool complete = measuring_ && static_cast<int64_t>(marks_.size()) == moments;
  measuring_ = false;
  if (!complete || moments == 0) return {};
  std::vector<double> compute(static_cast<size_t>(moments), 0.0);
  for (size_t m = 0; m < compute.size(); ++m) {
    const Mark& from = marks_[m];
    const Mark& to = m + 1 < marks_.size() ? marks_[m + 1] : mark;
    double s = (to.time - from.time) - (to.copy_wait - from.copy_wait);
    if (sync_moves && copy_bytes_per_s > 0) {
      s -= static_cast<double>(to.moved_bytes - from.moved_bytes) / copy_bytes_per_s;
    }
    if (static_cast<int64_t>(m) == step_moment) s -= adam_seconds;
    compute[m] = std::max(0.0, s);
  }
  return compute;
}

const PlanCandidateReport* RunPlanner::plan(const PlanInputs& inputs, const PlanProfile& profile) {
  inputs_ = inputs;
  profile_ = profile;
  PlanEvaluation eval = evaluate_plan(inputs_, profile_);
  const bool again = report_.planned;
  report_.planned = true;
  report_.replanned = again;
  report_.profile = absl::StrFormat(
      "\"%s\": copies %.3g GB/s to the device and %.3g GB/s back, host Adam %.3g params/s, "
      "device Adam %s, work on other threads %.0f%% beside compute, measured compute x%.3f (%s)",
      profile_.name, profile_.h2d_bytes_per_s / 1e9, profile_.d2h_bytes_per_s / 1e9,
      profile_.host_adam_params_per_s,
      profile_.device_adam_params_per_s > 0
          ? absl::StrFormat("%.3g params/s", profile_.device_adam_params_per_s)
          : absl::StrFormat("its chunks read and written at %.3g GB/s",
                            profile_.device_memory_bytes_per_s / 1e9),
      profile_.beside_compute * 100, profile_.compute_scale, profile_.sources);
  report_.candidates = std::move(eval.candidates);
  report_.chosen = eval.chosen;
  report_.why = eval.why;
  report_.activation_search = inputs_.activation_search;
  report_.predicted_step_seconds =
      eval.chosen >= 0 ? report_.candidates[static_cast<size_t>(eval.chosen)].predicted_step_seconds
                       : 0;
  samples_.clear();
  return eval.chosen >= 0 ? &report_.candidates[static_cast<size_t>(eval.chosen)] : nullptr;
}

const PlanCandidateReport* RunPlanner::choose_within(const std::string& key,
                                                     const std::string& why) {
  if (report_.chosen >= 0 &&
      activation_key(report_.candidates[static_cast<size_t>(report_.chosen)]) == key) {
    report_.why = absl::StrCat(why, ": ", report_.why);
    return &report_.candidates[static_cast<size_t>(report_.chosen)];
  }
  std::string chose;
  report_.chosen = choose_candidate(
      report_.candidates, [&](const PlanCandidateReport& c) { return activation_key(c) == key; },
      chose);
  report_.why = absl::StrCat(why, ": ", chose);
  if (report_.chosen < 0) {
    report_.predicted_step_seconds = 0;
    return nullptr;
  }
  PlanCandidateReport& c = report_.candidates[static_cast<size_t>(report_.chosen)];
  report_.predicted_step_seconds = c.predicted_step_seconds;
  return &c;
}

void RunPlanner::stop_checking(const std::string& why) {
  checks_ = 2;
  samples_.clear();
  report_.check = why;
}

void RunPlanner::give_up(const std::string& why) {
  measuring_ = false;
  report_.planned = true;
  report_.chosen = -1;
  report_.predicted_step_seconds = 0;
  report_.why = why;
}

bool RunPlanner::end_iteration(bool counted, double seconds) {
  if (!report_.planned || report_.chosen < 0 || checks_ >= 2 ||
      (report_.checked && !report_.replanned) || !counted) {
    return false;
  }
  samples_.push_back(seconds);
  if (static_cast<int>(samples_.size()) < config_.check_iterations) return false;
  std::vector<double> v = samples_;
  samples_.clear();
  std::sort(v.begin(), v.end());
  const double median = v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  ++checks_;
  PlanCandidateReport& chosen = report_.candidates[static_cast<size_t>(report_.chosen)];
  chosen.measured_step_seconds = median;
  report_.measured_step_seconds = median;
  report_.checked = true;
  const double predicted = chosen.predicted_step_seconds;
  const double off = predicted > 0 ? median / predicted - 1 : 0;
  const bool past = std::abs(off) > config_.tolerance;
  const bool replan = past && checks_ == 1;
  report_.check = (checks_ == 2 ? report_.check + "; after planning again: " : "") +
                  absl::StrFormat(
      "median step %.4g s over %d iterations against %.4g s predicted (%+.1f%%, tolerance "
      "%.0f%%)%s",
      median, static_cast<int>(v.size()), predicted, off * 100, config_.tolerance * 100,
      !past ? ": the plan stands" : replan ? ": past the tolerance, planned again with the measured profile"
                                           : ": past the tolerance again; the plan stays (the engine re-plans once)");
  if (!replan) return false;
  // The correction: a longer step first takes back the work the prediction hid beside compute
  // (it took compute's time), then scales the measured compute; a shorter one scales the compute.
  double excess = median - predicted;
  if (excess > 0 && chosen.beside_seconds > 0 && profile_.beside_compute > 0) {
    const double taken = std::min(excess, chosen.beside_seconds);
    profile_.beside_compute *= 1 - taken / chosen.beside_seconds;
    excess -= taken;
  }
  // (The chosen candidate's measured compute: an activation alternative has its own.)
  const PlanLayout* layout = layout_of(inputs_, chosen);
  const std::vector<double>* measured = layout != nullptr && !layout->compute_seconds.empty()
                                            ? &layout->compute_seconds
                                            : &inputs_.compute_seconds;
  double compute = 0;
  for (double s : *measured) compute += s * profile_.compute_scale;
  if (compute > 0) profile_.compute_scale *= std::max(0.2, (compute + excess) / compute);
  profile_.name = "measured, corrected";
  return true;
}

}  // namespace engine_detail
}  // namespace patrickstar
