// What EngineCore hands its IterationMetrics (iteration_metrics.h): a moment's memory, the totals.
#include "engine_core.h"

#include "patrickstar/chunk/copy_queue.h"

#include "engine_internal.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

void EngineCore::note_memory(const std::string& moment) {
  // Data parallel: the probe adds the gathered groups' bytes, which are device tier blocks here
  // already (device_used_bytes); count them once.
  const int64_t non_model =
      probe_->live_bytes() - probe_->gathered_bytes();
  metrics_.note_memory(store(), non_model, tracker_.iteration(), moment);
}

RunningTotals EngineCore::running_totals() const {
  RunningTotals t;
  t.moves = store().move_counters();
  t.comm = dp_.counters();
  t.group_gathers = dp_.groups().gathers();
  t.group_reduces = dp_.groups().reduces();
  t.copy_wait_seconds =
      storage_.copy_queue() != nullptr ? storage_.copy_queue()->waited_seconds() : 0;
  t.collective_seconds = dp_.seconds();
  return t;
}

}  // namespace patrickstar
