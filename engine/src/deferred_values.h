// Private to engine/src: which ParameterInitializer gives a deferred parameter its value
// (patrickstar/engine/deferred_init.h): the nearest module above it that implements one.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "patrickstar/engine/deferred_init.h"

namespace patrickstar {

// A deferred parameter's tensor (defer_parameters): `sizes` and `dtype` over a storage without
// data.
at::Tensor deferred_tensor(c10::IntArrayRef sizes, at::ScalarType dtype);

class InitializerLookup {
 public:
  // Every module of `model` (recursively, by named_children) that implements ParameterInitializer.
  explicit InitializerLookup(const torch::nn::Module& model);
  // The initializer nearest above the parameter `name` (its name in the model) and the name below
  // it; null when there is none.
  std::pair<const ParameterInitializer*, std::string> find(const std::string& name) const;
  // Throws c10::Error naming the parameter when it has no initializer.
  void check(const std::string& name) const;
  // A new fp32 CPU tensor of `sizes` holding the parameter's initial value.
  at::Tensor value_of(const std::string& name, c10::IntArrayRef sizes) const;

 private:
  std::vector<std::pair<std::string, const ParameterInitializer*>> found_;  // (module prefix, it)
};

}  // namespace patrickstar
