// The activation plan's alternatives for the run plan (activation_plan.h): another way of running
// the checkpoint calls, as an edit of the trace the engine runs, and running it.
#include "activation_plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace patrickstar::engine_detail {

bool ActivationPlanner::runs_model_trace(const Trace& running, std::string* why) const {
  return running_shape(running, why).has_value();
}

std::optional<ActivationPlanner::Shaped> ActivationPlanner::running_shape(const Trace& running,
                                                                          std::string* why) const {
  auto no = [&](std::string reason) {
    if (why != nullptr) *why = std::move(reason);
    return std::nullopt;
  };
  if (policy_ != ActivationPolicy::kAuto || !planned_ || warmup_.moments.empty() ||
      choices_.size() != calls_.size()) {
    return no("the activations are not \"auto\" or were not planned");
  }
  Shaped now = shape(warmup_, runs_as(choices_), copy_bytes_per_s_, copies_overlap_);
  bool same = now.trace.size() == running.size();
  for (int64_t m = 0; same && m < running.size(); ++m) {
    same = now.trace.moments[m].kind == running.moments[m].kind &&
           now.trace.moments[m].label == running.moments[m].label;
  }
  if (!same) {
    return no(absl::StrCat("the running trace (", running.size(),
                           " moments) is not the activation plan's (", now.trace.size(), ")"));
  }
  return now;
}

std::vector<std::vector<ActivationChoice>> ActivationPlanner::call_ways() const {
  return planned_ ? ways_of_calls() : std::vector<std::vector<ActivationChoice>>{};
}

std::vector<std::vector<ActivationChoice>> ActivationPlanner::ways_of_calls() const {
  std::vector<std::vector<ActivationChoice>> out;
  for (const Call& c : calls_) {
    if (c.forced) {
      out.push_back({c.measured});
    } else if (c.named) {
      out.push_back(
          {ActivationChoice::kRecompute, ActivationChoice::kOffload, ActivationChoice::kKeep});
    } else {
      out.push_back({ActivationChoice::kRecompute, ActivationChoice::kOffload});
    }
  }
  return out;
}

std::vector<ActivationPlanner::Alternative> ActivationPlanner::alternatives(
    const Trace& running, std::string* why) const {
  std::vector<Alternative> out;
  const std::optional<Shaped> now = running_shape(running, why);
  if (!now) return out;
  for (ActivationChoice every : whole_model_ways()) {
    if (std::optional<Alternative> a = edit(running, *now, every_call(every))) {
      a->every = every;
      out.push_back(std::move(*a));
    }
  }
  return out;
}

std::optional<ActivationPlanner::Alternative> ActivationPlanner::alternative(
    const Trace& running, const std::vector<ActivationChoice>& choices, std::string* why) const {
  const std::optional<Shaped> now = running_shape(running, why);
  if (!now) return std::nullopt;
  if (choices.size() != calls_.size()) {
    if (why != nullptr) {
      *why = absl::StrCat(choices.size(), " ways for ", calls_.size(), " checkpoint calls");
    }
    return std::nullopt;
  }
  std::optional<Alternative> a = edit(running, *now, runs_as(choices));
  if (!a && why != nullptr) *why = "the calls run these ways now";
  return a;
}

std::optional<ActivationPlanner::Alternative> ActivationPlanner::edit(
    const Trace& running, const Shaped& now, const std::vector<ActivationChoice>& choices) const {
  const std::vector<ActivationChoice> running_choices = runs_as(choices_);
  if (choices == running_choices) return std::nullopt;
  const Shaped alt = shape(warmup_, choices, copy_bytes_per_s_, copies_overlap_);
  // Each warm-up moment's compute to add: a newly recomputed call's forward spread over its
  // recompute's moments; a call whose recompute has no moments of its own is charged (or, newly
  // kept, credited) on its backward's moment, which both traces have.
  std::vector<double> share(static_cast<size_t>(warmup_.size()), 0.0);
  double saved = 0;  // newly kept calls' forwards, on the moments the alternative drops
  for (size_t i = 0; i < calls_.size(); ++i) {
    const Call& c = calls_[i];
    const bool kept_now = running_choices[i] == ActivationChoice::kKeep;
    const bool kept_then = choices[i] == ActivationChoice::kKeep;
    if (kept_now == kept_then) continue;
    const int64_t first = c.recompute_begin + 1;
    const int64_t last = std::min(c.recompute_end, warmup_.size() - 1);
    if (last < first) {
      if (c.recompute_begin >= 0 && c.recompute_begin < warmup_.size()) {
        share[static_cast<size_t>(c.recompute_begin)] +=
            kept_now ? c.forward_seconds : -c.forward_seconds;
      }
      continue;
    }
    if (kept_then) {
      saved += c.forward_seconds;
      continue;
    }
    for (int64_t m = first; m <= last; ++m) {
      share[static_cast<size_t>(m)] += c.forward_seconds / static_cast<double>(last - first + 1);
    }
  }
  Alternative a;
  a.choices = choices;
  a.trace.tail_non_model_bytes = running.tail_non_model_bytes;
  size_t k = 0;  // both lists of warm-up moments ascend
  for (size_t m = 0; m < alt.from.size(); ++m) {
    while (k < now.from.size() && now.from[k] < alt.from[m]) ++k;
    const Moment& shaped = alt.trace.moments[m];
    if (k < now.from.size() && now.from[k] == alt.from[m]) {
      Moment moment = running.moments[k];
      moment.non_model_bytes =
          std::max<int64_t>(0, moment.non_model_bytes + shaped.non_model_bytes -
                                   now.trace.moments[k].non_model_bytes);
      a.trace.moments.push_back(std::move(moment));
      a.moment_of.push_back(static_cast<int64_t>(k));
    } else {  // a recompute the running trace skips: the warm-up's moment
      a.trace.moments.push_back(shaped);
      a.moment_of.push_back(-1);
    }
    a.recompute_seconds.push_back(share[static_cast<size_t>(alt.from[m])]);
  }
  a.peak_delta = alt.peak - now.peak;
  a.recompute_saved = saved;
  a.exposed_delta = alt.exposed - (copies_overlap_ ? 0 : now.exposed);
  return a;
}

WaysFound search_ways(std::vector<ActivationChoice> start,
                      const std::vector<std::vector<ActivationChoice>>& ways,
                      const std::function<double(const std::vector<ActivationChoice>&)>& step) {
  WaysFound found;
  found.seconds = step(start);
  found.weighed = 1;
  found.best = std::move(start);
  for (int pass = 0; pass < 2 && std::isfinite(found.seconds); ++pass) {
    bool changed = false;
    for (size_t i = 0; i < ways.size() && i < found.best.size(); ++i) {
      for (ActivationChoice way : ways[i]) {
        if (way == found.best[i]) continue;
        std::vector<ActivationChoice> trial = found.best;
        trial[i] = way;
        const double s = step(trial);
        ++found.weighed;
        if (s < found.seconds * (1 - 1e-9)) {
          found.best = std::move(trial);
          found.seconds = s;
          changed = true;
        }
      }
    }
    if (!changed) break;
  }
  return found;
}

std::vector<double> alternative_compute(const ActivationPlanner::Alternative& a,
                                        const std::vector<double>& running) {
  const int64_t moments = static_cast<int64_t>(running.size());
  std::vector<double> seconds;
  std::vector<double> dropped_after;  // per moment of the alternative
  double dropped = 0;
  int64_t next = 0;  // the next moment of `running` not yet seen
  auto drop_until = [&](int64_t end) {
    for (; next < end; ++next) {
      if (!dropped_after.empty()) dropped_after.back() += running[static_cast<size_t>(next)];
      dropped += running[static_cast<size_t>(next)];
    }
  };
  for (size_t k = 0; k < a.moment_of.size(); ++k) {
    const int64_t m = a.moment_of[k];
    TORCH_CHECK(m < moments, "alternative_compute: moment ", m, " of ", moments, " measured");
    if (m >= 0) {
      drop_until(m);
      next = m + 1;
    }
    seconds.push_back((m >= 0 ? running[static_cast<size_t>(m)] : 0) + a.recompute_seconds[k]);
    dropped_after.push_back(0);
  }
  drop_until(moments);
  const double kept_share = dropped > 0 ? std::max(0.0, 1 - a.recompute_saved / dropped) : 0;
  for (size_t k = 0; k < seconds.size(); ++k) {
    seconds[k] = std::max(0.0, seconds[k] + dropped_after[k] * kept_share);
  }
  return seconds;
}

double ActivationPlanner::unmeasured_exposed_seconds() const {
  if (policy_ != ActivationPolicy::kAuto || !planned_ || warmup_.moments.empty() ||
      choices_.size() != calls_.size() || !copies_overlap_) {
    return 0;
  }
  return shape(warmup_, runs_as(choices_), copy_bytes_per_s_, copies_overlap_).exposed;
}

bool ActivationPlanner::run_alternative(std::optional<ActivationChoice> every) {
  if (!planned_) return false;
  return every
             ? run(every_call(*every), absl::StrCat("every call: ", activation_choice_name(*every)))
             : run(own_choices_, "");
}

bool ActivationPlanner::run_choices(const std::vector<ActivationChoice>& choices) {
  if (!planned_ || choices.size() != calls_.size()) return false;
  const std::vector<ActivationChoice> ways = runs_as(choices);
  std::string named;  // (run() says nothing where these are the plan's own ways)
  for (ActivationChoice way : ways) {
    absl::StrAppend(&named, named.empty() ? "" : ", ", activation_choice_name(way));
  }
  return run(ways, absl::StrCat("per call: ", named));
}

bool ActivationPlanner::run(std::vector<ActivationChoice> choices, std::string instead) {
  const bool changed = runs_as(choices) != runs_as(choices_);
  if (runs_as(choices) == runs_as(own_choices_)) instead.clear();  // the plan's own ways
  choices_ = std::move(choices);
  for (size_t i = 0; i < choices_.size() && i < report_.calls.size(); ++i) {
    report_.calls[i].choice = activation_choice_name(choices_[i]);
  }
  report_.run_plan_instead = std::move(instead);
  return changed;
}

}  // namespace patrickstar::engine_detail
