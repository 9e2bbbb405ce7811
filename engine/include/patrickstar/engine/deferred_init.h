// Deferred initialization: a model whose parameters are never all in host memory in fp32 at once.
// Each deferred parameter keeps its shape and dtype but has no data; the engine's registration asks
// the model for its value, one parameter at a time, copies it into its chunk and frees it. So the
// host holds at most the model data plus one parameter's fp32 value at registration, and one
// module built whole (before it is deferred) during construction: what a model of more parameters
// than the host holds in fp32 needs (docs/design.md, "Deferred initialization").
//
//   class MyModelImpl : public torch::nn::Module, public patrickstar::ParameterInitializer {
//    public:
//     MyModelImpl() {
//       for (int i = 0; i < 48; ++i) {
//         auto block = blocks->push_back(Block(4096));   // built in fp32, as usual
//         patrickstar::defer_parameters(*blocks[i]);     // its storage freed here
//       }
//     }
//     // name: the parameter's name below this module ("blocks.3.fc.weight"); value: fp32 on the
//     // CPU, of the parameter's shape. The same value whenever asked: draw from a generator
//     // seeded by the name, not from the global one.
//     void initialize_parameter(const std::string& name, at::Tensor& value) const override {
//       auto gen = at::make_generator<at::CPUGeneratorImpl>(std::hash<std::string>{}(name));
//       value.normal_(0.0, 0.02, gen);
//     }
//   };
//
// Without an engine (plain LibTorch, or a reference to compare the engine's training with),
// materialize_parameters(model) gives every deferred parameter its value the same way. Reading a
// deferred parameter's data before either throws c10::Error saying so.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace patrickstar {

// Implemented by a module (next to torch::nn::Module) that gives the deferred parameters below it
// their values. A deferred parameter asks the nearest module above it (itself included) that
// implements this.
class ParameterInitializer {
 public:
  virtual ~ParameterInitializer() = default;
  // Fills `value` (fp32, contiguous, on the CPU, of the parameter's shape) with the initial value
  // of the parameter `name` names below this module (as this module's named_parameters() names
  // it). Must give the same value each time it is asked, on every rank: with data parallel each
  // rank initializes the chunks it owns, and nothing is broadcast for a deferred parameter. May
  // throw: registration then stops and nothing stays registered.
  virtual void initialize_parameter(const std::string& name, at::Tensor& value) const = 0;
};

// Frees the data of every parameter of `module` (recursively, tied ones once): each keeps its
// shape, dtype and requires_grad over a storage without data. Parameters already deferred are left
// as they are. Throws c10::Error, deferring nothing, unless every parameter is fp32 on the CPU.
void defer_parameters(torch::nn::Module& module);

// Whether `t` is a deferred parameter's tensor (defer_parameters).
bool is_deferred(const at::Tensor& t);

// Gives every deferred parameter of `model` its value from its initializer (fp32 on the CPU), so
// that the model trains in plain LibTorch. Returns how many it gave a value. Throws c10::Error
// naming the parameter, changing nothing, when one has no initializer above it (an initializer that
// throws leaves the parameters before it with their values).
int64_t materialize_parameters(torch::nn::Module& model);

}  // namespace patrickstar
