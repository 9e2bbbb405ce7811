// The overlapped step (zero_optimization.overlap_step; on here): the host Adam of each chunk
// index runs on the optimizer thread during backward and the step commits or undoes it. Whatever
// happens, training must be bit for bit the serial step's: every chunk (weights, fp32 masters,
// momentum, variance) and every loss equal to a run with the overlap off, in each configuration
// below, and the overlap must actually have happened where it can (else these tests prove nothing).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "error_message.h"
#include "gpt_training.h"
#include "patrickstar/engine/engine_inspect.h"
#include "patrickstar/memtracer/export.h"
#include "patrickstar/patrickstar.h"
#include "temp_folder.h"

namespace patrickstar {
namespace overlap_step_test {

using namespace test;  // NOLINT: the shared helpers of gpt_training.h

struct TrainingRun {
  std::vector<double> losses;
  std::vector<at::Tensor> chunks;  // every chunk but the gradient space, after the last step
  int64_t committed = 0;           // summed over the steps
  int64_t undone = 0;
  int64_t cancelled = 0;
  int64_t adam_device = 0;  // chunk indices whose Adam ran on the device / host, last step
  int64_t adam_host = 0;
};

enum class Trainer {
  kPlain,         // zero_grad, forward, backward, step
  kClipsItself,   // LibTorch's clip_grad_norm_ on the parameters between backward and step
  kTwoBackwards,  // two forward/backward passes add up before each step
  kSetsLr,        // set_lr between backward and step
  kEvaluates,     // an evaluation forward (no grad) between backward and step
};

TrainingRun train(const std::string& extra, bool overlap, int steps,
                  Trainer trainer = Trainer::kPlain) {
  nlohmann::json j = nlohmann::json::parse(extra);
  j["zero_optimization"]["overlap_step"] = overlap;
  const bool checkpointed = j.value("checkpointed", false);  // the model's, not the config's
  j.erase("checkpointed");
  // "hybrid_room": a device of the measured non-model peak plus this many bytes for chunks.
  const int64_t room = j.value("hybrid_room", int64_t{0});
  j.erase("hybrid_room");
  Config config = room > 0 ? config_with_chunk_room(j.dump(), room) : tight_config(j.dump());
  models::Gpt model = make_model(1, checkpointed);
  Engine engine(model.ptr(), config);
  TrainingRun run;
  for (int s = 0; s < steps; ++s) {
    engine.zero_grad();
    const int passes = trainer == Trainer::kTwoBackwards ? 2 : 1;
    double loss = 0;
    for (int pass = 0; pass < passes; ++pass) {
      auto batch = on_test_device(batch_of_step(s + pass));
      at::Tensor out;
      {
        auto active = engine.activate();
        out = model->loss(batch.tokens, batch.targets);
      }
      engine.backward(out);
      loss += out.item<double>();
    }
    if (trainer == Trainer::kClipsItself)
      torch::nn::utils::clip_grad_norm_(model->parameters(), 0.05);
    if (trainer == Trainer::kSetsLr) engine.set_lr(3e-3 * (1.0 - 0.05 * s));
    if (trainer == Trainer::kEvaluates) {
      // Its loss is part of the record: it must see the weights of the last step, not ahead.
      torch::NoGradGuard no_grad;
      auto batch = on_test_device(batch_of_step(s + 7));
      auto active = engine.activate();
      loss += 1000 * model->loss(batch.tokens, batch.targets).item<double>();
    }
    const IterationReport report = engine.step();
    run.losses.push_back(loss);
    run.committed += report.early_updates_committed;
    run.undone += report.early_updates_undone;
    run.cancelled += report.early_updates_cancelled;
    run.adam_device = report.adam.chunks_device;
    run.adam_host = report.adam.chunks_host;
  }
  const ChunkStore& store = inspect(engine).chunks();
  for (ChunkId id = 0; id < store.chunk_count(); ++id) {
    if (store.kind_of(id) != ChunkKind::kGrad)
      run.chunks.push_back(store.chunk_view(id).cpu().clone());
  }
  return run;
}

// Bit for bit: equal() on every chunk, the losses as doubles.
void expect_identical(const TrainingRun& overlapped, const TrainingRun& serial) {
  ASSERT_EQ(overlapped.losses.size(), serial.losses.size());
  for (size_t s = 0; s < serial.losses.size(); ++s) {
    EXPECT_EQ(overlapped.losses[s], serial.losses[s]) << "step " << s;
  }
  ASSERT_EQ(overlapped.chunks.size(), serial.chunks.size());
  for (size_t c = 0; c < serial.chunks.size(); ++c) {
    EXPECT_TRUE(torch::equal(overlapped.chunks[c], serial.chunks[c])) << "chunk " << c;
  }
  EXPECT_EQ(serial.committed + serial.undone + serial.cancelled, 0) << "the serial run overlapped";
}

struct Case {
  std::string name;
  std::string extra;  // merged into tight_config
  Trainer trainer = Trainer::kPlain;
  bool commits = true;  // some updates made ahead are committed
  bool undoes = false;  // some are undone
  bool hybrid = false;  // Adam on the device for some indices, on the host for others
};

class OverlapStep : public ::testing::TestWithParam<Case> {};

TEST_P(OverlapStep, TrainsBitForBitAsTheSerialStep) {
  const Case& c = GetParam();
  constexpr int kSteps = 12;
  const TrainingRun serial = train(c.extra, false, kSteps, c.trainer);
  const TrainingRun overlapped = train(c.extra, true, kSteps, c.trainer);
  std::printf(
      "%s: %lld runs committed, %lld undone, %lld indices taken back; Adam of %lld "
      "indices on the device, %lld on the host\n",
      c.name.c_str(), static_cast<long long>(overlapped.committed),
      static_cast<long long>(overlapped.undone), static_cast<long long>(overlapped.cancelled),
      static_cast<long long>(overlapped.adam_device), static_cast<long long>(overlapped.adam_host));
  expect_identical(overlapped, serial);
  if (c.commits) {
    EXPECT_GT(overlapped.committed, 0);
  } else {
    EXPECT_EQ(overlapped.committed, 0);
  }
  if (c.hybrid) {
    EXPECT_GT(overlapped.adam_device, 0);
    EXPECT_GT(overlapped.adam_host, 0);
  }
  if (c.undoes) {
    EXPECT_GT(overlapped.undone + overlapped.cancelled, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, OverlapStep,
    ::testing::Values(
        Case{"fp32", "{}"}, Case{"bf16", R"({"bf16": {"enabled": true}})"},
        // A gradient space in mixed precision: the half weight comes from the master at commit.
        Case{"bf16_accumulation",
             R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 2})",
             Trainer::kTwoBackwards},
        Case{"fp32_accumulation", R"({"gradient_accumulation_steps": 2})", Trainer::kTwoBackwards},
        // Two backward passes before a step with accumulation steps 1 (LibTorch's way): the trace
        // holds both, so only the second one's updates start early.
        Case{"fp32_two_backwards", "{}", Trainer::kTwoBackwards},
        Case{"fp32_clipping_inactive", R"({"gradient_clipping": 1e6})"},
        // Clipped at every step (the warm-up's too): every step runs serially.
        Case{"fp32_clipping_active", R"({"gradient_clipping": 1e-3})", Trainer::kPlain,
             /*commits=*/false},
        // The loss scale doubles after every two steps until the gradients overflow in fp16 (the
        // updates made ahead are undone, the step skipped), then halves, and so on.
        Case{"fp16_overflows",
             R"({"fp16": {"enabled": true, "initial_scale_power": 20, "hysteresis": 1,
                          "loss_scale_window": 2}})",
             Trainer::kPlain, /*commits=*/true, /*undoes=*/true},
        // An evaluation forward between backward and step reads the weights: taken back first.
        Case{"fp32_evaluates_before_step", "{}", Trainer::kEvaluates, /*commits=*/false,
             /*undoes=*/true},
        // A learning rate set between backward and step (a schedule): undone, recomputed.
        Case{"fp32_lr_schedule", "{}", Trainer::kSetsLr, /*commits=*/false, /*undoes=*/true},
        Case{"bf16_checkpointed", R"({"bf16": {"enabled": true}, "checkpointed": true})"},
        // The trainer clips through the grad() views LibTorch shows: its edits undo the overlap.
        Case{"fp32_trainer_clips", "{}", Trainer::kClipsItself, /*commits=*/false,
             /*undoes=*/true},
        // A device with room for some optimizer states: hybrid Adam, some indices on the device.
        Case{"fp32_hybrid", R"({"hybrid_room": 2000000})", Trainer::kPlain, /*commits=*/true,
             /*undoes=*/false, /*hybrid=*/true},
        Case{"fp32_bf16_states", R"({"optimizer": {"params": {"state_dtype": "bf16"}}})"},
        Case{"bf16_bf16_states",
             R"({"bf16": {"enabled": true}, "optimizer": {"params": {"state_dtype": "bf16"}}})"},
        Case{"overlap_memory_bound",
             R"({"zero_optimization": {"overlap_step_max_bytes": 700000}})"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(OverlapStepReport, TheReportAndTheTimelineShowTheOptimizerThread) {
  models::Gpt model = make_model(1);
  // On, whatever the cores ("auto" overlaps on the emulated device only with a core left free).
  Engine engine(model.ptr(), tight_config(R"({"zero_optimization": {"overlap_step": true}})"));
  engine.set_record_timeline(true);
  train_step(engine, model, 0);  // the warm-up: serial
  const IterationReport report = train_step(engine, model, 1);
  ASSERT_GT(report.early_updates_committed, 0);
  EXPECT_GT(report.optimizer_thread_seconds, 0.0);
  EXPECT_GT(report.early_update_buffer_bytes, 0);
  EXPECT_LE(report.early_update_buffer_bytes, engine.config().overlap_step.max_bytes);
  const std::vector<CopySpan> spans = inspect(engine).optimizer_spans();
  ASSERT_FALSE(spans.empty());
  for (const CopySpan& span : spans) {
    EXPECT_NE(span.label.find("adam ahead: chunk index "), std::string::npos) << span.label;
    EXPECT_GE(span.duration_us, 0);
  }
  const std::string trace = chrome_trace_json(inspect(engine).scheduler().moves(),
                                              inspect(engine).scheduler().moment_records(),
                                              engine.config().device.capacity_bytes, {}, spans);
  EXPECT_NE(trace.find("optimizer thread (host Adam ahead)"), std::string::npos);
  // Off from the next backward: nothing is updated ahead, and the undo buffers are given back; on
  // again: it is.
  engine.set_overlap_step(false);
  const IterationReport off = train_step(engine, model, 2);
  EXPECT_EQ(off.early_updates_committed, 0);
  EXPECT_EQ(off.early_update_buffer_bytes, 0);
  engine.set_overlap_step(true);
  EXPECT_GT(train_step(engine, model, 3).early_updates_committed, 0);
}

// Between a backward and its step the optimizer thread has updated some chunk indices ahead (in
// fp32 the parameter chunk it writes is the weight itself). Whatever reads the weights there sees
// the committed ones, the last step's: fp32_state_dict, save_weights, a read-only
// GatheredParameters scope and an evaluation forward each take the updates back first (the step
// says how many it found taken back, so the reads did meet updates made ahead), and the step then
// recomputes them. The optimizer thread against these readers is also run under ThreadSanitizer,
// in StepPipelineAccess (tests/overlap/step_pipeline_test.cpp).
TEST(OverlapStepReads, ReadsBetweenBackwardAndStepSeeTheCommittedWeights) {
  TempFolder folder("ps-overlap-reads");
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config(R"({"zero_optimization": {"overlap_step": true}})"));
  train_step(engine, model, 0);  // the warm-up: serial
  auto expect_committed = [](const std::vector<std::pair<std::string, at::Tensor>>& read,
                             const std::vector<std::pair<std::string, at::Tensor>>& committed,
                             const char* how) {
    ASSERT_EQ(read.size(), committed.size()) << how;
    for (size_t k = 0; k < read.size(); ++k) {
      EXPECT_EQ(read[k].first, committed[k].first) << how;
      EXPECT_TRUE(torch::equal(read[k].second.cpu(), committed[k].second)) << how << ": "
                                                                          << read[k].first;
    }
  };
  enum class Read { kStateDict, kSaveWeights, kGathered, kEvaluation };
  int64_t taken_back = 0;
  for (Read how : {Read::kStateDict, Read::kSaveWeights, Read::kGathered, Read::kEvaluation}) {
    const std::vector<std::pair<std::string, at::Tensor>> committed = engine.fp32_state_dict();
    const int step = 1 + static_cast<int>(how);
    engine.zero_grad();
    auto batch = on_test_device(batch_of_step(step));
    at::Tensor loss;
    {
      auto active = engine.activate();
      loss = model->loss(batch.tokens, batch.targets);
    }
    engine.backward(loss);
    if (how == Read::kStateDict) {
      expect_committed(engine.fp32_state_dict(), committed, "fp32_state_dict");
    } else if (how == Read::kSaveWeights) {
      const std::string path = folder.path() + "/weights.pt";
      engine.save_weights(path);
      models::Gpt loaded = make_model(2);  // other values until the file's are loaded
      torch::load(loaded, path);
      std::vector<std::pair<std::string, at::Tensor>> read;
      for (const auto& item : loaded->named_parameters()) read.emplace_back(item.key(), item.value());
      expect_committed(read, committed, "save_weights");
    } else if (how == Read::kGathered) {
      std::vector<at::Tensor> params = model->parameters();
      GatheredParameters scope(engine, params, GatheredParameters::Mode::kReadOnly);
      std::vector<std::pair<std::string, at::Tensor>> read;
      for (const auto& item : model->named_parameters()) read.emplace_back(item.key(), item.value());
      expect_committed(read, committed, "GatheredParameters");
    } else {
      // The evaluation forward's loss is the one of the committed weights: a fresh model holding
      // them computes the same.
      torch::NoGradGuard no_grad;
      auto eval = on_test_device(batch_of_step(step + 7));
      double engine_loss = 0;
      {
        auto active = engine.activate();
        engine_loss = model->loss(eval.tokens, eval.targets).item<double>();
      }
      models::Gpt plain = make_model(2);
      for (const auto& [name, value] : committed) plain->named_parameters()[name].copy_(value);
      plain->to(eval.tokens.device());
      // (Within 1e-6: LibTorch's kernels may round differently over differently aligned memory;
      // one Adam step moves this loss by far more.)
      const double plain_loss = plain->loss(eval.tokens, eval.targets).item<double>();
      EXPECT_NEAR(engine_loss, plain_loss, 1e-6 * std::abs(plain_loss));
    }
    const IterationReport report = engine.step();
    EXPECT_GT(report.early_updates_cancelled, 0) << "the read met no update made ahead";
    taken_back += report.early_updates_cancelled;
  }
  std::printf("indices taken back by the reads: %lld\n", static_cast<long long>(taken_back));
}

TEST(OverlapStepReport, TheDiskTierUpdatesAtTheStepAndSaysSoWhenAskedToOverlap) {
  TempFolder folder("ps-overlap");
  nlohmann::json extra;
  extra["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"},
                                                     {"nvme_path", folder.path()}};
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config(extra.dump()));
  train_step(engine, model, 0);
  EXPECT_EQ(train_step(engine, model, 1).early_updates_committed, 0);
  EXPECT_THAT(error_of([&] { engine.set_overlap_step(true); }),
              ::testing::HasSubstr("every update runs at the step"));
  engine.set_overlap_step(false);  // off is always fine
}

}  // namespace overlap_step_test
}  // namespace patrickstar

namespace patrickstar {
namespace overlap_step_test {

// "auto" measures: after the warm-up the steady iterations alternate, overlapped first, three each
// way; the iteration that decides says so in its report, and from then on every iteration runs the
// way kept. Which way wins depends on this machine, so the test checks the protocol, and that a
// serial decision gives the undo buffers back. One compute thread leaves a core for the optimizer
// thread (without a free core "auto" never overlaps on the emulated device).
TEST(OverlapStepAuto, MeasuresBothWaysThenKeepsTheFaster) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: auto never overlaps here";
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config());
  ASSERT_EQ(engine.config().overlap_step.mode, OverlapMode::kAuto);
  std::vector<IterationReport> reports;
  for (int s = 0; s < 14; ++s) reports.push_back(train_step(engine, model, s));
  at::set_num_threads(threads);

  std::vector<size_t> decided;
  for (size_t i = 0; i < reports.size(); ++i) {
    if (!reports[i].overlap_step_decision.empty()) decided.push_back(i);
  }
  ASSERT_EQ(decided.size(), 1u) << "one decision";
  const size_t d = decided[0];
  const std::string& line = reports[d].overlap_step_decision;
  std::printf("iteration %zu: %s\n", d, line.c_str());
  ASSERT_GE(d, 6u);
  ASSERT_LT(d + 1, reports.size()) << "an iteration after the decision";
  EXPECT_FALSE(reports[0].early_updates_allowed) << "the warm-up";
  for (size_t i = 0; i + 6 <= d; ++i) {
    EXPECT_FALSE(reports[i].early_updates_allowed) << "iteration " << i << ", before the trial";
  }
  for (size_t k = 0; k < 6; ++k) {
    const IterationReport& r = reports[d - 5 + k];
    EXPECT_EQ(r.early_updates_allowed, k % 2 == 0) << "trial iteration " << k;
    if (!r.early_updates_allowed) {
      EXPECT_EQ(r.early_updates_committed, 0) << "trial iteration " << k;
    }
  }
  const bool kept = line.find("\"auto\": overlapped") != std::string::npos;
  EXPECT_TRUE(kept || line.find("\"auto\": serial") != std::string::npos) << line;
  for (size_t i = d + 1; i < reports.size(); ++i) {
    EXPECT_EQ(reports[i].early_updates_allowed, kept) << "iteration " << i;
    if (!kept) {
      EXPECT_EQ(reports[i].early_updates_committed, 0) << "iteration " << i;
      EXPECT_EQ(reports[i].early_update_buffer_bytes, 0) << "iteration " << i;
    }
  }
  // The overlapped trial iterations did update ahead.
  int64_t committed = 0;
  for (size_t k = 0; k < 6; k += 2) committed += reports[d - 5 + k].early_updates_committed;
  EXPECT_GT(committed, 0);
}

}  // namespace overlap_step_test
}  // namespace patrickstar
