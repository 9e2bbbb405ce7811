// Initialization memory (issue: engine): registration streams chunk by chunk, so the host holds at
// most the model data plus the largest module's own parameters (fp32) while the model moves in.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "patrickstar/models/gpt.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar {
namespace engine_init_test {

TEST(EngineInit, HostPeakWithinModelDataPlusTheLargestModule) {
  const models::GptSpec spec = models::gpt_spec("gpt_mini");
  for (const char* dtype : {"fp32", "bf16"}) {
    nlohmann::json j = {{"default_chunk_size", "auto"},
                        {"bf16", {{"enabled", std::string(dtype) == "bf16"}}}};
    auto [model, optimizer] = initialize_engine(
        [&] {
          torch::manual_seed(1);
          return models::Gpt(spec);
        },
        0, Config::from_json(j));
    const RegistrationReport& r = model.engine().registration();
    const int64_t fp32_model = 4 * spec.parameter_count();
    std::printf("%s: init host peak %lld bytes, model data %lld, largest module %lld (goal %lld), "
                "model construction %lld (fp32 weights %lld)\n",
                dtype, static_cast<long long>(r.host_peak_bytes_during_init),
                static_cast<long long>(r.model_data_bytes),
                static_cast<long long>(r.largest_module_param_bytes),
                static_cast<long long>(r.init_goal_bytes),
                static_cast<long long>(r.model_construction_peak_bytes),
                static_cast<long long>(fp32_model));
    // The factory's allocations were counted: at least the fp32 weights it built.
    EXPECT_GE(r.model_construction_peak_bytes, fp32_model) << dtype;
    // The wte embedding is the largest module: vocab x hidden.
    EXPECT_EQ(r.largest_module_param_bytes, 4 * spec.vocab * spec.hidden) << dtype;
    EXPECT_GE(r.host_peak_bytes_during_init, r.model_data_bytes) << dtype;
    EXPECT_LE(r.host_peak_bytes_during_init, r.init_goal_bytes) << dtype;
    // Registering everything first and copying afterwards would have held all the fp32 weights
    // next to the whole model data.
    EXPECT_LT(r.host_peak_bytes_during_init, r.model_data_bytes + fp32_model) << dtype;
  }
}

}  // namespace engine_init_test
}  // namespace patrickstar
