// ps_bench's flags (defined in ps_bench.cpp), for the files that read them.
#pragma once

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(bool, list_models);
ABSL_DECLARE_FLAG(int64_t, batch);
ABSL_DECLARE_FLAG(int64_t, seq);
ABSL_DECLARE_FLAG(int64_t, steps);
ABSL_DECLARE_FLAG(bool, no_decay);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, state_dtype);
ABSL_DECLARE_FLAG(int64_t, lora);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, host_memory);
ABSL_DECLARE_FLAG(std::string, offload_nvme);
ABSL_DECLARE_FLAG(std::string, policy);
ABSL_DECLARE_FLAG(std::string, chunk_size);
ABSL_DECLARE_FLAG(std::string, config);
ABSL_DECLARE_FLAG(bool, baseline);
ABSL_DECLARE_FLAG(std::string, moves);
ABSL_DECLARE_FLAG(std::string, json);
ABSL_DECLARE_FLAG(std::string, trace);
ABSL_DECLARE_FLAG(std::string, plot);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(bool, checkpoint_activations);
ABSL_DECLARE_FLAG(std::string, activations);
ABSL_DECLARE_FLAG(bool, compare_activations);
ABSL_DECLARE_FLAG(bool, longest_seq);
ABSL_DECLARE_FLAG(bool, find_max_model);
ABSL_DECLARE_FLAG(int64_t, hidden);
ABSL_DECLARE_FLAG(int64_t, max_layers);
ABSL_DECLARE_FLAG(std::string, search_policies);
ABSL_DECLARE_FLAG(int64_t, search_steps);
ABSL_DECLARE_FLAG(bool, compare_moves);
ABSL_DECLARE_FLAG(bool, compare_step);
ABSL_DECLARE_FLAG(bool, compare_delayed);
ABSL_DECLARE_FLAG(std::string, predict);
ABSL_DECLARE_FLAG(bool, check_flags);
ABSL_DECLARE_FLAG(int64_t, threads);
ABSL_DECLARE_FLAG(bool, breakdown);
