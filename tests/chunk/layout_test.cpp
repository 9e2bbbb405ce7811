// Layout: first-fit packing in registration order, waste, the too-large error, and the chunk-size
// search against a brute force on random size sets.
#include "patrickstar/chunk/layout.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace patrickstar {
namespace layout_test {

using ::testing::HasSubstr;

// The reference: first-fit by scanning every open chunk (O(n * chunks)).
struct NaivePlacement {
  std::vector<TensorPlacement> placements;
  int64_t chunk_count = 0;
};

NaivePlacement naive_first_fit(const std::vector<int64_t>& numels, int64_t chunk_elems) {
  NaivePlacement out;
  std::vector<int64_t> used;
  for (int64_t n : numels) {
    size_t c = 0;
    while (c < used.size() && used[c] + n > chunk_elems) ++c;
    if (c == used.size()) used.push_back(0);
    out.placements.push_back({static_cast<int64_t>(c), used[c], n});
    used[c] += n;
  }
  out.chunk_count = static_cast<int64_t>(used.size());
  return out;
}

// Waste as the layout defines it: every group packed on its own, its chunk count rounded up to
// world_size, and with one process its last chunk cut to what it holds rounded up to 1024 elements.
int64_t naive_waste(const std::vector<int64_t>& numels, int64_t chunk_elems, int64_t world_size,
                    const std::vector<int>& groups = {}) {
  int64_t waste = 0;
  for (int group = 0; group <= 3; ++group) {
    std::vector<int64_t> mine;
    for (size_t i = 0; i < numels.size(); ++i) {
      if ((groups.empty() ? 0 : groups[i]) == group) mine.push_back(numels[i]);
    }
    if (mine.empty()) continue;
    int64_t total = 0;
    for (int64_t n : mine) total += n;
    const NaivePlacement placed = naive_first_fit(mine, chunk_elems);
    const int64_t chunks = (placed.chunk_count + world_size - 1) / world_size * world_size;
    int64_t capacity = chunks * chunk_elems;
    if (world_size == 1) {
      int64_t last_used = 0;
      for (const TensorPlacement& p : placed.placements) {
        if (p.chunk_index == chunks - 1) last_used = std::max(last_used, p.offset_elems + p.numel);
      }
      const int64_t cut =
          std::min(chunk_elems, std::max<int64_t>(1024, (last_used + 1023) / 1024 * 1024));
      capacity -= chunk_elems - cut;
    }
    waste += capacity - total;
  }
  return waste;
}

TEST(Layout, PacksFirstFitInRegistrationOrder) {
  Layout layout;
  // Chunk of 10: a(6) -> c0[0,6); b(5) -> c1[0,5); c(4) -> c0[6,10); d(3) -> c1[5,8);
  // e(3) -> c2[0,3) (c0 full, c1 has 2 left); f(2) -> c1[8,10).
  const std::vector<std::pair<std::string, int64_t>> tensors = {{"a", 6}, {"b", 5}, {"c", 4},
                                                                {"d", 3}, {"e", 3}, {"f", 2}};
  for (const auto& [name, n] : tensors) layout.add_tensor(name, {n});
  layout.finalize(10);
  const std::vector<TensorPlacement> expected = {{0, 0, 6}, {1, 0, 5}, {0, 6, 4},
                                                 {1, 5, 3}, {2, 0, 3}, {1, 8, 2}};
  ASSERT_EQ(layout.chunk_count(), 3);
  for (TensorId id = 0; id < layout.tensor_count(); ++id) {
    const TensorPlacement& p = layout.placement(id);
    EXPECT_EQ(p.chunk_index, expected[id].chunk_index) << layout.name(id);
    EXPECT_EQ(p.offset_elems, expected[id].offset_elems) << layout.name(id);
    EXPECT_EQ(p.numel, expected[id].numel) << layout.name(id);
  }
  EXPECT_EQ(layout.used_elems(0), 10);
  EXPECT_EQ(layout.used_elems(1), 10);
  EXPECT_EQ(layout.used_elems(2), 3);
  EXPECT_EQ(layout.waste_elems(), 7);
  EXPECT_EQ(layout.waste_bytes(at::kHalf), 14);
  EXPECT_EQ(layout.waste_bytes(at::kFloat), 28);
  EXPECT_NEAR(layout.waste_fraction(), 7.0 / 30.0, 1e-12);
  EXPECT_THAT(layout.summary(at::kFloat), HasSubstr("28 bytes"));
  const auto in_c1 = layout.tensors_in_chunk(1);
  EXPECT_EQ(std::vector<TensorId>(in_c1.begin(), in_c1.end()), (std::vector<TensorId>{1, 3, 5}));
}

TEST(Layout, KeepsNamesAndShapes) {
  Layout layout;
  const TensorId w = layout.add_tensor("fc.weight", {3, 4});
  const TensorId b = layout.add_tensor("fc.bias", {4});
  const TensorId s = layout.add_tensor("scalar", {});
  layout.finalize(100);
  EXPECT_EQ(layout.name(w), "fc.weight");
  EXPECT_EQ(layout.sizes(w).vec(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(layout.numel(w), 12);
  EXPECT_EQ(layout.sizes(b).vec(), (std::vector<int64_t>{4}));
  EXPECT_EQ(layout.numel(s), 1);
  EXPECT_EQ(layout.placement(s).offset_elems, 16);
  EXPECT_EQ(layout.total_numel(), 17);
  EXPECT_THROW(layout.add_tensor("late", {1}), c10::Error);
  EXPECT_THROW(layout.placement(3), c10::Error);
}

TEST(Layout, TensorLargerThanChunkNamesItAndTheSmallestWorkingSize) {
  Layout layout;
  layout.add_tensor("embed.weight", {50, 20});  // 1000
  layout.add_tensor("head.weight", {40, 30});   // 1200: the largest
  layout.add_tensor("ln.bias", {20});
  try {
    layout.finalize(800);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("'embed.weight'"));
    EXPECT_THAT(msg, HasSubstr("1000 elements"));
    EXPECT_THAT(msg, HasSubstr("a chunk holds 800"));
    EXPECT_THAT(msg, HasSubstr("1200"));
    EXPECT_THAT(msg, HasSubstr("head.weight"));
  }
  EXPECT_FALSE(layout.finalized());
  layout.finalize(1200);  // the size the error names works
  EXPECT_EQ(layout.chunk_count(), 2);
}

TEST(Layout, RandomSetsMatchNaiveFirstFitAndNeverSpan) {
  std::mt19937_64 rng(12345);
  for (int trial = 0; trial < 30; ++trial) {
    const int count = 1 + static_cast<int>(rng() % 300);
    const int64_t chunk_elems = 64 + static_cast<int64_t>(rng() % 4000);
    std::vector<int64_t> numels;
    Layout layout;
    for (int i = 0; i < count; ++i) {
      // Mostly small tensors, some close to the chunk size, a few empty.
      const int64_t n = (rng() % 10 == 0)   ? chunk_elems - static_cast<int64_t>(rng() % 32)
                        : (rng() % 20 == 0) ? 0
                                            : 1 + static_cast<int64_t>(rng() % (chunk_elems / 3));
      numels.push_back(n);
      layout.add_tensor("t" + std::to_string(i), {n});
    }
    layout.finalize(chunk_elems);
    const NaivePlacement ref = naive_first_fit(numels, chunk_elems);
    ASSERT_EQ(layout.chunk_count(), ref.chunk_count) << "trial " << trial;
    for (TensorId id = 0; id < count; ++id) {
      const TensorPlacement& p = layout.placement(id);
      EXPECT_EQ(p.chunk_index, ref.placements[id].chunk_index) << "trial " << trial << " id " << id;
      EXPECT_EQ(p.offset_elems, ref.placements[id].offset_elems)
          << "trial " << trial << " id " << id;
      EXPECT_LE(p.offset_elems + p.numel, chunk_elems);  // never spans two chunks
    }
    int64_t used = 0;
    for (int64_t c = 0; c < layout.chunk_count(); ++c) used += layout.used_elems(c);
    EXPECT_EQ(used, layout.total_numel());
    EXPECT_EQ(layout.waste_elems(), naive_waste(numels, chunk_elems, 1));
  }
}

TEST(Layout, ChunkSizeSearchMatchesBruteForce) {
  std::mt19937_64 rng(777);
  for (int trial = 0; trial < 40; ++trial) {
    const int count = 1 + static_cast<int>(rng() % 60);
    std::vector<int64_t> numels;
    for (int i = 0; i < count; ++i) numels.push_back(1 + static_cast<int64_t>(rng() % 900));
    const int64_t min_elems = 1 + static_cast<int64_t>(rng() % 1000);
    const int64_t step = 1 + static_cast<int64_t>(rng() % 40);
    const int64_t max_elems = min_elems + 200 + static_cast<int64_t>(rng() % 1500);
    const int64_t world = 1 + static_cast<int64_t>(rng() % 3);
    // Half the trials put tensors in groups 0 to 2 (the search packs each on its own).
    std::vector<int> groups;
    if (trial % 2 == 1) {
      for (int i = 0; i < count; ++i) groups.push_back(static_cast<int>(rng() % 3));
    }
    int64_t largest = 0;
    for (int64_t n : numels) largest = std::max(largest, n);

    // Brute force: every candidate that holds the largest tensor; least waste, smallest size.
    int64_t best_size = -1;
    int64_t best_waste = 0;
    for (int64_t size = min_elems; size <= max_elems; size += step) {
      if (size < largest) continue;
      const int64_t waste = naive_waste(numels, size, world, groups);
      if (best_size < 0 || waste < best_waste) {
        best_size = size;
        best_waste = waste;
      }
    }
    if (best_size < 0) {
      EXPECT_THROW(Layout::search_chunk_size(numels, min_elems, max_elems, step, world, groups),
                   c10::Error);
      continue;
    }
    const PackingResult r =
        Layout::search_chunk_size(numels, min_elems, max_elems, step, world, groups);
    EXPECT_EQ(r.chunk_elems, best_size) << "trial " << trial;
    EXPECT_EQ(r.waste_elems, best_waste) << "trial " << trial;

    Layout layout(world);
    for (int i = 0; i < count; ++i) {
      layout.add_tensor("t" + std::to_string(i), {numels[i]}, groups.empty() ? 0 : groups[i]);
    }
    layout.finalize_search(min_elems, max_elems, step);
    EXPECT_EQ(layout.chunk_elems(), best_size);
    EXPECT_EQ(layout.waste_elems(), best_waste);
    EXPECT_EQ(layout.chunk_count() % world, 0);
  }
}

TEST(Layout, SearchRejectsARangeBelowTheLargestTensor) {
  Layout layout;
  layout.add_tensor("big", {5000});
  try {
    layout.finalize_search(100, 4000, 100);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("'big'"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("5000"));
  }
}

TEST(Layout, WorldSizePadsChunkCountAndAssignsOwners) {
  Layout layout(/*world_size=*/4);
  for (int i = 0; i < 5; ++i) layout.add_tensor("t" + std::to_string(i), {10});
  layout.finalize(10);  // 5 full chunks, padded to 8
  EXPECT_EQ(layout.chunk_count(), 8);
  EXPECT_EQ(layout.waste_elems(), 30);
  EXPECT_EQ(layout.tensors_in_chunk(6).size(), 0u);
  EXPECT_EQ(layout.owner_rank(5), 1);
  EXPECT_EQ(layout.comm_group(5), 1);
  EXPECT_EQ(layout.owner_rank(3), 3);
  EXPECT_EQ(layout.comm_group(3), 0);
}

}  // namespace layout_test
}  // namespace patrickstar

namespace patrickstar {
namespace layout_test {

// Groups never share a chunk: first-fit would put the small group-1 tensor into chunk 0's hole, but
// group 1 is packed on its own, after group 0.
TEST(LayoutGroups, TensorsOfDifferentGroupsNeverShareAChunk) {
  Layout layout;
  const TensorId a = layout.add_tensor("a", {60});
  const TensorId e = layout.add_tensor("emb", {70}, /*group=*/1);
  const TensorId b = layout.add_tensor("b", {30});
  const TensorId f = layout.add_tensor("emb2", {20}, /*group=*/1);
  layout.finalize(100);
  EXPECT_EQ(layout.chunk_count(), 2);
  EXPECT_EQ(layout.placement(a).chunk_index, 0);
  EXPECT_EQ(layout.placement(b).chunk_index, 0);
  EXPECT_EQ(layout.placement(b).offset_elems, 60);
  EXPECT_EQ(layout.placement(e).chunk_index, 1);
  EXPECT_EQ(layout.placement(f).chunk_index, 1);
  EXPECT_EQ(layout.placement(f).offset_elems, 70);
  EXPECT_EQ(layout.chunk_group(0), 0);
  EXPECT_EQ(layout.chunk_group(1), 1);
  EXPECT_EQ(layout.waste_elems(), 2 * 100 - 180);
  EXPECT_THROW(layout.chunk_group(2), c10::Error);
  Layout bad;
  EXPECT_THROW(bad.add_tensor("x", {1}, -1), c10::Error);
}

// With 2 ranks each group fills whole comm groups: group 0's one chunk is padded to two, so the
// CPU-embedding group starts a comm group of its own.
TEST(LayoutGroups, EachGroupFillsWholeCommGroups) {
  Layout layout(/*world_size=*/2);
  layout.add_tensor("a", {60});
  const TensorId e = layout.add_tensor("emb", {70}, /*group=*/1);
  layout.add_tensor("b", {30});
  layout.finalize(100);
  EXPECT_EQ(layout.chunk_count(), 4);
  EXPECT_EQ(layout.placement(e).chunk_index, 2);
  EXPECT_EQ(layout.comm_group(2), 1);
  EXPECT_EQ(layout.chunk_group(1), 0);  // padding of group 0
  EXPECT_EQ(layout.chunk_group(2), 1);
  EXPECT_EQ(layout.chunk_group(3), 1);  // padding of group 1
  EXPECT_EQ(layout.waste_elems(), 4 * 100 - 160);
}

// With one process each group's last chunk holds only what it uses (rounded up to 1024 elements);
// earlier chunks, and every chunk of a sharded layout, keep the chunk size.
TEST(LayoutCapacity, OneProcessCutsEachGroupsLastChunk) {
  Layout layout;
  const TensorId a = layout.add_tensor("a", {3000});
  layout.add_tensor("b", {3000});
  const TensorId c = layout.add_tensor("c", {100});  // first-fit: into chunk 0's hole
  layout.add_tensor("emb", {1500}, /*group=*/1);
  layout.finalize(4096);
  ASSERT_EQ(layout.chunk_count(), 3);
  EXPECT_EQ(layout.placement(a).chunk_index, 0);
  EXPECT_EQ(layout.placement(c).chunk_index, 0);
  EXPECT_EQ(layout.chunk_capacity(0), 4096);  // not a last chunk: keeps its hole
  EXPECT_EQ(layout.chunk_capacity(1), 3072);  // group 0's last: 3000 rounded up to 1024s
  EXPECT_EQ(layout.chunk_capacity(2), 2048);  // group 1's last: 1500
  EXPECT_EQ(layout.waste_elems(), (4096 - 3100) + (3072 - 3000) + (2048 - 1500));
  EXPECT_NEAR(layout.waste_fraction(), 1616.0 / (4096 + 3072 + 2048), 1e-12);
  EXPECT_THAT(layout.summary(), HasSubstr("9216 in all"));
  EXPECT_THROW(layout.chunk_capacity(3), c10::Error);

  // pack() and the search see the same capacities.
  const std::vector<int64_t> numels = {3000, 3000, 100, 1500};
  const std::vector<int> groups = {0, 0, 0, 1};
  EXPECT_EQ(Layout::pack(numels, 4096, 1, groups).waste_elems, layout.waste_elems());
  EXPECT_EQ(Layout::pack(numels, 4096, 1, groups).chunk_count, 3);
  // One group: 1500 fits neither hole, so it opens chunk 2, which is cut to 2048.
  EXPECT_EQ(Layout::pack(numels, 4096).waste_elems, (4096 - 3100) + (4096 - 3000) + (2048 - 1500));
  EXPECT_THROW(Layout::pack(numels, 4096, 1, std::vector<int>{0, 1}), c10::Error);

  Layout sharded(/*world_size=*/2);
  sharded.add_tensor("a", {3000});
  sharded.add_tensor("b", {3000});
  sharded.finalize(4096);
  EXPECT_EQ(sharded.chunk_capacity(1), 4096);  // collectives move equal slots
  EXPECT_EQ(sharded.waste_elems(), 2 * 4096 - 6000);

  // A chunk size at most the rounding is never cut.
  Layout small;
  small.add_tensor("x", {10});
  small.finalize(100);
  EXPECT_EQ(small.chunk_capacity(0), 100);
}

// The search packs groups on their own: a CPU embedding's group no longer shares the estimate
// with the rest, so the size it picks wastes what the placement then wastes. Here packing all
// tensors together would prefer 10,000 elements (a placement wasting 1,240 elements); per group,
// 6,000 wastes 168.
TEST(LayoutCapacity, SearchWasteIsThePlacementsWaste) {
  Layout layout;
  layout.add_tensor("emb", {4000}, /*group=*/1);
  for (int i = 0; i < 5; ++i) layout.add_tensor("w" + std::to_string(i), {3000});
  layout.finalize_search(5000, 10000, 500);
  std::vector<int64_t> numels = {4000};
  std::vector<int> groups = {1};
  for (int i = 0; i < 5; ++i) {
    numels.push_back(3000);
    groups.push_back(0);
  }
  int64_t best_size = -1, best_waste = 0;  // brute force with the reference's waste
  for (int64_t size = 5000; size <= 10000; size += 500) {
    const int64_t waste = naive_waste(numels, size, 1, groups);
    if (best_size < 0 || waste < best_waste) {
      best_size = size;
      best_waste = waste;
    }
  }
  EXPECT_EQ(best_size, 6000);
  EXPECT_EQ(best_waste, 168);
  EXPECT_EQ(layout.chunk_elems(), best_size);
  EXPECT_EQ(layout.waste_elems(), best_waste);
  // The one-group search's choice, and what its placement would really waste.
  const PackingResult flat = Layout::search_chunk_size(numels, 5000, 10000, 500);
  EXPECT_EQ(flat.chunk_elems, 10000);
  EXPECT_EQ(naive_waste(numels, flat.chunk_elems, 1, groups), 1240);
}

}  // namespace layout_test
}  // namespace patrickstar
