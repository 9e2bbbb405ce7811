// initialize_engine: the few lines that turn a LibTorch trainer into a patrickstar one.
//
//   auto config = patrickstar::Config::from_file("config.json");
//   auto [model, optimizer] = patrickstar::initialize_engine(
//       [] { return MyModel(/*...*/); }, /*local_rank=*/0, config);
//   for (auto& batch : data) {
//     optimizer.zero_grad();
//     auto loss = model->forward(batch.x, batch.y);   // the user's own forward and loss
//     model.backward(loss);
//     optimizer.step();
//   }
//
// `model->` reaches the user's module (typed) with the engine active for the whole expression, so
// the doors inside the forward (patrickstar::call, ModuleScope) report to this engine. Both handles
// share the engine; copies are cheap and refer to the same engine. Not thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include <c10/util/Exception.h>

#include "patrickstar/engine/config.h"
#include "patrickstar/engine/engine.h"
#include "patrickstar/memtracer/counting_allocator.h"

namespace patrickstar {

// What `model->` reaches when the model is a torch::nn::Sequential: its forward runs every entry
// behind its own door (patrickstar::call), so a Sequential needs no change at all.
class SequentialWithDoors {
 public:
  explicit SequentialWithDoors(torch::nn::SequentialImpl* sequential) : sequential_(sequential) {}
  at::Tensor forward(const at::Tensor& input) const { return call_sequential(*sequential_, input); }
  torch::nn::SequentialImpl& module() const { return *sequential_; }

 private:
  torch::nn::SequentialImpl* sequential_;
};

// The model side: typed access to the user's module, and backward.
template <typename ModuleType>
class EngineModel {
  static constexpr bool kSequential = std::is_same_v<ModuleType, torch::nn::SequentialImpl>;

 public:
  // Keeps the engine active on this thread while the expression `model->...` runs.
  class Access {
   public:
    Access(Engine& engine, ModuleType* module) : guard_(&engine), module_(module) {}
    auto operator->() const {
      if constexpr (kSequential) {
        doors_.emplace(module_);
        return &*doors_;
      } else {
        return module_;
      }
    }

   private:
    ActiveHandlerGuard guard_;
    ModuleType* module_;
    mutable std::optional<SequentialWithDoors> doors_;
  };

  EngineModel(std::shared_ptr<Engine> engine, std::shared_ptr<ModuleType> module)
      : engine_(std::move(engine)), module_(std::move(module)) {}

  Access operator->() const { return Access(*engine_, module_.get()); }
  // The module itself, without activating the engine (for inspection; its parameters hold no
  // data outside a forward).
  ModuleType& module() const { return *module_; }
  std::shared_ptr<ModuleType> module_ptr() const { return module_; }
  // Backward of the loss of the last forward (divided by gradient_accumulation_steps, as DeepSpeed
  // does, and multiplied by the loss scale in fp16).
  void backward(const at::Tensor& loss) const { engine_->backward(loss); }
  Engine& engine() const { return *engine_; }

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<ModuleType> module_;
};

// The optimizer side: zero_grad and step, as torch::optim.
class EngineOptimizer {
 public:
  explicit EngineOptimizer(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {}
  void zero_grad() const { engine_->zero_grad(); }
  IterationReport step() const { return engine_->step(); }
  double loss_scale() const { return engine_->loss_scale(); }
  Engine& engine() const { return *engine_; }

 private:
  std::shared_ptr<Engine> engine_;
};

namespace detail {
template <typename T>
struct is_shared_ptr : std::false_type {};
template <typename T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

template <typename T>
auto module_shared_ptr(T&& made) {
  if constexpr (is_shared_ptr<std::decay_t<T>>::value) {
    return std::forward<T>(made);
  } else {
    return made.ptr();  // a ModuleHolder such as torch::nn::Linear or models::Gpt
  }
}
}  // namespace detail

// Builds the model with `factory` (on the CPU, fp32), registers it into chunks and returns the two
// handles. `factory` returns a ModuleHolder (e.g. a TORCH_MODULE type) or a shared_ptr to a module.
// local_rank must be 0 in this single-process build (multi-GPU comes with the collectives).
template <typename Factory>
auto initialize_engine(Factory&& factory, int local_rank, const Config& config) {
  TORCH_CHECK(local_rank == 0, "patrickstar::initialize_engine: local_rank ", local_rank,
              " but this build trains in one process (local_rank 0); multi-GPU training comes "
              "with the collectives");
  // Count the model's construction: the initialization peak includes the factory's allocations.
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  const int64_t live_before = counter.live_bytes();
  counter.reset_peak();
  auto module = detail::module_shared_ptr(factory());
  const int64_t construction_peak = counter.peak_bytes() - live_before;
  using ModuleType = typename decltype(module)::element_type;
  auto engine = std::make_shared<Engine>(module, config);
  engine->note_model_construction_peak(construction_peak);
  return std::make_pair(EngineModel<ModuleType>(engine, module), EngineOptimizer(engine));
}

}  // namespace patrickstar
