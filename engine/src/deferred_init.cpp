// Deferred parameters (patrickstar/engine/deferred_init.h): a storage without data that says why
// when read, recognised by its deleter; and the lookup of each one's initializer.
#include "patrickstar/engine/deferred_init.h"

#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "deferred_values.h"
#include "engine_internal.h"

namespace patrickstar {
namespace {

// The deleter that marks a deferred parameter's storage (it deletes nothing: there is no data).
void deferred_marker(void* /*ctx*/) {}
int g_marker_ctx = 0;

}  // namespace

at::Tensor deferred_tensor(c10::IntArrayRef sizes, at::ScalarType dtype) {
  // A fence (engine_internal.h) whose data pointer carries the marker.
  c10::Storage storage = engine_detail::fence_storage(
      c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype)),
      "patrickstar: this parameter is deferred (patrickstar::defer_parameters): it has no data "
      "until the engine registers the model, which writes its value into its chunk; without an "
      "engine, patrickstar::materialize_parameters(model) gives it its value",
      c10::Device(c10::kCPU));
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(
      c10::DataPtr(nullptr, &g_marker_ctx, &deferred_marker, c10::Device(c10::kCPU)));
  return engine_detail::tensor_over(storage, sizes, dtype);
}

namespace {

void collect(const torch::nn::Module& module, const std::string& prefix,
             std::vector<std::pair<std::string, const ParameterInitializer*>>& out) {
  if (const auto* init = dynamic_cast<const ParameterInitializer*>(&module))
    out.emplace_back(prefix, init);
  for (const auto& child : module.named_children()) {
    collect(*child.value(), prefix.empty() ? child.key() : prefix + "." + child.key(), out);
  }
}

}  // namespace

bool is_deferred(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  const c10::DataPtr& data = t.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks();
  return data.get_deleter() == &deferred_marker && data.get_context() == &g_marker_ctx;
}

void defer_parameters(torch::nn::Module& module) {
  std::vector<at::Tensor> todo;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (is_deferred(t) || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
                "patrickstar::defer_parameters: parameter ", item.key(), " is ", t.scalar_type(),
                " on ", t.device(),
                "; only fp32 parameters on the CPU can be deferred (nothing was)");
    todo.push_back(t);
  }
  for (at::Tensor& t : todo) t.set_data(deferred_tensor(t.sizes(), t.scalar_type()));
}

int64_t materialize_parameters(torch::nn::Module& model) {
  const InitializerLookup lookup(model);
  std::vector<std::pair<std::string, at::Tensor>> todo;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (!is_deferred(t) || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    lookup.check(item.key());
    todo.emplace_back(item.key(), t);
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : todo) t.set_data(lookup.value_of(name, t.sizes()));
  return static_cast<int64_t>(todo.size());
}

InitializerLookup::InitializerLookup(const torch::nn::Module& model) {
  collect(model, "", found_);
}

std::pair<const ParameterInitializer*, std::string> InitializerLookup::find(
    const std::string& name) const {
  const ParameterInitializer* best = nullptr;
  size_t best_len = 0;
  std::string below = name;
  for (const auto& [prefix, init] : found_) {
    const bool above = prefix.empty() ||
                       (name.size() > prefix.size() + 1 &&
                        name.compare(0, prefix.size(), prefix) == 0 && name[prefix.size()] == '.');
    if (!above || (best != nullptr && prefix.size() < best_len)) continue;
    best = init;
    best_len = prefix.size();
    below = prefix.empty() ? name : name.substr(prefix.size() + 1);
  }
  return {best, below};
}

void InitializerLookup::check(const std::string& name) const {
  TORCH_CHECK(find(name).first != nullptr, "patrickstar: parameter ", name,
              " is deferred (patrickstar::defer_parameters) but no module above it implements "
              "patrickstar::ParameterInitializer to give it its value");
}

at::Tensor InitializerLookup::value_of(const std::string& name, c10::IntArrayRef sizes) const {
  check(name);
  const auto [init, below] = find(name);
  at::Tensor value = at::empty(sizes, at::TensorOptions(at::kFloat));
  torch::NoGradGuard no_grad;
  init->initialize_parameter(below, value);
  TORCH_CHECK(value.defined() && value.sizes() == sizes && value.scalar_type() == at::kFloat &&
                  value.device().is_cpu(),
              "patrickstar: the initializer of deferred parameter ", name,
              " changed its value tensor (it must fill the fp32 CPU tensor of shape ", sizes,
              " it is given)");
  return value;
}

}  // namespace patrickstar
