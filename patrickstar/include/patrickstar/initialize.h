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
#include <unordered_map>
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
//   - step() runs the engine's step (Adam/AdamW over the chunks). Called on an EngineOptimizer it
//     returns the IterationReport; through a base reference it returns the closure's loss.
//   - zero_grad() is the engine's. Through a base reference LibTorch's (not virtual) zero_grad runs
//     instead; it resets the engine's zero_grad_marker(), and the engine applies the zero_grad at
//     its next call, so the effect is the same.
//   - param_groups() holds one group per engine param group (Engine::param_groups(): group 0 the
//     parameters no configured group takes, then optimizer.param_groups in order, then no_decay),
//     each with its parameters and options mirroring its config (lr, betas, eps, weight_decay);
//     the last group holds only the engine's zero_grad marker. As torch::optim's Adam reads its
//     groups at every step, step() reads lr, betas, eps and weight_decay from each group and
//     applies them (a schedule of any of them works, per group: LibTorch's LR schedulers set every
//     group's lr), or refuses the step naming the group and option, nothing changed: amsgrad true,
//     a beta outside [0, 1), a negative eps, weight decay or lr, options of another optimizer
//     type. A group left as it was since the last step (or zero_grad()) takes the engine's options
//     where those changed (Engine::load_checkpoint restores them, Engine::set_lr sets them). Added
//     param groups are refused at step().
//   - Gradients live in the chunks; after a backward, parameters' .grad() are the engine's
//     handles: views of the gradient slots in one process in fp32/bf16 (reads and
//     torch::nn::utils::clip_grad_norm_ act on them), else fences that refuse reads. The config's
//     "gradient_clipping" clips the global norm everywhere.
//   - torch::save(optimizer) is refused: the optimizer state lives in the chunks
//     (Engine::save_checkpoint).
// Move-only (as every torch::optim::Optimizer); it shares the engine with the model handle.
class EngineOptimizer : public torch::optim::Optimizer {
 public:
  explicit EngineOptimizer(std::shared_ptr<Engine> engine)
      : torch::optim::Optimizer(groups_of(*engine), defaults_of(*engine)),
        engine_(std::move(engine)),
        given_(options_now(*engine_)) {}

  // The engine's zero_grad: set_to_none false keeps, as in LibTorch, the gradients defined at zero
  // (the next step updates those parameters even where the loss does not reach them).
  // It also hands the groups' options to the engine when they can be followed (a refusal waits for
  // step()): a schedule set before zero_grad() then reaches the overlapped step's updates made
  // during this backward, which would otherwise be computed with the last step's and undone.
  // (Not with the delayed update: its update in flight would have to land first.)
  void zero_grad(bool set_to_none = true) {
    if (!engine_->config().delayed_update.enabled) {
      try {
        sync_options();
      } catch (const c10::Error&) {  // step() refuses it, naming the option
      }
    }
    engine_->zero_grad(set_to_none);
  }
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
  // One group per engine param group (its parameters, its options), then the marker's.
  static std::vector<torch::optim::OptimizerParamGroup> groups_of(Engine& engine) {
    std::unordered_map<std::string, at::Tensor> by_name;
    for (const auto& item : engine.module().named_parameters(/*recurse=*/true)) {
      by_name.emplace(item.key(), item.value());
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const ParamGroupInfo& group : engine.param_groups()) {
      std::vector<at::Tensor> params;
      for (const std::string& name : group.names) params.push_back(by_name.at(name));
      groups.emplace_back(std::move(params), options_of(engine, group.options));
    }
    groups.emplace_back(std::vector<at::Tensor>{engine.zero_grad_marker()});
    return groups;
  }
  static std::unique_ptr<torch::optim::OptimizerOptions> options_of(const Engine& engine,
                                                                    const AdamHyperparameters& o) {
    if (engine.config().optimizer.type == OptimizerType::kAdamW) {
      return std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(
              o.weight_decay));
    }
    return std::make_unique<torch::optim::AdamOptions>(
        torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  }
  static std::unique_ptr<torch::optim::OptimizerOptions> defaults_of(const Engine& engine) {
    return options_of(engine, engine.adam_hyperparameters());
  }
  static std::vector<AdamHyperparameters> options_now(const Engine& engine) {
    return engine.param_group_options();
  }
  // Group `g`'s options as the trainer left them, or a refusal naming the option.
  AdamHyperparameters read_group(size_t g) {
    torch::optim::OptimizerOptions& options = param_groups()[g].options();
    const bool adamw = engine_->config().optimizer.type == OptimizerType::kAdamW;
    std::tuple<double, double> betas;
    AdamHyperparameters o;
    bool amsgrad = false;
    if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&options); w != nullptr && adamw) {
      betas = w->betas(), o.eps = w->eps(), o.weight_decay = w->weight_decay(),
      amsgrad = w->amsgrad();
    } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&options);
               a != nullptr && !adamw) {
      betas = a->betas(), o.eps = a->eps(), o.weight_decay = a->weight_decay(),
      amsgrad = a->amsgrad();
    } else {
      TORCH_CHECK(false, "patrickstar: param_groups()[", g,
                  "]'s options must stay torch::optim::", adamw ? "AdamWOptions" : "AdamOptions",
                  " (the config's optimizer.type \"", adamw ? "AdamW" : "Adam",
                  "\"); the engine cannot change its optimizer");
    }
    TORCH_CHECK(!amsgrad, "patrickstar: param_groups()[", g,
                "] option amsgrad is true: the engine's "
                "Adam keeps no running maximum of the variance (torch's AMSGrad); set it false");
    o.lr = options.get_lr();
    TORCH_CHECK(o.lr >= 0 && std::isfinite(o.lr), "patrickstar: param_groups()[", g,
                "] option lr is ", o.lr, ": the learning rate must be finite and not negative");
    std::tie(o.beta1, o.beta2) = betas;
    return o;
  }
  void write_group(size_t g, const AdamHyperparameters& o) {
    torch::optim::OptimizerOptions& options = param_groups()[g].options();
    options.set_lr(o.lr);
    if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      w->betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
    } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      a->betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
    }
  }
  // torch::optim's Adam and AdamW read their groups' options at every step; so does this: each
  // group's lr, betas, eps and weight_decay go to the engine before its step, or the step is
  // refused naming the group and option, nothing changed. A group the trainer left as it was since
  // the last step takes the engine's options instead where those changed (load_checkpoint restored
  // them, or Engine::set_lr was called).
  void sync_options() {
    const std::vector<AdamHyperparameters> engine_now = options_now(*engine_);
    const size_t n = engine_now.size();
    TORCH_CHECK(param_groups().size() == n + 1,
                "patrickstar: EngineOptimizer trains the model the "
                "engine registered in its ",
                n, " param group", n == 1 ? "" : "s",
                " (the config's "
                "optimizer.param_groups and no_decay); param groups added to it (add_param_group) "
                "are not supported");
    std::vector<AdamHyperparameters> wanted(n);
    for (size_t g = 0; g < n; ++g) wanted[g] = read_group(g);  // every refusal before any change
    std::vector<bool> pulled(n, false);
    for (size_t g = 0; g < n; ++g) {
      // Option by option: one the trainer left alone takes the engine's where that changed.
      for (auto field :
           {&AdamHyperparameters::beta1, &AdamHyperparameters::beta2, &AdamHyperparameters::eps,
            &AdamHyperparameters::weight_decay, &AdamHyperparameters::lr}) {
        if (wanted[g].*field == given_[g].*field && engine_now[g].*field != given_[g].*field) {
          wanted[g].*field = engine_now[g].*field;
          pulled[g] = true;
        }
      }
    }
    if (wanted != engine_now) engine_->set_param_group_options(wanted);  // checks, or throws
    for (size_t g = 0; g < n; ++g) {
      if (pulled[g]) write_group(g, wanted[g]);  // the engine's, now the group's too
    }
    given_ = std::move(wanted);
  }
  [[noreturn]] static void refuse(const char* what) {
    TORCH_CHECK(false, "patrickstar: torch::", what, "(optimizer) is not supported: the optimizer "
                "state lives in the engine's chunks; use Engine::save_checkpoint / load_checkpoint");
  }

  std::shared_ptr<Engine> engine_;
  std::vector<AdamHyperparameters> given_;  // each group's options the last step ran with
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
