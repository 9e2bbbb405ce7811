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
  table[0].gathered = GatherHold::kReadOnly;
  table[2].gathered = GatherHold::kReadWrite;
  EXPECT_EQ(table.gathered(), 2);
  EXPECT_EQ(table.gathered(/*for_write=*/true), 1);
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
