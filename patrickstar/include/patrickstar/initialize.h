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
// `model->` reaches the user's module (typed), with the engine active for the whole expression;
// the doors inside the forward (patrickstar::call, ModuleScope) find this engine from the modules
// it registered, active or not. Both handles share the engine (the model handle copies cheaply;
// the optimizer, a torch::optim::Optimizer, moves).
// Not thread-safe.
#pragma once

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include "patrickstar/comm/communicator.h"
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
    Access(Engine& engine, ModuleType* module) : guard_(engine.activate()), module_(module) {}
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

// The optimizer side: a torch::optim::Optimizer, so helpers taking `torch::optim::Optimizer&` and
// LibTorch's LR schedulers (torch::optim::StepLR, ...) take it as they are.
//   - step() runs the engine's step (Adam/AdamW over the chunks) with the learning rate of
//     param_groups()[0] (set it, or let a scheduler set it). Called on an EngineOptimizer it
//     returns the IterationReport; through a base reference it returns the closure's loss.
//   - zero_grad() is the engine's. Through a base reference LibTorch's (not virtual) zero_grad runs
//     instead; it resets the engine's zero_grad_marker(), and the engine applies the zero_grad at
//     its next call, so the effect is the same.
//   - param_groups()[0] holds the model's parameters with options mirroring the config (lr, betas,
//     eps, weight_decay); param_groups()[1] holds only the engine's zero_grad marker. As
//     torch::optim's Adam reads its groups at every step, step() reads lr, betas, eps and
//     weight_decay from param_groups()[0] and applies them (a schedule of any of them works), or
//     refuses the step naming the option, nothing changed: amsgrad true, a beta outside [0, 1), a
//     negative eps, weight decay or lr, options of another optimizer type. Added param groups are
//     refused at step(). Gradients live in the chunks; after a backward, parameters' .grad()
//     are the engine's handles: views of the gradient slots in one process in fp32/bf16 (reads and
//     torch::nn::utils::clip_grad_norm_ act on them), else fences that refuse reads. The config's
//     "gradient_clipping" clips the global norm everywhere.
//   - torch::save(optimizer) is refused: the optimizer state lives in the chunks
//     (Engine::save_checkpoint).
// Move-only (as every torch::optim::Optimizer); it shares the engine with the model handle.
class EngineOptimizer : public torch::optim::Optimizer {
 public:
  explicit EngineOptimizer(std::shared_ptr<Engine> engine)
      : torch::optim::Optimizer(groups_of(*engine), defaults_of(*engine)), engine_(std::move(engine)) {}

  // The engine's zero_grad: set_to_none false keeps, as in LibTorch, the gradients defined at zero
  // (the next step updates those parameters even where the loss does not reach them).
  void zero_grad(bool set_to_none = true) const { engine_->zero_grad(set_to_none); }
  // The engine's step; returns its report.
  IterationReport step() {
    sync_options();
    return engine_->step();
  }
  // torch::optim::Optimizer's step (a base reference's step() comes here): runs `closure` first
  // when given (it does the forward and backward) and returns its loss.
  at::Tensor step(LossClosure closure) override {
    at::Tensor loss;
    if (closure != nullptr) loss = closure();
    step();
    return loss;
  }
  void save(torch::serialize::OutputArchive& /*archive*/) const override { refuse("save"); }
  void load(torch::serialize::InputArchive& /*archive*/) override { refuse("load"); }

  double loss_scale() const { return engine_->loss_scale(); }
  Engine& engine() const { return *engine_; }

 private:
  static std::vector<torch::optim::OptimizerParamGroup> groups_of(Engine& engine) {
    std::vector<at::Tensor> params;
    std::unordered_set<const c10::TensorImpl*> seen;  // tied parameters once
    for (const at::Tensor& t : engine.module().parameters(/*recurse=*/true)) {
      if (seen.insert(t.unsafeGetTensorImpl()).second) params.push_back(t);
    }
    return {torch::optim::OptimizerParamGroup(std::move(params)),
            torch::optim::OptimizerParamGroup({engine.zero_grad_marker()})};
  }
  static std::unique_ptr<torch::optim::OptimizerOptions> defaults_of(const Engine& engine) {
    const OptimizerConfig& o = engine.config().optimizer;
    if (o.type == OptimizerType::kAdamW) {
      return std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(
              o.weight_decay));
    }
    return std::make_unique<torch::optim::AdamOptions>(
        torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  }
  // torch::optim's Adam and AdamW read their group's options at every step; so does this: lr,
  // betas, eps and weight_decay go to the engine before its step, or the step is refused naming
  // the option, nothing changed.
  void sync_options() {
    TORCH_CHECK(param_groups().size() == 2, "patrickstar: EngineOptimizer trains the model the engine "
                "registered; param groups added to it (add_param_group) are not supported");
    torch::optim::OptimizerOptions& options = param_groups().front().options();
    const bool adamw = engine_->config().optimizer.type == OptimizerType::kAdamW;
    std::tuple<double, double> betas;
    double eps = 0, weight_decay = 0;
    bool amsgrad = false;
    if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&options); w != nullptr && adamw) {
      betas = w->betas(), eps = w->eps(), weight_decay = w->weight_decay(), amsgrad = w->amsgrad();
    } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&options);
               a != nullptr && !adamw) {
      betas = a->betas(), eps = a->eps(), weight_decay = a->weight_decay(), amsgrad = a->amsgrad();
    } else {
      TORCH_CHECK(false, "patrickstar: param_groups()[0]'s options must stay torch::optim::",
                  adamw ? "AdamWOptions" : "AdamOptions", " (the config's optimizer.type \"",
                  adamw ? "AdamW" : "Adam", "\"); the engine cannot change its optimizer");
    }
    TORCH_CHECK(!amsgrad,
                "patrickstar: param_groups()[0] option amsgrad is true: the engine's "
                "Adam keeps no running maximum of the variance (torch's AMSGrad); set it false");
    const double lr = options.get_lr();
    TORCH_CHECK(lr >= 0 && std::isfinite(lr), "patrickstar: param_groups()[0] option lr is ", lr,
                ": the learning rate must be finite and not negative");
    const AdamHyperparameters now = engine_->adam_hyperparameters();
    const auto [beta1, beta2] = betas;
    if (beta1 != now.beta1 || beta2 != now.beta2 || eps != now.eps ||
        weight_decay != now.weight_decay) {
      engine_->set_adam_hyperparameters(beta1, beta2, eps, weight_decay);  // checks, or throws
    }
    if (lr != engine_->lr()) engine_->set_lr(lr);
  }
  [[noreturn]] static void refuse(const char* what) {
    TORCH_CHECK(false, "patrickstar: torch::", what, "(optimizer) is not supported: the optimizer "
                "state lives in the engine's chunks; use Engine::save_checkpoint / load_checkpoint");
  }

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
// Data parallel: the process group comes from the launcher (communicator_from_env: mpirun gives
// MPI, otherwise one process); every process calls this with the same factory and config, and
// rank 0's initial weights are broadcast. local_rank is the process's index on its machine (the
// device it would use): 0 in one process, below the world size under a launcher.
template <typename Factory>
auto initialize_engine(Factory&& factory, int local_rank, const Config& config) {
  std::shared_ptr<Communicator> comm = communicator_from_env();
  TORCH_CHECK(local_rank >= 0 && local_rank < comm->world_size(),
              "patrickstar::initialize_engine: local_rank ", local_rank, " but ",
              comm->world_size() == 1
                  ? std::string("this process was not started by a launcher (one process, local_rank 0)")
                  : "the launcher started " + std::to_string(comm->world_size()) + " processes");
  // Count the model's construction: the initialization peak includes the factory's allocations.
  CountingCpuAllocator& counter = CountingCpuAllocator::install();
  const int64_t live_before = counter.live_bytes();
  int64_t construction_peak = 0;
  auto module = [&] {
    ScopedPeakWindow window(counter);  // its own: another engine may be training meanwhile
    auto built = detail::module_shared_ptr(factory());
    construction_peak = window.peak_bytes() - live_before;
    return built;
  }();
  using ModuleType = typename decltype(module)::element_type;
  // On a GPU each rank takes its own: local_rank, unless the config names one.
  Config with_device = config;
  if (with_device.device.index == DeviceConfig::kLocalRankIndex)
    with_device.device.index = local_rank;
  auto engine = std::make_shared<Engine>(module, std::move(with_device), std::move(comm));
  engine->note_model_construction_peak(construction_peak);
  return std::make_pair(EngineModel<ModuleType>(engine, module), EngineOptimizer(engine));
}

}  // namespace patrickstar
