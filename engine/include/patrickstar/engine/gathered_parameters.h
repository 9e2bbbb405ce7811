// Parameters outside the doors (DeepSpeed's GatheredParameters). Outside a forward the engine's
// parameters have no data; while a GatheredParameters scope lives, the chosen parameters are
// ordinary fp32 tensors holding the master weights:
//
//   {
//     patrickstar::GatheredParameters gathered(*model);     // every parameter of the model
//     torch::save(model, "model.pt");                        // a plain LibTorch archive
//   }
//   {
//     patrickstar::GatheredParameters gathered(*model->head);
//     torch::NoGradGuard no_grad;
//     model->head->weight.normal_(0, 0.02);                  // re-initialization, written back
//   }
//
// Read-write scopes (the default) write the values back into the chunks when they end: the fp32
// master and, in mixed precision, the half weights; optimizer state is unchanged. They open only
// between a step (or zero_grad) and the next forward. Read-only scopes open at any time and
// discard changes (in-place writes are reported with a warning). The parameters keep their identity
// (same tensors, shapes, requires_grad); in mixed precision they are fp32 in the scope and the half
// dtype again after it, and so are the module's buffers the engine cast (module form), so that
// torch::save / torch::load in the scope see the fp32 model. step() is refused while a read-write
// scope is open.
//
// The scope gives values, not gradients: a loss term over the parameters that must train (an L2
// penalty) goes behind the module's door (patrickstar::ModuleScope on the module, its result through
// done()), or is the optimizer's weight_decay. A door over a gathered parameter, or a gradient
// reaching one, throws c10::Error. A scope that outlives its engine writes nothing back (the engine
// warns and gives the model its fp32 master weights).
//
// Data parallel (several ranks): every rank opens and closes the same scopes in the same order
// (each gathers the chunks holding the parameters from their owners). Every rank reads every
// value; a read-write scope writes rank 0's values on every rank (as DeepSpeed's modifier rank), so
// a re-initialization needs no common seed; a shape changed on any rank writes nothing anywhere.
#pragma once

#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "patrickstar/chunk/types.h"
#include "patrickstar/engine/engine.h"

namespace patrickstar {
namespace engine_detail {
class ParameterGathering;  // what the scope asks of its engine (engine/src/parameter_gathering.h)
}  // namespace engine_detail

class GatheredParameters {
 public:
  enum class Mode { kReadWrite, kReadOnly };

  // Every parameter of `module` and its descendants; the engine is the one that registered it.
  explicit GatheredParameters(torch::nn::Module& module, Mode mode = Mode::kReadWrite);
  // Chosen parameters of `engine`'s model (each must be one of them). Throws c10::Error, changing
  // nothing, when a parameter is not the engine's, is in use by an open door, is held by another
  // scope, or (kReadWrite) a forward or backward is in progress.
  GatheredParameters(Engine& engine, const std::vector<at::Tensor>& params,
                     Mode mode = Mode::kReadWrite);
  // Ends the scope; a failure to write back is reported as a warning (call end() to get it thrown).
  ~GatheredParameters();
  GatheredParameters(const GatheredParameters&) = delete;
  GatheredParameters& operator=(const GatheredParameters&) = delete;

  // Writes back (kReadWrite) and returns the parameters to the engine. Throws c10::Error when a
  // parameter's shape or dtype was changed in the scope (nothing is written back then; the
  // parameters return to the engine with the values they had).
  void end();

 private:
  friend class engine_detail::ParameterGathering;  // tells open scopes when their engine goes
  void begin(const std::vector<at::Tensor>& params);

  engine_detail::ParameterGathering* engine_;  // nullptr once the engine is gone
  Mode mode_;
  std::vector<TensorId> ids_;
  std::vector<int64_t> versions_;  // the parameters' versions at the start (in-place writes)
  // Buffers the engine cast to the compute dtype (module form): fp32 in the scope; the half values.
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers_;
  bool ended_ = false;
};

}  // namespace patrickstar
