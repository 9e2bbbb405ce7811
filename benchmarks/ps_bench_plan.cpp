// ps_bench --compare-plan: the plan against every candidate it considered, interleaved; and the plan
// in ps_bench's JSON and in a file (--write-plan).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/models/llama.h"
#include "patrickstar/patrickstar.h"
#include "ps_bench_common.h"

namespace ps_bench {

nlohmann::json plan_json(const ps::PlanReport& plan) {
  nlohmann::json candidates = nlohmann::json::array();
  for (const ps::PlanCandidateReport& c : plan.candidates) {
    candidates.push_back({{"name", c.name},
                          {"schedule", c.schedule},
                          {"adam", c.adam},
                          {"activations", c.activations},
                          {"activation_calls", c.activation_calls},
                          {"adam_device_indices", c.adam_device_indices},
                          {"fits", c.fits},
                          {"why_not", c.why_not},
                          {"predicted_step_s", c.predicted_step_seconds},
                          {"compute_s", c.compute_seconds},
                          {"host_adam_s", c.host_adam_seconds},
                          {"exposed_copy_s", c.exposed_copy_seconds},
                          {"device_peak_bytes", c.device_peak_bytes},
                          {"h2d_bytes", c.h2d_bytes},
                          {"d2h_bytes", c.d2h_bytes},
                          {"measured_step_s", c.measured_step_seconds}});
  }
  return {
      {"profile", plan.profile},
      {"candidates", candidates},
      {"chosen", plan.chosen >= 0 ? plan.candidates[static_cast<size_t>(plan.chosen)].name : ""},
      {"why", plan.why},
      {"activation_search", plan.activation_search},
      {"planning_s", plan.planning_seconds},
      {"predicted_step_s", plan.predicted_step_seconds},
      {"measured_step_s", plan.measured_step_seconds},
      {"checked", plan.checked},
      {"replanned", plan.replanned},
      {"check", plan.check}};
}

void write_plan(const ps::PlanReport& plan, const std::string& path) {
  std::ofstream file(path);
  file << plan.config_json() << "\n";
  file.close();
  TORCH_CHECK(file.good(), "--write-plan: could not write ", path);
  std::printf("wrote the plan's settings to %s (merge them into a config to pin them)\n",
              path.c_str());
}

// One engine of the comparison: the planning one, or a candidate pinned.
struct PlanModeResult {
  std::string name;
  std::string schedule = {}, adam = {};  // a candidate's; empty for the planning engine
  int64_t chunk_elems = 0;
  std::string activations = {};  // a candidate's other activation policy, if any
  std::vector<std::string> activation_calls = {};  // its calls' ways ("auto" activations)
  std::string refused = {};
  std::vector<double> times = {}, losses = {};
  bool trained = false;
};

namespace {

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// `base` with the settings of `c` pinned ("plan": "off").
ps::Config pinned(const ps::Config& base, const ps::PlanReport& plan, size_t c) {
  ps::PlanReport one = plan;
  one.chosen = static_cast<int>(c);
  nlohmann::json j = base.to_json();
  j.merge_patch(nlohmann::json::parse(one.config_json()));
  return ps::Config::from_json(j);
}

// An engine with "plan": "auto" trained until it planned (two steps, more where "auto"'s chunk
// size moved the model first): its candidates.
template <class Spec>
ps::PlanReport first_plan(const ps::Config& base, const Spec& spec, int64_t batch, int64_t seq,
                          uint64_t seed) {
  auto [model, optimizer] = build_engine(spec, base, seed);
  for (int64_t r = 0; r < 6 && !model.engine().plan().planned; ++r) {
    auto data = batch_of(spec, base, batch, seq, seed + 1 + static_cast<uint64_t>(r));
    train_step(model, optimizer, data.tokens, data.targets);
  }
  return model.engine().plan();
}

// The table of every candidate's predicted and measured median step and the plan's against the
// best (printed), into `out`.
void report_comparison(const ps::PlanReport& plan, const std::vector<PlanModeResult>& modes,
                       int64_t first_steady, int64_t steps, nlohmann::json& out) {
  const ps::PlanCandidateReport& chosen = plan.candidates[static_cast<size_t>(plan.chosen)];
  double best = 0;
  std::string best_name;
  for (size_t i = 1; i < modes.size(); ++i) {
    if (modes[i].trained && (best == 0 || median(modes[i].times) < best)) {
      best = median(modes[i].times);
      best_name = modes[i].name;
    }
  }
  TORCH_CHECK(best > 0, "--compare-plan: no pinned candidate trained");
  const double planned = median(modes[0].times);
  out["plan"] = plan_json(plan);
  std::printf(
      "\nmedian steps over steps %lld..%lld (turns of 3 steps per engine, each turn's first left "
      "out); predicted: the planning engine's cost model\n",
      static_cast<long long>(first_steady + 1), static_cast<long long>(steps));
  int width = 62;  // the longest name's
  for (const PlanModeResult& m : modes) width = std::max(width, static_cast<int>(m.name.size()));
  std::printf("%-*s %12s %12s %10s %10s\n", width, "candidate", "predicted s", "measured s",
              "meas/pred", "x best");
  double spread_min = 0, spread_max = 0;
  bool same_losses = true;
  // The losses each engine must match: the planning engine's for the candidates of its kind (exact,
  // or the delayed update where the config allows it and the plan chose it), else the first
  // trained candidate's of the other kind.
  const bool plan_delayed = chosen.schedule == "delayed";
  const std::vector<double>* other_kind = nullptr;
  for (size_t i = 1; i < modes.size() && other_kind == nullptr; ++i) {
    if (modes[i].trained && (modes[i].schedule == "delayed") != plan_delayed) {
      other_kind = &modes[i].losses;
    }
  }
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 1; i < modes.size(); ++i) {
    const PlanModeResult& m = modes[i];
    const ps::PlanCandidateReport* p = nullptr;
    for (const ps::PlanCandidateReport& c : plan.candidates) {
      // (Each engine plans its own activations: a prediction for other ways is not this one's.)
      if (c.chunk_elems == m.chunk_elems && c.schedule == m.schedule && c.adam == m.adam &&
          c.activations == m.activations && c.activation_calls == m.activation_calls) {
        p = &c;
      }
    }
    const double predicted = p != nullptr && p->fits ? p->predicted_step_seconds : 0;
    nlohmann::json row = {{"name", m.name}, {"predicted_step_s", predicted}};
    if (!m.trained) {
      std::printf("%-*s %12.5f %12s   refused: %.200s\n", width, m.name.c_str(), predicted, "-",
                  m.refused.c_str());
      row["refused"] = m.refused;
      rows.push_back(row);
      continue;
    }
    const double measured = median(m.times);
    const double ratio = predicted > 0 ? measured / predicted : 0;
    if (ratio > 0) {
      spread_min = spread_min == 0 ? ratio : std::min(spread_min, ratio);
      spread_max = std::max(spread_max, ratio);
    }
    const bool same_kind = (m.schedule == "delayed") == plan_delayed;
    same_losses = same_losses && m.losses == (same_kind ? modes[0].losses : *other_kind);
    std::printf("%-*s %12.5f %12.5f %10.3f %10.3f\n", width, m.name.c_str(), predicted, measured,
                ratio, measured / best);
    row["measured_step_s"] = measured;
    row["measured_over_predicted"] = ratio;
    row["to_best"] = measured / best;
    rows.push_back(row);
  }
  const double to_best = planned / best;
  std::printf("%-*s %12.5f %12.5f %10.3f %10.3f\n", width,
              absl::StrCat("plan: ", chosen.name, plan.replanned ? " (planned again)" : "").c_str(),
              chosen.predicted_step_seconds, planned, planned / chosen.predicted_step_seconds,
              to_best);
  std::printf(
      "plan within 5%% of the best measured candidate (%s): %s; measured over predicted "
      "from %.3f to %.3f; every engine's losses equal the planning one's (the other kind's, exact "
      "or delayed, each other's): %s\n",
      best_name.c_str(), to_best <= 1.05 ? "yes" : "NO", spread_min, spread_max,
      same_losses ? "yes" : "NO");
  if (!plan.check.empty()) std::printf("the plan's own check: %s\n", plan.check.c_str());
  out["candidates"] = rows;
  out["plan_step_s"] = planned;
  out["best_candidate"] = best_name;
  out["best_step_s"] = best;
  out["plan_to_best"] = to_best;
  out["plan_within_5_percent"] = to_best <= 1.05;
  out["measured_over_predicted_min"] = spread_min;
  out["measured_over_predicted_max"] = spread_max;
  out["losses_equal"] = same_losses;
}

}  // namespace

template <class Spec>
int compare_plan(const ps::Config& base, Spec spec, int64_t batch, int64_t seq, int64_t steps,
                 uint64_t seed) {
  TORCH_CHECK(steps >= 7,
              "--compare-plan needs --steps >= 7 (the warm-up, the measured iteration, "
              "a second warm-up where the plan moves Adam or the model, and steady steps; 16 or "
              "more leave the first 6 out)");
  std::printf(
      "compare-plan: %s, %lld parameters, %s, batch %lld, seq %lld, %lld steps per engine, device "
      "%s, %d intra-op threads\n",
      spec.name.c_str(), static_cast<long long>(spec.parameter_count()),
      std::string(ps::to_string(base.precision())).c_str(), static_cast<long long>(batch),
      static_cast<long long>(seq), static_cast<long long>(steps),
      mib(static_cast<double>(base.device.capacity_bytes)).c_str(), torch::get_num_threads());
  std::fflush(stdout);
  // The candidates: a first engine's plan (then gone), so that every engine starts together.
  const ps::PlanReport considered = first_plan(base, spec, batch, seq, seed);
  TORCH_CHECK(considered.planned, "--compare-plan: the engine made no plan in six steps");
  struct Mode {
    PlanModeResult r;
    std::optional<decltype(build_engine(spec, base, seed))> engine = std::nullopt;
  };
  std::vector<Mode> modes;
  modes.push_back({{"plan \"auto\""}});
  for (const ps::PlanCandidateReport& c : considered.candidates) {
    modes.push_back(
        {{c.name, c.schedule, c.adam, c.chunk_elems, c.activations, c.activation_calls}});
  }
  for (size_t i = 0; i < modes.size(); ++i) {
    try {
      modes[i].engine.emplace(build_engine(spec, i == 0 ? base : pinned(base, considered, i - 1),
                                           seed));
    } catch (const std::exception& e) {
      modes[i].r.refused = first_line(e.what());
    }
  }
  // After the warm-ups: the planning engine's (and a second one where the plan moves Adam or the
  // model), and the ones where "auto" moves the model into smaller chunks first.
  const int64_t first_steady = steps >= 16 ? 6 : 4;
  // Each engine trains kBlock consecutive steps per turn, the order of the engines rotating per
  // turn: a delayed update's thread then runs beside its own engine's next forward and backward,
  // as in training. After its turn the update in flight is waited for, untimed (set_lr(lr()) waits
  // and writes nothing), so that no engine's time carries another's thread. A turn's first step
  // (caches cold, a predecessor's update found done) is left out, with the steps before
  // first_steady.
  constexpr int64_t kBlock = 3;
  for (int64_t turn = 0; turn * kBlock < steps; ++turn) {
    for (size_t k = 0; k < modes.size(); ++k) {
      Mode& m = modes[(static_cast<size_t>(turn) + k) % modes.size()];
      for (int64_t b = 0; b < kBlock && turn * kBlock + b < steps && m.engine; ++b) {
        const int64_t s = turn * kBlock + b;
        auto data = batch_of(spec, base, batch, seq, seed + 1 + static_cast<uint64_t>(s));
        auto& [model, optimizer] = *m.engine;
        try {
          const auto start = Clock::now();
          const auto [loss, report] = train_step(model, optimizer, data.tokens, data.targets);
          finish_device_work(base);
          const double t = seconds_since(start);
          m.r.losses.push_back(loss.template item<double>());
          if (s >= first_steady && b > 0) m.r.times.push_back(t);
          if (&m == &modes[0] && !report.plan_decision.empty()) {
            std::printf("step %lld, the planning engine:\n    %s\n", static_cast<long long>(s + 1),
                        report.plan_decision.c_str());
          }
        } catch (const std::exception& e) {
          m.r.refused = first_line(e.what());
          m.engine.reset();
        }
      }
      if (m.engine) m.engine->first.engine().set_lr(m.engine->first.engine().lr());
    }
    std::printf("steps %lld/%lld done\n",
                static_cast<long long>(std::min(steps, (turn + 1) * kBlock)),
                static_cast<long long>(steps));
    std::fflush(stdout);
  }
  TORCH_CHECK(modes[0].engine, "--compare-plan: the planning engine failed: ", modes[0].r.refused);
  const ps::PlanReport plan = modes[0].engine->first.engine().plan();
  TORCH_CHECK(plan.planned && plan.chosen >= 0, "--compare-plan: the planning engine made no plan");
  std::vector<PlanModeResult> results;
  for (Mode& m : modes) {
    m.r.trained = m.engine.has_value();
    results.push_back(std::move(m.r));
  }
  nlohmann::json out = {{"model", spec.name},
                        {"params", spec.parameter_count()},
                        {"dtype", std::string(ps::to_string(base.precision()))},
                        {"batch", batch},
                        {"seq", seq},
                        {"steps", steps},
                        {"first_steady_step", first_steady + 1},
                        {"device_capacity_bytes", base.device.capacity_bytes},
                        {"intra_op_threads", torch::get_num_threads()}};
  report_comparison(plan, results, first_steady, steps, out);
  write_json_if_asked(out);
  return 0;
}

template int compare_plan(const ps::Config&, ps::models::GptSpec, int64_t, int64_t, int64_t,
                          uint64_t);
template int compare_plan(const ps::Config&, ps::models::LlamaSpec, int64_t, int64_t, int64_t,
                          uint64_t);

}  // namespace ps_bench
