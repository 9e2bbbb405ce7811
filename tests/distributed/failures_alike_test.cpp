// Every rank fails alike: a failure injected on one rank only (the last) during registration, a
// deferred initializer, a checkpoint load or save gives every rank the same error, naming the rank
// and its message, within the collective timeout; the ranks go on (or are refused) together and
// none waits forever. (The step: DataParallel.AStepOneRankCannotTakeIsDiscardedOnEveryRank.) Run
// under mpirun at 2 and 4 ranks (distributed.mpi_*_ranks); with one process there is nothing to
// agree on and the tests skip.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "checkpoint_tensors.h"
#include "data_parallel_helpers.h"
#include "error_message.h"
#include "patrickstar/chunk/allocation_faults.h"
#include "patrickstar/engine/deferred_init.h"

namespace patrickstar {
namespace failures_alike_test {

using namespace test;  // NOLINT: the shared helpers of the data parallel tests

bool last() {
  return me() == ranks() - 1;
}

// The error every rank saw is the same text on every rank (compared with rank 0's).
void expect_same_everywhere(const std::string& error) {
  int64_t length = static_cast<int64_t>(error.size());
  comm()->broadcast(at::from_blob(&length, {1}, at::kLong), 0);
  std::string zero = error;
  zero.resize(static_cast<size_t>(length) + 1);
  comm()->broadcast(at::from_blob(zero.data(), {length + 1}, at::kByte), 0);
  zero.resize(static_cast<size_t>(length));
  EXPECT_EQ(error, zero) << "rank " << me() << "'s error differs from rank 0's";
}

std::string failing_rank() {
  return "rank " + std::to_string(ranks() - 1) + " of " + std::to_string(ranks());
}

TEST(FailuresAlike, ARegistrationOneRankCannotHoldIsRefusedOnEveryRank) {
  if (ranks() == 1) GTEST_SKIP() << "one process";
  // The last rank's host budget cannot hold its share of the model data.
  const Config config =
      tight_config(last() ? R"({"client": {"device": {"host_capacity_bytes": 65536}}})" : "{}");
  models::Gpt model = make_model(1);
  const std::string error = error_of([&] { Engine engine(model.ptr(), config, comm()); });
  EXPECT_NE(error.find("registration failed on " + failing_rank()), std::string::npos) << error;
  EXPECT_NE(error.find("host memory"), std::string::npos) << error;
  expect_same_everywhere(error);
  // The ranks go on together: an engine with a budget that fits trains.
  models::Gpt again = make_model(1);
  Engine engine(again.ptr(), tight_config(), comm());
  for (double loss : train_steps(engine, again, 0, 2, /*sharded=*/true)) {
    EXPECT_TRUE(std::isfinite(loss));
  }
}

// A module whose deferred parameters' initializer throws on the last rank only: eight layers in
// several chunks, so every rank owns (and initializes) some.
struct FailsOnOneRank : torch::nn::Module, ParameterInitializer {
  FailsOnOneRank() {
    for (int i = 0; i < 8; ++i) {
      layers.push_back(register_module("inner" + std::to_string(i), torch::nn::Linear(150, 150)));
      defer_parameters(*layers.back());
    }
  }
  void initialize_parameter(const std::string& name, at::Tensor& value) const override {
    TORCH_CHECK(!last(), "no value for ", name, " here");
    value.fill_(0.25);
  }
  std::vector<torch::nn::Linear> layers;
};

TEST(FailuresAlike, ADeferredInitializerThatThrowsOnOneRankFailsEveryRank) {
  if (ranks() == 1) GTEST_SKIP() << "one process";
  auto model = std::make_shared<FailsOnOneRank>();
  const std::string error = error_of([&] { Engine engine(model, tight_config(), comm()); });
  EXPECT_NE(error.find("registration failed on " + failing_rank()), std::string::npos) << error;
  EXPECT_NE(error.find("no value for inner"), std::string::npos) << error;
  expect_same_everywhere(error);
}

TEST(FailuresAlike, ALoadOneRankCannotDoChangesNothingOnAnyRank) {
  if (ranks() == 1) GTEST_SKIP() << "one process";
  const std::string path = shared_path("ps_fail_load_");
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config(), comm());
  train_steps(engine, model, 0, 2, /*sharded=*/true);
  engine.save_checkpoint(path);
  train_steps(engine, model, 2, 3, /*sharded=*/true);
  const auto before = engine.fp32_state_dict();
  // The last rank's first allocation in the load fails (the buffer of the first tensor it reads).
  if (last()) allocation_faults::arm(1);
  const std::string error = error_of([&] { engine.load_checkpoint(path); });
  const bool fired = allocation_faults::fired();
  allocation_faults::disarm();
  EXPECT_TRUE(fired || !last());
  EXPECT_NE(error.find("load_checkpoint(\"" + path + "\") failed on " + failing_rank()),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("nothing was loaded on any rank"), std::string::npos) << error;
  expect_same_everywhere(error);
  const auto after = engine.fp32_state_dict();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
  }
  // Every rank trains on, and the checkpoint still loads everywhere.
  for (double loss : train_steps(engine, model, 3, 4, /*sharded=*/true)) {
    EXPECT_TRUE(std::isfinite(loss));
  }
  engine.load_checkpoint(path);
}

TEST(FailuresAlike, ASaveOneRankCannotWriteLeavesThePreviousCheckpointOnEveryRank) {
  if (ranks() == 1) GTEST_SKIP() << "one process";
  const std::string path = shared_path("ps_fail_save_");
  models::Gpt model = make_model(1);
  Engine engine(model.ptr(), tight_config(), comm());
  train_steps(engine, model, 0, 2, /*sharded=*/true);
  engine.save_checkpoint(path);
  const auto saved = engine.fp32_state_dict();
  train_steps(engine, model, 2, 3, /*sharded=*/true);
  const std::string index_before = file_bytes(path);
  // The last rank's first allocation in the save fails.
  if (last()) allocation_faults::arm(1);
  const std::string error = error_of([&] { engine.save_checkpoint(path); });
  const bool fired = allocation_faults::fired();
  allocation_faults::disarm();
  EXPECT_TRUE(fired || !last());
  EXPECT_NE(error.find("save_checkpoint(\"" + path + "\") failed on " + failing_rank()),
            std::string::npos)
      << error;
  expect_same_everywhere(error);
  comm()->barrier();
  EXPECT_EQ(file_bytes(path), index_before);
  // The previous checkpoint loads, on every rank, with the weights it was saved with.
  engine.load_checkpoint(path);
  const auto loaded = engine.fp32_state_dict();
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_TRUE(torch::equal(saved[i].second, loaded[i].second)) << saved[i].first;
  }
}

// A rank that gives up its step while another's fp16 gradients overflow: the summed norm is then
// not finite rather than negative, and every rank still hears the giving-up rank's error (none
// takes the overflow's skip while that rank waits for its message).
TEST(FailuresAlike, AStepGivenUpBesideAnotherRanksOverflowFailsEveryRank) {
  if (ranks() == 1) GTEST_SKIP() << "one process";
  models::GptSpec spec = tiny();
  spec.lora_rank = 4;
  spec.lora_alpha = 8.0;
  torch::manual_seed(1);
  models::Gpt model(spec);
  Engine engine(model.ptr(), tight_config(R"({"fp16": {"enabled": true, "initial_scale_power": 8},
                                 "default_chunk_size": 32768,
                                 "client": {"device": {"capacity_bytes": 8388608}}})"),
                comm());
  train_steps(engine, model, 0, 1, /*sharded=*/true);
  const auto batch = batch_of_step(1);
  engine.zero_grad();
  at::Tensor loss;
  {
    auto active = engine.activate();
    loss = model->loss(my_rows(batch.tokens), my_rows(batch.targets));
  }
  engine.backward(me() == 0 ? loss * 1e30 : loss);  // rank 0's gradients overflow
  at::Tensor frozen = model->named_parameters()["blocks.0.fc.weight"];
  if (last()) frozen.mutable_grad() = torch::ones(frozen.sizes());  // the last rank gives up
  const std::string error = error_of([&] { engine.step(); });
  EXPECT_NE(error.find("blocks.0.fc.weight"), std::string::npos) << error;
  if (!last()) {
    EXPECT_NE(error.find("could not take this step on " + failing_rank()), std::string::npos)
        << error;
  }
  if (last()) frozen.mutable_grad().reset();
  for (double l : train_steps(engine, model, 2, 4, /*sharded=*/true)) EXPECT_TRUE(std::isfinite(l));
}

}  // namespace failures_alike_test
}  // namespace patrickstar
