// CheckpointContents to and from a sealed checkpoint file: the records, their types and ranges.
// Archive keys are plain identifiers (LibTorch archives reject dots), so tensors are stored by
// registration index and the parameter names once, newline-separated.
#include <cmath>
#include <string>

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "checkpoint_file.h"

namespace patrickstar::engine_detail {

void write_checkpoint_file(const CheckpointContents& c, const std::string& path) {
  torch::serialize::OutputArchive archive;
  archive.write("format", at::tensor(kCheckpointFormat));
  archive.write("config_json", text_tensor(c.config_json));
  archive.write("precision", text_tensor(c.precision));
  std::string names;
  for (const std::string& name : c.names) names += name + "\n";
  archive.write("names", text_tensor(names));
  archive.write("world_size", at::tensor(c.world_size));
  archive.write("rank", at::tensor(c.rank));
  archive.write("chunk_elems", at::tensor(c.chunk_elems));
  archive.write("adam_step", at::tensor(c.adam_step));
  // Empty: the contents came from a file that predates per-parameter steps (it stays so).
  if (!c.param_steps.empty()) archive.write("param_steps", at::tensor(c.param_steps, at::kLong));
  archive.write("iteration", at::tensor(c.iteration));
  archive.write("scaler", at::tensor({c.scaler.scale, static_cast<double>(c.scaler.step),
                                      static_cast<double>(c.scaler.last_overflow_step),
                                      static_cast<double>(c.scaler.hysteresis_left)},
                                     at::kDouble));
  for (const auto& [id, p] : c.params) {
    const std::string i = std::to_string(id);
    archive.write("master_" + i, p.master);
    if (!p.exp_avg.defined()) continue;  // a lean frozen parameter: its weights alone
    archive.write("exp_avg_" + i, p.exp_avg);
    archive.write("exp_avg_sq_" + i, p.exp_avg_sq);
  }
  save_sealed_archive(archive, path);
}

namespace {

// The records of one archive, each read with the checks of its kind; a record missing or of the
// wrong kind refuses the file, naming it.
class Records {
 public:
  Records(torch::serialize::InputArchive& archive, const std::string& path)
      : archive_(archive), path_(path) {}

  void refuse(const std::string& why) const {
    TORCH_CHECK(false, "patrickstar: checkpoint \"", path_, "\" ", why, "; nothing was loaded");
  }

  at::Tensor tensor(const std::string& key, bool required = true) {
    at::Tensor value;
    bool found = false;
    try {
      found = archive_.try_read(key, value);
    } catch (const c10::Error& e) {
      refuse("has a record \"" + key + "\" that is not a tensor (" +
             e.what_without_backtrace() + ")");
    }
    if (!found && required) refuse("has no record \"" + key + "\"");
    return value;
  }

  int64_t integer(const std::string& key, int64_t low) {
    const at::Tensor t = tensor(key);
    if (t.scalar_type() != at::kLong || t.numel() != 1) {
      refuse("has a record \"" + key + "\" that is not one 64-bit integer");
    }
    const int64_t v = t.item<int64_t>();
    if (v < low) refuse("has " + key + " " + std::to_string(v) + ", below " + std::to_string(low));
    return v;
  }

  std::string text(const std::string& key) {
    const at::Tensor t = tensor(key);
    if (t.dim() != 1 || (t.scalar_type() != at::kChar && t.scalar_type() != at::kByte)) {
      refuse("has a record \"" + key + "\" that is not text");
    }
    return tensor_text(t);
  }

 private:
  torch::serialize::InputArchive& archive_;
  const std::string& path_;
};

void read_names(Records& records, CheckpointContents& c) {
  const std::string names = records.text("names");
  size_t from = 0;
  for (size_t at = names.find('\n'); at != std::string::npos; at = names.find('\n', from)) {
    c.names.push_back(names.substr(from, at - from));
    from = at + 1;
  }
  if (from != names.size()) records.refuse("has a list of names that does not end with a new line");
}

void read_param_steps(Records& records, CheckpointContents& c) {
  const at::Tensor steps = records.tensor("param_steps", /*required=*/false);
  if (!steps.defined()) return;
  if (steps.scalar_type() != at::kLong || steps.dim() != 1 ||
      steps.size(0) != static_cast<int64_t>(c.names.size())) {
    records.refuse("has a record \"param_steps\" that is not one 64-bit integer per parameter");
  }
  const at::Tensor values = steps.contiguous();
  for (int64_t i = 0; i < values.size(0); ++i) {
    const int64_t v = values.data_ptr<int64_t>()[i];
    if (v < 0) records.refuse("has a negative Adam step for parameter " + c.names[i]);
    c.param_steps.push_back(v);
  }
}

void read_scaler(Records& records, CheckpointContents& c) {
  const at::Tensor s = records.tensor("scaler");
  if (s.scalar_type() != at::kDouble || s.dim() != 1 || s.size(0) != 4) {
    records.refuse("has a loss scaler record that is not 4 doubles");
  }
  const at::Tensor values = s.contiguous();
  const double* v = values.data_ptr<double>();
  // Whole numbers that fit their fields (a cast of anything else would be undefined).
  auto whole = [&](double x, double low, double high) {
    return std::isfinite(x) && x == std::floor(x) && x >= low && x <= high;
  };
  if (!(std::isfinite(v[0]) && v[0] > 0) || !whole(v[1], 0, 0x1p62) || !whole(v[2], -1, 0x1p62) ||
      !whole(v[3], 1, 0x1p30)) {
    records.refuse("has a loss scaler state that cannot be (scale " + std::to_string(v[0]) +
                   ", step " + std::to_string(v[1]) + ", last overflow " + std::to_string(v[2]) +
                   ", hysteresis left " + std::to_string(v[3]) + ")");
  }
  c.scaler.scale = v[0];
  c.scaler.step = static_cast<int64_t>(v[1]);
  c.scaler.last_overflow_step = static_cast<int64_t>(v[2]);
  c.scaler.hysteresis_left = static_cast<int>(v[3]);
}

// The optimizer state of every parameter named, where this file holds it.
void read_params(Records& records, CheckpointContents& c) {
  for (size_t id = 0; id < c.names.size(); ++id) {
    const std::string i = std::to_string(id);
    CheckpointParam p;
    p.master = records.tensor("master_" + i, /*required=*/false);
    if (!p.master.defined()) continue;  // another rank's shard holds it
    // Neither moment: a parameter the saving engine held lean (frozen, its weights alone).
    p.exp_avg = records.tensor("exp_avg_" + i, /*required=*/false);
    p.exp_avg_sq = records.tensor("exp_avg_sq_" + i, /*required=*/false);
    if (p.exp_avg.defined() != p.exp_avg_sq.defined()) {
      records.refuse("has one of the two Adam moments of parameter " + c.names[id] + " (" + i +
                     ") and not the other");
    }
    for (const at::Tensor* t : {&p.master, &p.exp_avg, &p.exp_avg_sq}) {
      if (!t->defined()) continue;
      if (t->scalar_type() != at::kFloat || t->sizes() != p.master.sizes()) {
        records.refuse("has optimizer state for parameter " + c.names[id] + " (" + i +
                       ") that is not three fp32 tensors of one shape");
      }
    }
    c.params.emplace(static_cast<int64_t>(id), std::move(p));
  }
}

}  // namespace

CheckpointContents read_checkpoint_file(const std::string& path) {
  torch::serialize::InputArchive archive;
  load_sealed_archive(archive, path);
  Records records(archive, path);
  const int64_t format = records.integer("format", 0);
  if (format != kCheckpointFormat) {
    records.refuse("is in checkpoint format " + std::to_string(format) +
                   "; this patrickstar reads " + "format " + std::to_string(kCheckpointFormat));
  }
  CheckpointContents c;
  c.config_json = records.text("config_json");
  c.precision = records.text("precision");
  read_names(records, c);
  c.world_size = records.integer("world_size", 1);
  c.rank = records.integer("rank", 0);
  if (c.rank >= c.world_size) {
    records.refuse("is rank " + std::to_string(c.rank) + "'s of " + std::to_string(c.world_size) +
                   " ranks, which cannot be");
  }
  c.chunk_elems = records.integer("chunk_elems", 1);
  c.adam_step = records.integer("adam_step", 0);
  read_param_steps(records, c);
  c.iteration = records.integer("iteration", 0);
  read_scaler(records, c);
  read_params(records, c);
  return c;
}

}  // namespace patrickstar::engine_detail
