// Private to engine/src: what a GatheredParameters scope (patrickstar/engine/gathered_parameters.h)
// asks of the engine that registered its parameters. EngineCore implements it; the public scope
// holds a pointer to this alone, so no public header reaches past Engine's pimpl.
//
// Invariants: a scope is added after its parameters were gathered and removed before they are
// given back; when the engine goes first it tells every scope still added (engine_gone), and
// such a scope writes nothing back.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "patrickstar/chunk/types.h"
#include "patrickstar/engine/gathered_parameters.h"

namespace patrickstar::engine_detail {

class ParameterGathering {
 public:
  // The registered parameter behind `t`, or -1.
  virtual TensorId gathered_id(const at::Tensor& t) const = 0;
  // Whether `buffer` is one the engine cast to the compute dtype (mixed precision).
  virtual bool cast_buffer(const at::Tensor& buffer) const = 0;
  // The version counter of parameter `id` (in-place writes in a read-only scope are reported).
  virtual int64_t parameter_version(TensorId id) const = 0;
  // Checks every id, then makes each a real fp32 tensor with the master weights; gather_end
  // writes them back (`write_back`) and returns them to their fences.
  virtual void gather_begin(const std::vector<TensorId>& ids, bool write_back) = 0;
  virtual void gather_end(const std::vector<TensorId>& ids, bool write_back) = 0;
  // The scopes open now, told when the engine goes.
  virtual void add_scope(GatheredParameters* scope) = 0;
  virtual void remove_scope(GatheredParameters* scope) = 0;

 protected:
  ~ParameterGathering() = default;
  // The engine goes while `scope` is open: it writes nothing back.
  static void engine_gone(GatheredParameters& scope) { scope.engine_ = nullptr; }
};

}  // namespace patrickstar::engine_detail
