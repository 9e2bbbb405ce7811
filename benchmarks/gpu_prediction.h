// ps_bench --predict: the step time a GPU would take for the iteration this run recorded, from
// memtracer's cost model (patrickstar/memtracer/cost_model.h), printed with its assumptions.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include "patrickstar/memtracer/cost_model.h"
#include "patrickstar/patrickstar.h"

namespace patrickstar::bench {

// Each moment's cost in the engine's current trace: a forward moment computes 2 FLOPs per
// parameter the module owns (not its children's) per token, a backward moment 4, except an
// embedding's lookup (its first forward moment) and the lookup's gradient (its last backward
// moment), which do no matmul (a tied output layer's moments count as a linear's); the step's
// device Adam reads and writes its chunks once (2 x their bytes), its host Adam updates every
// element of the parameter chunks it sends home. Throws c10::Error before the engine has a trace.
std::vector<MomentCost> moment_costs(const Engine& engine, torch::nn::Module& model, int64_t tokens);

// The step's host Adam per chunk index for the cost model's overlapped and delayed schedules: the
// parameters of each index whose param chunk the step reads on the host, the chunks it reads
// there, and the last moment before the step that reads its weights or writes its gradients
// (after which its gradients are final). Empty without a step moment.
std::vector<HostUpdate> host_updates(const Engine& engine);

// Predicts the last recorded iteration on `gpu` (a name gpu_cost_model knows), prints it beside
// the step time measured here, with every assumption, the host Adam serial, overlapped and
// delayed, at this batch (`tokens` per iteration, `seq` per sequence) and at the batch where the
// GPU's compute matches the host Adam, and returns the figures for the JSON.
nlohmann::json print_gpu_prediction(const Engine& engine, torch::nn::Module& model, int64_t tokens,
                                    int64_t seq, const std::string& gpu,
                                    double measured_step_seconds);

}  // namespace patrickstar::bench
