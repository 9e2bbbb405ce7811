// Hugging Face checkpoints for the zoo's Llama: start from one, hand one back.
//
//   auto spec = patrickstar::models::llama_spec_from_pretrained("Llama-3.2-1B/");  // config.json
//   patrickstar::models::Llama model(spec);                    // deferred: no values yet
//   model->initialize_from(
//       std::make_shared<patrickstar::SafetensorsCheckpoint>("Llama-3.2-1B/"));  // checked
//   patrickstar::Engine engine(model.ptr(), config);           // each tensor read into its chunk
//   ... train ...
//   patrickstar::models::save_pretrained(engine, *model, "out/");  // loads in transformers
//
// The host never holds the model whole: registration reads the checkpoint one tensor at a time
// (memory-mapped, its pages given back), and the save writes one chunk at a time.
#pragma once

#include <string>

#include "patrickstar/engine/engine.h"
#include "patrickstar/engine/safetensors.h"
#include "patrickstar/models/llama.h"

namespace patrickstar::models {

// The spec `folder`'s config.json describes (transformers' LlamaConfig, 4.x or 5.x spelling),
// named after the folder, with deferred_init set (the values come from the checkpoint). Throws
// c10::Error naming the field when the file is missing or describes what the zoo's Llama is not
// (another model_type, an activation other than silu, biases, a head size other than
// hidden / heads, a rotary scaling other than Llama 3's).
LlamaSpec llama_spec_from_pretrained(const std::string& folder);

// Writes `model`'s weights, trained by `engine`, as a transformers checkpoint in `folder`:
// config.json and the safetensors shards (Engine::save_safetensors, transformers' names; `options`
// says the dtype and shard size, its rename is replaced). A collective with data parallel; rank 0
// writes. Throws c10::Error for a model with adapters (their weights have no place in a Llama
// checkpoint: merge them first).
SafetensorsSaveReport save_pretrained(const Engine& engine, const LlamaImpl& model,
                                      const std::string& folder, SafetensorsOptions options = {});

// config.json for `spec` (the fields transformers' LlamaConfig reads), as text.
std::string llama_config_json(const LlamaSpec& spec, at::ScalarType dtype);

}  // namespace patrickstar::models
