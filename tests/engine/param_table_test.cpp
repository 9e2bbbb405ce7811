// The engine's parameter table and open doors (engine/src/param_table.h) on their own.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "param_table.h"

namespace patrickstar::engine_detail {
namespace param_table_test {

struct Net : torch::nn::Module {
  Net() {
    a = register_module("a", torch::nn::Linear(3, 4));
    b = register_module("b", torch::nn::Linear(4, 3));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

TEST(ParamTable, ATiedParameterGetsOneIdAndUnknownTensorsNone) {
  ParamTable table;  // keyed by TensorImpl: the tensors live as long as the table (as a model's)
  const at::Tensor v = torch::zeros({2});
  EXPECT_TRUE(table.add(v));
  const at::Tensor w = torch::ones({3});
  EXPECT_TRUE(table.add(w));
  EXPECT_FALSE(table.add(w));  // tied: the same TensorImpl
  EXPECT_EQ(table.id_of(w), 1);
  EXPECT_EQ(table.id_of(torch::ones({3})), -1);
  EXPECT_EQ(table.id_of(at::Tensor()), -1);
  table.create_entries();
  EXPECT_EQ(table.size(), 2u);
  table.clear();
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(table.id_of(w), -1);
}

TEST(ParamTable, AModuleListsEachOfItsParametersOnceAndRefusesUnregisteredOnes) {
  Net net;
  ParamTable table;
  for (const at::Tensor& t : net.parameters()) table.add(t);
  table.create_entries();
  table.name_module(net.a.get(), "a");
  int hooks_made = 0;
  ModuleInfo& a = table.module(*net.a, [&](ModuleInfo&) { ++hooks_made; });
  EXPECT_EQ(a.label, "a");
  EXPECT_EQ(a.params.size(), 2u);
  // The second lookup finds the same entry and makes no hooks.
  EXPECT_EQ(&table.module(*net.a, [&](ModuleInfo&) { ++hooks_made; }), &a);
  EXPECT_EQ(hooks_made, 1);
  net.a->register_parameter("late", torch::zeros({1}));
  EXPECT_THROW(table.module(net, [](ModuleInfo&) {}), c10::Error);
}

TEST(ParamTable, GatheredCountsReadOnlyAndReadWriteHolds) {
  ParamTable table;
  const std::vector<at::Tensor> tensors = {torch::zeros({1}), torch::zeros({1}), torch::zeros({1})};
  for (const at::Tensor& t : tensors) table.add(t);
  table.create_entries();
  table.set_gathered(0, GatherHold::kReadOnly);
  table.set_gathered(2, GatherHold::kReadWrite);
  EXPECT_EQ(table.gathered(), 2);
  EXPECT_EQ(table.gathered(/*for_write=*/true), 1);
  table.set_gathered(2, GatherHold::kNone);
  EXPECT_EQ(table.gathered(/*for_write=*/true), 0);
}

// The operations keep the entry's invariants: uses never go below zero (an end without a begin is
// not the last use), a pass counts once however many doors of it open, a landed gradient is
// defined and holds no use, and only a parameter with a gradient counts an Adam update.
TEST(ParamTable, OperationsKeepUsesPassesAndGradientsConsistent) {
  ParamTable table;
  const at::Tensor w = torch::zeros({2}).requires_grad_();
  table.add(w);
  table.create_entries();
  table.fill(0, "w", w, c10::Storage(), c10::Storage());
  EXPECT_EQ(table[0].name, "w");
  EXPECT_TRUE(table[0].trainable);

  EXPECT_FALSE(table.end_use(0));  // none open
  EXPECT_EQ(table[0].compute_refs, 0);
  EXPECT_TRUE(table.begin_use(0));
  EXPECT_FALSE(table.begin_use(0));  // a second door over it
  EXPECT_FALSE(table.end_use(0));
  EXPECT_TRUE(table.end_use(0));
  EXPECT_EQ(table[0].compute_refs, 0);

  table.note_pass(0, 0);
  table.note_pass(0, 0);  // another door of the plain forward
  table.note_pass(0, 7);  // a checkpointed block
  EXPECT_EQ(table[0].segments, 2);
  EXPECT_EQ(table[0].last_segment, 7);
  table.forget_passes(0);
  EXPECT_EQ(table[0].segments, 0);

  table.add_pending_gradient(0, torch::ones({2}, at::kBFloat16));
  table.add_pending_gradient(0, torch::ones({2}, at::kBFloat16));
  EXPECT_EQ(table[0].pending_grad.scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(table.take_pending_gradient(0), torch::full({2}, 2.0f)));
  EXPECT_FALSE(table[0].pending_grad.defined());

  table.hold_one_use(0);
  table.note_gradient(0);
  EXPECT_TRUE(table[0].has_grad);
  EXPECT_TRUE(table[0].grad.defined);
  EXPECT_EQ(table[0].compute_refs, 0);
  table.after_update(0, /*counted=*/true, /*consumed=*/true);
  EXPECT_FALSE(table[0].has_grad);
  EXPECT_TRUE(table[0].grad.consumed);
  EXPECT_EQ(table[0].adam_steps, 1);
  table.after_update(0, /*counted=*/true, /*consumed=*/false);  // no gradient: nothing counted
  EXPECT_EQ(table[0].adam_steps, 1);
  EXPECT_TRUE(table[0].grad.consumed);
  table.drop_gradient(0);
  EXPECT_FALSE(table[0].grad.consumed);

  table.show_grad(0, torch::zeros({2}), /*is_view=*/false, c10::Storage());
  EXPECT_TRUE(table[0].grad.tensor.defined());
  table.withdraw_grad(0);
  EXPECT_FALSE(table[0].grad.tensor.defined());
  EXPECT_FALSE(table[0].grad.is_view);
}

TEST(OpenDoors, TokensStayValidUntilTheLastDoorCloses) {
  OpenDoors<int> doors;
  const int64_t outer = doors.open(10);
  const int64_t inner = doors.open(20);
  EXPECT_NE(outer, inner);
  doors.close();  // the inner door
  EXPECT_FALSE(doors.none_open());
  ASSERT_TRUE(doors.valid(outer));
  EXPECT_EQ(doors[outer], 10);
  const int64_t next = doors.open(30);
  EXPECT_NE(next, outer);
  EXPECT_NE(next, inner);  // a closed door's token is not reused while doors are open
  doors.cancel_last();     // the door opened last failed to open
  EXPECT_FALSE(doors.valid(next));
  doors.close();
  EXPECT_TRUE(doors.none_open());
  EXPECT_FALSE(doors.valid(outer));
  EXPECT_THROW(doors.close(), c10::Error);  // closed twice
}

}  // namespace param_table_test
}  // namespace patrickstar::engine_detail
