// ps_ckpt: a checkpoint without an engine (patrickstar/engine/checkpoint_files.h).
//
//   ps_ckpt show PATH [--tensors] [--config]   what it holds: the writing run, files, tensors,
//   bytes ps_ckpt verify PATH                         every byte of every file against its checksum
//   ps_ckpt export PATH FOLDER [--names as-is|llama] [--dtype fp32|bf16|fp16]
//                              [--max-shard-bytes N] [--hf-config FILE]
//                                               the fp32 weights as a safetensors folder, streamed
//                                               (--hf-config: written beside them as config.json)
//
// Exit status: 0 done (verify: sound), 1 a problem found or an error, 2 a bad command line.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "patrickstar/engine/checkpoint_files.h"
#include "patrickstar/models/llama.h"

namespace {

int usage(const std::string& why) {
  std::fprintf(stderr,
               "ps_ckpt: %s\n"
               "usage: ps_ckpt show PATH [--tensors] [--config]\n"
               "       ps_ckpt verify PATH\n"
               "       ps_ckpt export PATH FOLDER [--names as-is|llama] [--dtype fp32|bf16|fp16] "
               "[--max-shard-bytes N] [--hf-config FILE]\n",
               why.c_str());
  return 2;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Progress on stderr, a line rewritten in place, at each whole percent.
patrickstar::CheckpointProgress percent(const char* what) {
  auto last = std::make_shared<int>(-1);
  return [what, last](int64_t done, int64_t total) {
    const int now = total > 0 ? static_cast<int>(100 * done / total) : 100;
    if (now == *last) return;
    *last = now;
    std::fprintf(stderr, "\r%s: %3d%%%s", what, now, now == 100 ? "\n" : "");
  };
}

int show(const std::string& path, bool tensors, bool config) {
  const patrickstar::CheckpointInfo info = patrickstar::read_checkpoint_info(path);
  std::printf("checkpoint %s\n", path.c_str());
  std::printf("  written by: %lld rank(s), shard groups of %lld, chunks of %lld elements, %s\n",
              static_cast<long long>(info.world_size),
              static_cast<long long>(info.shard_group_size),
              static_cast<long long>(info.chunk_elems), info.precision.c_str());
  std::printf("  at: iteration %lld, Adam step %lld, %lld retrace(s), loss scale %g\n",
              static_cast<long long>(info.iteration), static_cast<long long>(info.adam_step),
              static_cast<long long>(info.retraces), info.loss_scale);
  int64_t lean = 0, frozen = 0;
  for (const auto& t : info.tensors) {
    lean += t.moments ? 0 : 1;
    frozen += t.trainable ? 0 : 1;
  }
  std::printf("  tensors: %zu (%lld parameters; %lld frozen, %lld saved without moments)\n",
              info.tensors.size(), static_cast<long long>(info.parameters),
              static_cast<long long>(frozen), static_cast<long long>(lean));
  std::printf("  data files: %zu, %lld bytes\n", info.files.size(),
              static_cast<long long>(info.data_bytes));
  for (const auto& [name, bytes] : info.files) {
    std::printf("    %s  %lld bytes\n", name.c_str(), static_cast<long long>(bytes));
  }
  if (tensors) {
    std::printf("  %-48s %-18s %-9s %-7s %-5s %-5s %s\n", "tensor", "shape", "trainable", "moments",
                "steps", "chunk", "file");
    for (const auto& t : info.tensors) {
      std::printf("  %-48s %-18s %-9s %-7s %-5lld %-5lld %s\n", t.name.c_str(),
                  shape_text(t.shape).c_str(), t.trainable ? "yes" : "no", t.moments ? "yes" : "no",
                  static_cast<long long>(t.adam_steps), static_cast<long long>(t.chunk),
                  t.file.c_str());
    }
  }
  if (config) std::printf("  config: %s\n", info.config_json.c_str());
  return 0;
}

int verify(const std::string& path) {
  const patrickstar::CheckpointInfo info = patrickstar::read_checkpoint_info(path);
  const std::vector<std::string> problems = patrickstar::verify_checkpoint(path, percent("verify"));
  for (const std::string& p : problems) std::printf("problem: %s\n", p.c_str());
  if (!problems.empty()) {
    std::printf("%s: %zu problem(s)\n", path.c_str(), problems.size());
    return 1;
  }
  std::printf("%s: sound (index, %zu data file(s), %lld bytes, %zu tensors)\n", path.c_str(),
              info.files.size(), static_cast<long long>(info.data_bytes), info.tensors.size());
  return 0;
}

int export_weights(const std::string& path, const std::string& folder,
                   const std::vector<std::string>& flags) {
  patrickstar::SafetensorsOptions options;
  for (size_t i = 0; i < flags.size(); i += 2) {
    if (i + 1 >= flags.size()) return usage(flags[i] + " needs a value");
    const std::string& key = flags[i];
    const std::string& value = flags[i + 1];
    if (key == "--names") {
      if (value == "llama") {
        options.rename = [](const std::string& name) {
          return patrickstar::models::LlamaImpl::hf_name(name);
        };
      } else if (value != "as-is") {
        return usage("--names is as-is or llama, not " + value);
      }
    } else if (key == "--dtype") {
      if (value == "bf16") {
        options.dtype = at::kBFloat16;
      } else if (value == "fp16") {
        options.dtype = at::kHalf;
      } else if (value != "fp32") {
        return usage("--dtype is fp32, bf16 or fp16, not " + value);
      }
    } else if (key == "--max-shard-bytes") {
      char* end = nullptr;
      options.max_shard_bytes = std::strtoll(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || options.max_shard_bytes <= 0) {
        return usage("--max-shard-bytes is a positive number of bytes, not " + value);
      }
    } else if (key == "--hf-config") {
      std::ifstream in(value, std::ios::binary);
      if (!in) return usage("cannot read " + value);
      options.extra_files["config.json"] =
          std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    } else {
      return usage("unknown option " + key);
    }
  }
  const patrickstar::SafetensorsSaveReport report =
      patrickstar::export_checkpoint_weights(path, folder, options, percent("export"));
  std::printf("%s: %lld tensors, %lld bytes in %zu file(s)\n", folder.c_str(),
              static_cast<long long>(report.tensors), static_cast<long long>(report.bytes),
              report.files.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() < 2) return usage("a command and a checkpoint path");
  try {
    const std::string& command = args[0];
    const std::string& path = args[1];
    if (command == "show") {
      bool tensors = false, config = false;
      for (size_t i = 2; i < args.size(); ++i) {
        if (args[i] == "--tensors") {
          tensors = true;
        } else if (args[i] == "--config") {
          config = true;
        } else {
          return usage("unknown option " + args[i]);
        }
      }
      return show(path, tensors, config);
    }
    if (command == "verify") return args.size() == 2 ? verify(path) : usage("verify takes a path");
    if (command == "export") {
      if (args.size() < 3) return usage("export needs a checkpoint and a folder");
      return export_weights(path, args[2], {args.begin() + 3, args.end()});
    }
    return usage("unknown command " + command);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "ps_ckpt: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_ckpt: %s\n", e.what());
    return 1;
  }
}
