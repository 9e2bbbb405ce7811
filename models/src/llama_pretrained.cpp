#include "patrickstar/models/llama_pretrained.h"

#include <fstream>
#include <set>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_join.h"

namespace patrickstar::models {
namespace {

std::string last_part(std::string folder) {
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  const size_t slash = folder.rfind('/');
  return slash == std::string::npos ? folder : folder.substr(slash + 1);
}

// "a, b, c (and 4 more)"
std::string some_of(const std::vector<std::string>& names) {
  constexpr size_t kShown = 4;
  std::vector<std::string> shown;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) shown.push_back("\"" + names[i] + "\"");
  std::string out = absl::StrJoin(shown, ", ");
  if (names.size() > kShown) out += " (and " + std::to_string(names.size() - kShown) + " more)";
  return out;
}

const char* dtype_word(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
}

}  // namespace

LlamaSpec llama_spec_from_pretrained(const std::string& folder) {
  const std::string file =
      folder + (folder.empty() || folder.back() == '/' ? "" : "/") + "config.json";
  std::ifstream in(file);
  TORCH_CHECK(in, "Llama: cannot open \"", file, "\"");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object(), "Llama: \"", file, "\" is not a JSON object");
  const auto bad = [&](const std::string& key, const std::string& why) {
    return c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                      "Llama: \"" + file + "\": \"" + key + "\" " + why);
  };
  const auto integer = [&](const std::string& key) -> int64_t {
    if (!j.contains(key) || !j[key].is_number_integer())
      throw bad(key, "is missing or not an integer");
    return j[key].get<int64_t>();
  };
  const auto number = [&](const nlohmann::json& o, const std::string& key, double fallback) {
    if (!o.contains(key) || o[key].is_null()) return fallback;
    if (!o[key].is_number()) throw bad(key, "is not a number");
    return o[key].get<double>();
  };
  const auto flag = [&](const std::string& key, bool fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_boolean()) throw bad(key, "is not true or false");
    return j[key].get<bool>();
  };
  const auto text = [&](const nlohmann::json& o, const std::string& key,
                        const std::string& fallback) {
    if (!o.contains(key) || o[key].is_null()) return fallback;
    if (!o[key].is_string()) throw bad(key, "is not a string");
    return o[key].get<std::string>();
  };
  const auto flag_off = [&](const std::string& key) {
    if (j.contains(key) && !(j[key].is_boolean() && !j[key].get<bool>())) {
      throw bad(key, "is set: the zoo's Llama has no biases");
    }
  };
  if (j.contains("model_type") && j["model_type"] != "llama") {
    throw bad("model_type", "is " + j["model_type"].dump() + ", not \"llama\"");
  }
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    throw bad("hidden_act", "is " + j["hidden_act"].dump() + ", not \"silu\" (SwiGLU)");
  }
  flag_off("attention_bias");
  flag_off("mlp_bias");
  LlamaSpec spec;
  spec.name = last_part(folder);
  spec.layers = integer("num_hidden_layers");
  spec.hidden = integer("hidden_size");
  spec.intermediate = integer("intermediate_size");
  spec.heads = integer("num_attention_heads");
  spec.kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                      ? integer("num_key_value_heads")
                      : spec.heads;
  spec.vocab = integer("vocab_size");
  spec.max_seq = j.contains("max_position_embeddings") ? integer("max_position_embeddings") : 2048;
  spec.rms_eps = number(j, "rms_norm_eps", 1e-6);
  spec.dropout = number(j, "attention_dropout", 0.0);
  spec.tie_embeddings = flag("tie_word_embeddings", false);  // LlamaConfig's default
  if (j.contains("pad_token_id") && !j["pad_token_id"].is_null()) {
    spec.pad_token_id = integer("pad_token_id");
  }
  if (j.contains("head_dim") && !j["head_dim"].is_null() &&
      (spec.heads <= 0 || integer("head_dim") != spec.hidden / spec.heads)) {
    throw bad("head_dim", "is not hidden_size / num_attention_heads");
  }
  // Rotary: transformers 5's rope_parameters, or 4.x's rope_theta and rope_scaling.
  nlohmann::json rope = nlohmann::json::object();
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    rope = j["rope_parameters"];
  } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    rope = j["rope_scaling"];
  }
  spec.rope_theta = number(rope, "rope_theta", number(j, "rope_theta", 10000.0));
  const std::string type = text(rope, "rope_type", text(rope, "type", "default"));
  if (type != "default" && type != "llama3") {
    throw bad("rope_type", "is \"" + type + "\"; the zoo's Llama has \"default\" and \"llama3\"");
  }
  spec.rope_type = type;
  if (type == "llama3") {  // transformers requires every one of them
    for (const char* key :
         {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
      if (!rope.contains(key) || !rope[key].is_number())
        throw bad(key, "is missing for rope_type llama3");
    }
    spec.rope_factor = number(rope, "factor", 0);
    spec.low_freq_factor = number(rope, "low_freq_factor", 0);
    spec.high_freq_factor = number(rope, "high_freq_factor", 0);
    spec.rope_original_seq =
        static_cast<int64_t>(number(rope, "original_max_position_embeddings", 0));
  }
  spec.deferred_init = true;
  spec.source_config = j.dump();
  return spec;
}

std::string llama_config_json(const LlamaSpec& spec, at::ScalarType dtype) {
  nlohmann::json rope = {{"rope_type", spec.rope_type}, {"rope_theta", spec.rope_theta}};
  if (spec.rope_type == "llama3") {
    rope["factor"] = spec.rope_factor;
    rope["low_freq_factor"] = spec.low_freq_factor;
    rope["high_freq_factor"] = spec.high_freq_factor;
    rope["original_max_position_embeddings"] = spec.rope_original_seq;
  }
  // The source's other fields (token ids, generation settings), with ours over them.
  nlohmann::json j = spec.source_config.empty()
                         ? nlohmann::json::object()
                         : nlohmann::json::parse(spec.source_config, nullptr, false);
  if (!j.is_object()) j = nlohmann::json::object();
  j.update(nlohmann::json{
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"hidden_size", spec.hidden},
      {"intermediate_size", spec.intermediate},
      {"num_hidden_layers", spec.layers},
      {"num_attention_heads", spec.heads},
      {"num_key_value_heads", spec.kv_heads},
      {"head_dim", spec.head_dim()},
      {"vocab_size", spec.vocab},
      {"max_position_embeddings", spec.max_seq},
      {"rms_norm_eps", spec.rms_eps},
      {"attention_dropout", spec.dropout},
      {"tie_word_embeddings", spec.tie_embeddings},
      // Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling.
      {"rope_parameters", rope},
      {"rope_theta", spec.rope_theta},
      {"rope_scaling", spec.rope_type == "default" ? nlohmann::json(nullptr) : rope},
      {"dtype", dtype_word(dtype)},
      {"torch_dtype", dtype_word(dtype)}});
  j["pad_token_id"] =
      spec.pad_token_id >= 0 ? nlohmann::json(spec.pad_token_id) : nlohmann::json(nullptr);
  return j.dump(2) + "\n";
}

void LlamaImpl::initialize_from(std::shared_ptr<const SafetensorsCheckpoint> checkpoint) {
  TORCH_CHECK(checkpoint != nullptr, "Llama: initialize_from needs a checkpoint");
  const SafetensorsCheckpoint& ckpt = *checkpoint;
  // Everything is checked before anything changes.
  std::vector<std::string> missing, unexpected, problems;
  std::set<std::string> expected;
  size_t deferred = 0, base = 0;
  for (const auto& p : named_parameters()) {
    const std::string hf = hf_name(p.key());
    if (hf.empty()) continue;  // an adapter's
    ++base;
    deferred += is_deferred(p.value()) ? 1 : 0;
    expected.insert(hf);
    if (!ckpt.contains(hf)) {
      missing.push_back(hf);
      continue;
    }
    const auto& e = ckpt.entry(hf);
    if (c10::IntArrayRef(e.shape) != p.value().sizes()) {
      problems.push_back("tensor \"" + hf + "\" in \"" + e.file + "\" has shape " +
                         c10::str(c10::IntArrayRef(e.shape)) + ", the model's is " +
                         c10::str(p.value().sizes()));
    } else if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16") {
      problems.push_back("tensor \"" + hf + "\" in \"" + e.file + "\" is " + e.dtype +
                         " (fp32, bf16 and fp16 are read)");
    }
  }
  for (const std::string& name : ckpt.names()) {
    // Old checkpoints kept the rotary frequencies as buffers (transformers ignores them too).
    const bool rotary =
        name.size() >= 19 && name.compare(name.size() - 19, 19, "rotary_emb.inv_freq") == 0;
    if (expected.count(name) == 0 && !rotary) unexpected.push_back(name);
  }
  TORCH_CHECK(problems.empty(), "Llama \"", spec_.name, "\" from \"", ckpt.path(),
              "\": ", absl::StrJoin(problems, "; "));
  TORCH_CHECK(missing.empty() && unexpected.empty(), "Llama \"", spec_.name, "\" from \"",
              ckpt.path(), "\": ", missing.empty() ? "" : "missing " + some_of(missing),
              !missing.empty() && !unexpected.empty() ? "; " : "",
              unexpected.empty() ? "" : "unexpected " + some_of(unexpected),
              " (is it this model's checkpoint? tie_word_embeddings, layers and sizes must match)");
  TORCH_CHECK(deferred == 0 || deferred == base, "Llama \"", spec_.name, "\": ", deferred, " of ",
              base,
              " parameters are deferred; initialize_from takes a model built deferred or whole");
  if (deferred > 0) {
    source_ = std::move(checkpoint);  // each tensor is read when registration asks for it
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    const std::string hf = hf_name(p.key());
    if (!hf.empty()) ckpt.read_into(hf, p.value());
  }
}

SafetensorsSaveReport save_pretrained(const Engine& engine, const LlamaImpl& model,
                                      const std::string& folder, SafetensorsOptions options) {
  TORCH_CHECK(
      model.spec().lora_rank == 0, "save_pretrained: Llama \"", model.spec().name,
      "\" has adapters, which a Llama checkpoint has no place for (merge them into the base "
      "first, or keep them with Engine::save_checkpoint)");
  options.rename = [](const std::string& name) { return LlamaImpl::hf_name(name); };
  // Written with the shards (the same save, the same agreement between ranks).
  options.extra_files["config.json"] = llama_config_json(model.spec(), options.dtype);
  return engine.save_safetensors(folder, options);
}

}  // namespace patrickstar::models
