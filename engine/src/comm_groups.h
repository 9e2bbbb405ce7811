// Private to engine/src: data parallel's comm groups (docs/design.md section 9). Group g is the
// world_size consecutive chunk indices from g * world_size; rank r owns the r-th. For each group:
// whether the other ranks' param chunks are gathered here, whether it holds gradients not reduced
// yet, and how many of its tensors a door used since the gather. The engine does the collectives;
// this keeps their state and counts them. With one process there are no groups.
#pragma once

#include <cstdint>
#include <ranges>
#include <vector>

namespace patrickstar::engine_detail {

class CommGroups {
 public:
  // `tensors[g]`: how many tensors group g's chunks hold.
  void init(int world, const std::vector<int64_t>& tensors) {
    world_ = world;
    groups_.assign(tensors.size(), Group{});
    for (size_t g = 0; g < tensors.size(); ++g) groups_[g].tensors = tensors[g];
  }
  int64_t count() const { return static_cast<int64_t>(groups_.size()); }
  // The chunk index rank `rank` owns in group g, and all of the group's.
  int64_t index(int64_t g, int rank) const { return g * world_ + rank; }
  auto indices(int64_t g) const { return std::views::iota(index(g, 0), index(g + 1, 0)); }

  bool gathered(int64_t g) const { return at(g).gathered; }
  bool has_gradients(int64_t g) const { return at(g).has_gradients; }
  // Every tensor of group g was used by a door since its gather.
  bool all_used(int64_t g) const { return at(g).used >= at(g).tensors; }

  void on_gathered(int64_t g) {
    at(g).gathered = true;
    at(g).used = 0;
    ++gathers_;
  }
  void on_used(int64_t g) { ++at(g).used; }  // a tensor of it, for the first time since the gather
  void on_gradient(int64_t g) { at(g).has_gradients = true; }
  void on_reduced() { ++reduces_; }
  void on_released(int64_t g) {
    const int64_t tensors = at(g).tensors;
    at(g) = Group{};
    at(g).tensors = tensors;
  }
  int64_t gathers() const { return gathers_; }  // since the engine was built
  int64_t reduces() const { return reduces_; }

 private:
  struct Group {
    bool gathered = false;
    bool has_gradients = false;
    int64_t used = 0;
    int64_t tensors = 0;
  };
  Group& at(int64_t g) { return groups_[static_cast<size_t>(g)]; }
  const Group& at(int64_t g) const { return groups_[static_cast<size_t>(g)]; }

  int world_ = 1;
  std::vector<Group> groups_;
  int64_t gathers_ = 0;
  int64_t reduces_ = 0;
};

}  // namespace patrickstar::engine_detail
