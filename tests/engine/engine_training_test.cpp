// Training through the engine against plain LibTorch training of the same model, from the same
// initial weights on the same data (issue: engine). The device capacity is chosen so that chunks
// are evicted in every iteration; the tests check that they were.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <string>

#include <unistd.h>

#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/simulator.h"
#include "gpt_training.h"
#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace engine_training_test {

using models::Gpt;
using models::GptSpec;

using namespace test;  // NOLINT: the shared helpers of gpt_training.h

// On the emulated device, or on the CUDA engine with PATRICKSTAR_TEST_DEVICE=cuda.
class EngineTraining : public OnTestDevice {};

constexpr int kSteps = 20;

struct EngineRun {
  std::vector<double> losses;
  std::vector<IterationReport> reports;
  int64_t moments_checked = 0;  // moments whose chunk + non-model bytes were within the capacity
  int64_t moments_over = 0;
};

EngineRun train_engine(const Config& config, int steps, int first_step = 0,
                       Engine* existing = nullptr, const std::string& save_at_10 = "") {
  std::shared_ptr<Engine> owned;
  std::shared_ptr<models::GptImpl> module;
  Engine* engine = existing;
  if (engine == nullptr) {
    Gpt model = make_model(1);
    module = model.ptr();
    owned = std::make_shared<Engine>(module, config);
    engine = owned.get();
  }
  auto* gpt = dynamic_cast<models::GptImpl*>(&engine->module());
  engine->set_record_timeline(true);  // callers read the moves and moments
  EngineRun run;
  const int micro = config.gradient_accumulation_steps;
  for (int s = first_step; s < first_step + steps; ++s) {
    auto batch = on_test_device(batch_of_step(s));
    engine->zero_grad();
    double loss_sum = 0;
    for (int k = 0; k < micro; ++k) {
      const int64_t rows = kBatch / micro;
      at::Tensor loss;
      {
        auto active = engine->activate();
        loss = gpt->loss(batch.tokens.narrow(0, k * rows, rows),
                         batch.targets.narrow(0, k * rows, rows));
      }
      engine->backward(loss);
      loss_sum += loss.item<double>();
    }
    run.reports.push_back(engine->step());
    for (const MomentRecord& m : inspect(*engine).scheduler().moment_records()) {
      if (m.iteration != s - first_step || m.non_model_bytes < 0) continue;
      ++run.moments_checked;
      if (m.chunk_bytes + m.non_model_bytes > config.device.capacity_bytes) ++run.moments_over;
    }
    run.losses.push_back(loss_sum / micro);
    if (!save_at_10.empty() && s + 1 == 10) engine->save_checkpoint(save_at_10);
  }
  return run;
}

void expect_evictions_after_warmup(const EngineRun& run) {
  for (size_t i = 0; i < run.reports.size(); ++i) {
    const IterationReport& r = run.reports[i];
    std::printf("iteration %zu: h2d %lld d2h %lld evictions %lld device chunk peak %lld non-model "
                "peak %lld adam device/host chunks %lld/%lld\n",
                i, static_cast<long long>(r.h2d_bytes), static_cast<long long>(r.d2h_bytes),
                static_cast<long long>(r.evictions),
                static_cast<long long>(r.device_chunk_peak_bytes),
                static_cast<long long>(r.non_model_peak_bytes),
                static_cast<long long>(r.adam.chunks_device),
                static_cast<long long>(r.adam.chunks_host));
    if (i == 0) continue;
    EXPECT_GT(run.reports[i].evictions, 0) << "iteration " << i << " evicted nothing";
    EXPECT_GT(run.reports[i].h2d_bytes, 0) << "iteration " << i;
  }
}

TEST_F(EngineTraining, Fp32MatchesPlainLibTorchWithEvictionsEveryIteration) {
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun run = train_engine(tight_config(), kSteps);
  ASSERT_EQ(run.losses.size(), plain.size());
  EXPECT_LE(max_relative_difference(run.losses, plain), 1e-5);
  EXPECT_LT(plain.back(), plain.front()) << "the reference must actually train";
  expect_evictions_after_warmup(run);
  // The guarantee: at every moment after the warm-up, resident chunks plus the non-model bytes the
  // trace measured for the interval fit the device.
  EXPECT_GT(run.moments_checked, (kSteps - 1) * 30);
  EXPECT_EQ(run.moments_over, 0);
  std::printf("fp32: max relative loss difference %.3g over %d steps\n",
              max_relative_difference(run.losses, plain), kSteps);
}

TEST_F(EngineTraining, Fp32WithoutHybridAdamMatchesToo) {
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun run = train_engine(
      tight_config(R"({"optimizer": {"params": {"use_hybrid_adam": false}}})"), kSteps);
  EXPECT_LE(max_relative_difference(run.losses, plain), 1e-5);
  for (const auto& r : run.reports) EXPECT_EQ(r.adam.chunks_device, 0);
  // No norm read from the device: the loss check alone (on CUDA the host Adam's copies wait too).
  if (!test::on_cuda()) {
    for (size_t i = 2; i < run.reports.size(); ++i) EXPECT_EQ(run.reports[i].host_syncs, 1) << i;
  }
}

TEST_F(EngineTraining, HybridAdamRunsOnTheDeviceWhenTheModelFits) {
  const std::vector<double> plain = train_plain(6);
  const EngineRun run = train_engine(
      tight_config(R"({"client": {"device": {"capacity_bytes": 268435456}}})"), 6);
  EXPECT_LE(max_relative_difference(run.losses, plain), 1e-5);
  const IterationReport& last = run.reports.back();
  EXPECT_GT(last.adam.chunks_device, 0);
  EXPECT_EQ(last.adam.chunks_host, 0);
  // Everything fits: after the warm-up nothing moves, and the host waits for the device twice per
  // iteration (the loss's finiteness check and the gradient norm's one read), on CUDA as on the
  // emulated device. The entry points (doors, hooks) report their host time.
  for (size_t i = 2; i < run.reports.size(); ++i) {
    EXPECT_EQ(run.reports[i].h2d_bytes, 0) << "iteration " << i;
    EXPECT_EQ(run.reports[i].d2h_bytes, 0) << "iteration " << i;
    EXPECT_EQ(run.reports[i].host_syncs, 2) << "iteration " << i;
    EXPECT_GT(run.reports[i].engine_entries, 0) << "iteration " << i;
    EXPECT_GT(run.reports[i].engine_host_seconds, 0.0) << "iteration " << i;
  }
  EXPECT_EQ(run.reports[2].engine_entries, run.reports[3].engine_entries);
}

// The scheduler's traffic against the OPT bound of the same trace and budgets (memtracer's
// opt_traffic_bound), including the chunks the host-side Adam needs on the host at the step. The
// mean is over iterations 2..9: iteration 1 still moves the warm-up's placement into the schedule.
// The main job's target is <= 1.02x the bound; with unequal chunk sizes (bf16, and fp32 too since
// one process cuts its last chunk) the bound is Belady by bytes, an estimate, and the same target
// is held.
TEST_F(EngineTraining, TrafficWithinTwoPercentOfTheOptBound) {
  struct Case {
    const char* name;
    std::string extra;
  };
  for (const Case& c : {Case{"fp32 hybrid", "{}"},
                        Case{"fp32 host Adam", R"({"optimizer": {"params": {"use_hybrid_adam": false}}})"},
                        Case{"bf16 hybrid", R"({"bf16": {"enabled": true}})"}}) {
    const Config config = tight_config(c.extra);
    Gpt model = make_model(1);
    Engine engine(model.ptr(), config);
    const EngineRun run = train_engine(config, 10, 0, &engine);
    double traffic = 0;
    for (size_t i = 2; i < run.reports.size(); ++i) {
      traffic += static_cast<double>(run.reports[i].h2d_bytes + run.reports[i].d2h_bytes);
    }
    traffic /= static_cast<double>(run.reports.size() - 2);
    const TrafficBound bound = opt_traffic_bound(inspect(engine).tracer().warmup_trace(),
                                                 inspect(engine).scheduler().chunks(),
                                                 inspect(engine).scheduler().options());
    const double bound_bytes = static_cast<double>(bound.h2d_bytes + bound.d2h_bytes) /
                               static_cast<double>(bound.period_iterations);
    std::printf("%s: traffic %.0f bytes per iteration, OPT bound %.0f (%s), ratio %.4f, host-Adam "
                "chunks %lld\n",
                c.name, traffic, bound_bytes, bound.proven ? "proven" : "estimate",
                traffic / bound_bytes, static_cast<long long>(run.reports.back().adam.chunks_host));
    EXPECT_GT(bound_bytes, 0) << c.name << ": the device should force moves";
    EXPECT_LE(traffic, 1.02 * bound_bytes) << c.name;
  }
}

// The warm-up knows no activation sizes yet, so it gives chunks only a share of the device (the
// default warmup_gpu_chunk_mem_ratio, 0.1, here a single chunk) next to what the moments need.
// Its own loads (the warm start, which places chunks for the first scheduled iteration, apart)
// stay within 2x those of a steady iteration, or within 2x the bytes of the chunks the iteration
// accesses when the device holds nearly everything (a warm-up starts with every chunk on the host
// and must load each at least once, while a steady iteration may load almost nothing). Keeping
// only the current moment's chunks sent the two chunks a GPT block straddles back and forth at
// every moment: 3.4x a steady iteration here in fp32 (issue: scale).
TEST_F(EngineTraining, WarmupLoadsWithinTwiceASteadyIteration) {
  struct Case {
    const char* name;
    std::string extra;
    int64_t chunk_room;  // device bytes for chunks next to the measured non-model peak; 0: tight_config's device
    bool nearly_fits;    // the steady iterations load less than the chunks they access
  };
  for (const Case& c :
       {Case{"fp32", R"({"client": {"mem_tracer": {"warmup_gpu_chunk_mem_ratio": 0.1}}})", 0, false},
        Case{"bf16", R"({"bf16": {"enabled": true},
                         "client": {"mem_tracer": {"warmup_gpu_chunk_mem_ratio": 0.1}}})", 280000,
             false},
        Case{"bf16, most chunks resident", R"({"bf16": {"enabled": true},
                         "client": {"mem_tracer": {"warmup_gpu_chunk_mem_ratio": 0.1}}})", 2500000,
             true}}) {
    const Config config =
        c.chunk_room > 0 ? config_with_chunk_room(c.extra, c.chunk_room) : tight_config(c.extra);
    Gpt model = make_model(1);
    Engine engine(model.ptr(), config);
    const EngineRun run = train_engine(config, 6, 0, &engine);
    double steady = 0;
    for (size_t i = 2; i < run.reports.size(); ++i) {
      steady += static_cast<double>(run.reports[i].h2d_bytes);
    }
    steady /= static_cast<double>(run.reports.size() - 2);
    const IterationReport& warmup = run.reports.front();
    ASSERT_TRUE(warmup.warmup);
    EXPECT_GE(warmup.warm_start_h2d_bytes, 0);
    EXPECT_LE(warmup.warm_start_h2d_bytes, warmup.h2d_bytes);
    const double own = static_cast<double>(warmup.h2d_bytes - warmup.warm_start_h2d_bytes);
    std::set<int64_t> accessed;
    for (const Moment& moment : inspect(engine).tracer().warmup_trace().moments) {
      accessed.insert(moment.chunk_ids.begin(), moment.chunk_ids.end());
    }
    double cold = 0;  // every accessed chunk loaded once
    for (int64_t id : accessed) {
      cold += static_cast<double>(inspect(engine).scheduler().chunks().at(id).bytes);
    }
    std::printf("%s: warm-up loads %.0f bytes (its own %.0f, warm start %lld), steady %.0f per "
                "iteration, accessed chunks %.0f: own / steady %.2fx, own / max(steady, accessed) "
                "%.2fx\n",
                c.name, static_cast<double>(warmup.h2d_bytes), own,
                static_cast<long long>(warmup.warm_start_h2d_bytes), steady, cold, own / steady,
                own / std::max(steady, cold));
    EXPECT_GT(steady, 0) << c.name << ": the device should force moves";
    EXPECT_LE(own, 2.0 * std::max(steady, cold)) << c.name;
    EXPECT_EQ(steady < cold, c.nearly_fits) << c.name << ": not the regime meant";
    EXPECT_EQ(run.moments_over, 0) << c.name;
  }
}

// use_cpu_embedding: wte and wpe get chunks of their own that stay on the host (the embedding and
// the tied LM head read them there; their Adam runs on the host). Training is unchanged.
TEST_F(EngineTraining, CpuEmbeddingMatchesPlainLibTorchAndStaysOnTheHost) {
  const std::vector<double> plain = train_plain(kSteps);
  const Config config = tight_config(R"({"use_cpu_embedding": true})");
  Gpt model = make_model(1);
  Engine engine(model.ptr(), config);
  const ChunkStore& store = inspect(engine).chunks();
  int64_t host_only = 0;
  for (int64_t i = 0; i < store.chunks_per_kind(); ++i) {
    if (!inspect(engine).host_only(i)) continue;
    ++host_only;
    for (TensorId t : store.layout().tensors_in_chunk(i)) {
      const std::string& name = store.layout().name(t);
      EXPECT_TRUE(name == "wte.weight" || name == "wpe.weight") << name << " in a host chunk";
    }
  }
  EXPECT_EQ(host_only, 1) << "wte and wpe (34816 elements) share one chunk of 40000";
  const EngineRun run = train_engine(config, kSteps, 0, &engine);
  EXPECT_LE(max_relative_difference(run.losses, plain), 1e-5);
  expect_evictions_after_warmup(run);
  for (const Moment& m : inspect(engine).tracer().warmup_trace().moments) {
    for (int64_t c : m.chunk_ids) {
      EXPECT_FALSE(inspect(engine).host_only(store.index_of(c))) << "moment " << m.label << " loads " << c;
    }
  }
  for (const MoveEvent& move : inspect(engine).scheduler().moves()) {
    EXPECT_FALSE(inspect(engine).host_only(store.index_of(move.chunk_id))) << "chunk " << move.chunk_id;
  }
  for (int64_t i = 0; i < store.chunks_per_kind(); ++i) {
    if (inspect(engine).host_only(i)) {
      EXPECT_FALSE(inspect(engine).adam_on_device()[i]);
    }
  }
  EXPECT_GE(run.reports.back().adam.chunks_host, 1);
}

TEST_F(EngineTraining, GradientAccumulationOfFourMicroBatchesEqualsOneBatchOfFour) {
  const std::vector<double> plain = train_plain(8);
  const EngineRun run = train_engine(tight_config(R"({"gradient_accumulation_steps": 4})"), 8);
  // Losses are averaged over the micro-batches, gradients summed in another order: rounding only.
  EXPECT_LE(max_relative_difference(run.losses, plain), 1e-5);
}

TEST_F(EngineTraining, Bf16TracksFp32WithinTwoPercent) {
  // bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2%) in weights, activations and
  // gradients; the fp32 master keeps the updates exact. Over 20 steps the loss stays within 2% of
  // fp32 training, which is what this test holds it to.
  const std::vector<double> plain = train_plain(kSteps);
  // A device of this CPU's bf16 non-model peak plus three param chunks (80000 bytes each).
  const EngineRun run = train_engine(config_with_chunk_room(R"({"bf16": {"enabled": true}})", 240000),
                                     kSteps);
  EXPECT_LE(max_relative_difference(run.losses, plain), 2e-2);
  std::printf("bf16: max relative loss difference to fp32 %.3g over %d steps\n",
              max_relative_difference(run.losses, plain), kSteps);
  expect_evictions_after_warmup(run);
}

TEST_F(EngineTraining, Fp16WithDynamicLossScalingTracksFp32) {
  // fp16 keeps 11 significant bits; gradients are scaled by the loss scale (2^8 here, so the first
  // steps need not overflow) and unscaled inside the update. Any overflow skips a step, which
  // would move the curve away from fp32: the test holds fp16 to 2% of fp32 and checks the scale.
  const std::vector<double> plain = train_plain(kSteps);
  const EngineRun run = train_engine(
      tight_config(R"({"fp16": {"enabled": true, "initial_scale_power": 8, "loss_scale_window": 5},
                       "client": {"device": {"capacity_bytes": 1300000}}})"),
      kSteps);
  int skipped = 0;
  for (const auto& r : run.reports) skipped += r.skipped ? 1 : 0;
  EXPECT_EQ(skipped, 0);
  EXPECT_EQ(run.reports.front().loss_scale, 256.0);
  EXPECT_GT(run.reports.back().loss_scale, 256.0) << "the scale grows after clean windows";
  EXPECT_LE(max_relative_difference(run.losses, plain), 2e-2);
  std::printf("fp16: max relative loss difference to fp32 %.3g over %d steps\n",
              max_relative_difference(run.losses, plain), kSteps);
}

TEST_F(EngineTraining, ResumedRunContinuesBitExactly) {
  // Per process: ctest runs this test and its CPU-capability reruns at the same time.
  const std::string path =
      ::testing::TempDir() + "/ps_engine_resume_" + std::to_string(::getpid()) + ".pt";
  const EngineRun full = train_engine(tight_config(), kSteps, 0, nullptr, path);

  Gpt fresh = make_model(999);  // other initial weights: the checkpoint must replace them
  Engine resumed(fresh.ptr(), tight_config());
  resumed.load_checkpoint(path);
  const EngineRun rest = train_engine(tight_config(), kSteps - 10, 10, &resumed);
  for (int i = 0; i < kSteps - 10; ++i) {
    EXPECT_EQ(rest.losses[i], full.losses[10 + i]) << "step " << 10 + i;
  }
  std::remove(path.c_str());
}

TEST_F(EngineTraining, WeightsSaveAsAPlainLibTorchArchive) {
  const std::string path =
      ::testing::TempDir() + "/ps_engine_weights_" + std::to_string(::getpid()) + ".pt";
  Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  train_engine(tight_config(), 2, 0, &engine);
  engine.save_weights(path);
  Gpt plain = make_model(5);
  torch::load(plain, path);  // no patrickstar involved in reading it
  const auto weights = engine.fp32_state_dict();
  for (const auto& [name, value] : weights) {
    EXPECT_TRUE(torch::equal(plain->named_parameters()[name], value)) << name;
  }
  std::remove(path.c_str());
}

}  // namespace engine_training_test
}  // namespace patrickstar
