// A Hugging Face Llama checkpoint trained under data parallel and written back as one checkpoint:
// each rank reads the tensors of the chunks it owns from the file, and rank 0 writes the trained
// weights with each chunk from its owner in turn. Run as one process (ctest's discovered tests)
// and under mpirun with 2 and 4 ranks (distributed.mpi_*_ranks).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "distributed/data_parallel_helpers.h"
#include "distributed/ranks.h"
#include "engine/gpt_training.h"
#include "patrickstar/models/llama.h"
#include "patrickstar/models/llama_pretrained.h"
#include "patrickstar/patrickstar.h"
#include "temp_folder.h"
#include "test_data.h"

namespace patrickstar {
namespace llama_data_parallel_test {

using namespace test;  // NOLINT: the shared helpers of the engine tests

const std::string kTiny = patrickstar::testing::test_data_dir() + "/llama/tiny";

models::Llama from_checkpoint() {
  models::Llama model(models::llama_spec_from_pretrained(kTiny));
  model->initialize_from(std::make_shared<SafetensorsCheckpoint>(kTiny));
  return model;
}

void train(Engine& engine, models::Llama& model, bool sharded) {
  models::GptSpec vocabulary;
  vocabulary.vocab = model->spec().vocab;
  for (int s = 0; s < 3; ++s) {
    const auto batch = models::random_tokens(vocabulary, 4, 16, 300 + s);
    at::Tensor loss;
    train_step(engine, model, batch.tokens, batch.targets, sharded, loss);
  }
}

TEST(LlamaDataParallel, RanksTrainACheckpointAndRankZeroWritesTheOneProcessWeights) {
  // Tolerance: each tensor's mean difference within 1e-5 of its mean size. The ranks' gradients
  // are summed in another order than one process sums the whole batch's, which is fp32 rounding,
  // but Adam divides each gradient by its own size: an element whose gradient is near zero (an
  // embedding row of a token seen once) can move otherwise by up to its learning rate per step
  // (3.5e-5 apart on 2 ranks where the mean is 2e-9 apart).
  const Config config = tight_config(
      R"({"default_chunk_size": 32768, "client": {"device": {"capacity_bytes": 8388608}}})");
  TempFolder folder("llama-dp");  // rank 0's is written; the others' stay empty
  models::Llama model = from_checkpoint();
  Engine engine(model.ptr(), config, comm());
  train(engine, model, /*sharded=*/true);
  SafetensorsOptions options;
  options.max_shard_bytes = 200 * 1000;
  const SafetensorsSaveReport report =
      models::save_pretrained(engine, *model, folder.path(), options);

  models::Llama one_model = from_checkpoint();
  Engine one(one_model.ptr(), config);  // one process on the whole batch, whatever the launcher
  train(one, one_model, /*sharded=*/false);
  if (comm()->rank() != 0) {
    EXPECT_TRUE(folder.files().empty());
    return;
  }
  EXPECT_GT(report.files.size(), 1u);
  SafetensorsCheckpoint written(folder.path());
  double worst = 0, largest = 0;
  int64_t compared = 0;
  for (const auto& [name, value] : one.fp32_state_dict()) {
    const at::Tensor got = written.read(models::LlamaImpl::hf_name(name));
    ASSERT_EQ(got.sizes(), value.sizes()) << name;
    worst = std::max(worst, (got - value).abs().mean().item<double>() /
                                std::max(1e-12, value.abs().mean().item<double>()));
    largest = std::max(largest, (got - value).abs().max().item<double>());
    ++compared;
  }
  std::printf(
      "%d rank(s): rank 0 wrote %zu shards (%ld bytes); %ld tensors, mean difference to "
      "one process's training within %.3g of their mean size, largest %.3g\n",
      comm()->world_size(), report.files.size(), static_cast<long>(report.bytes),
      static_cast<long>(compared), worst, largest);
  EXPECT_EQ(compared, static_cast<int64_t>(written.names().size()));
  EXPECT_LE(worst, 1e-5);
  EXPECT_LE(largest, 2 * 3e-3 * 3);  // no element further apart than Adam can move it (lr 3e-3)
}

}  // namespace llama_data_parallel_test
}  // namespace patrickstar
