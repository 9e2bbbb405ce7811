// Scheduler: decides, moment by moment, which chunks are on the compute device. The engine owns it
// and carries out its decisions through a ChunkMover. Not thread-safe: call it from the training
// thread.
//
// The policy, in plain words:
// - Budget. At moment m of an iteration after the warm-up, chunks may use
//     floor(capacity_bytes * overall_ratio) - max(non_model[m], non_model[m+1]) - reserve_bytes
//   bytes of the device, non_model taken from the warm-up trace (non_model[m+1] of the last moment
//   is the larger of the iteration's tail and the next iteration's first moment). The chunks
//   resident after moment m stay through the interval up to moment m+1, whose peak non_model[m+1]
//   measured, so chunk bytes + non-model bytes never exceed the capacity. During the warm-up (no
//   trace yet) the budget is floor(capacity_bytes * overall_ratio * warmup_ratio) - reserve_bytes,
//   raised to the bytes the moment's accessed chunks need, and to those plus the three chunks used
//   most recently before the moment as far as they fit next to the live non-model reading plus its
//   largest rise from one moment to the next so far (a block straddling two chunks must not send
//   one back and forth), and capped by floor(capacity_bytes * overall_ratio) minus the live
//   non-model reading the caller passes (kStatic, which never gives a chunk back, takes that whole
//   cap from the start).
// - Demand. At each moment every accessed chunk is made resident. Before any load, resident
//   chunks are evicted (moved to the host) until the resident bytes plus the bytes to load fit the
//   budget; this also shrinks the resident set when the budget fell. Chunks accessed at the moment
//   and chunks the mover reports as not movable (tensors in COMPUTE) are never evicted.
// - Eviction. kOpt: the resident chunk whose next use is farthest (Belady), next uses taken from
//   the warm-up trace flattened into one access sequence (moment by moment, within a moment in
//   recorded order) and wrapping into the next iteration; chunks never used again go first. Ties
//   (only chunks never used again can tie) go to the larger chunk, then the larger id. A chunk the
//   trace sends to the host (a host-side optimizer's, host_chunk_ids) before its next access counts
//   as never used again. kLru, and
//   every policy during the warm-up: least recently accessed first (same tie rule). kStatic (like
//   ZeRO-Offload): chunks marked static_on_device are loaded on first use and never evicted,
//   except that at kStep moments the accessed chunks go to the host (the host Adam reads the
//   gradients and writes new weights, which come back at their next use); other chunks are
//   evicted least recently used first.
// - Prefetch (kOpt and kLru, after the warm-up, prefetch_depth K > 0). After the demand loads of
//   moment m (in after_moment once m's compute is done, or in at_moment when
//   prefetch_after_compute is off), chunks accessed at moments m+1 .. m+K (wrapping) are loaded in
//   access order while they fit the smallest budget of the moments they stay resident through. kOpt
//   may evict for a prefetch what Belady would evict when the chunk is needed at moment t, and
//   nothing else: only when t's budget is the smallest of the window, and only chunks whose next
//   use is later than the prefetched chunk's and than that of every chunk accessed at m .. t-1
//   (those stay until t, and Belady might pick one of them at t). Otherwise the chunk waits for its
//   demand load. kLru prefetches into free budget only.
// - Early offload (kOpt and kLru, after the warm-up, in after_moment). A resident chunk that the
//   trace sends to the host (host_chunk_ids, a host-side optimizer's) before its next access leaves
//   the device as soon as a moment's compute is done with it, instead of at the step: the same
//   bytes cross either way, but with asynchronous moves the copy runs during the rest of the
//   backward instead of holding up the step. Issued after the moment's prefetches, which are
//   needed sooner.
// - Device-only chunks (ChunkInfo::device_only) are never evicted, whatever the policy would pick,
//   and are never sent to the host. Their bytes count against every moment: check_trace refuses a
//   moment whose chunks do not fit next to them, and the warm-up's floor includes them.
// - Host moments. Chunks a moment needs on the host (the host-side Adam's gradients and weights)
//   are moved there before the moment's loads, whatever the policy; prefetch never loads a chunk
//   that must go to the host before its use.
// - Errors. Accessed chunks alone above the budget, or non-model bytes alone above the capacity,
//   raise c10::Error naming the moment, the bytes needed and the budget.
// - Traffic. Every to_device counts its bytes as host-to-device, every to_host as device-to-host.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "patrickstar/memtracer/trace.h"

namespace patrickstar {

enum class EvictionPolicy { kOpt, kLru, kStatic };
const char* eviction_policy_name(EvictionPolicy policy);
// "opt", "lru" or "static"; throws c10::Error otherwise.
EvictionPolicy parse_eviction_policy(const std::string& name);

struct SchedulerOptions {
  int64_t capacity_bytes = 0;  // device capacity
  double overall_ratio = 1.0;  // share of the capacity this process may use
  int64_t reserve_bytes = 0;   // kept free (fragmentation, library workspaces)
  double warmup_ratio = 0.5;   // share of capacity*overall_ratio for chunks during the warm-up
  EvictionPolicy policy = EvictionPolicy::kOpt;
  int64_t prefetch_depth = 4;  // K moments of look-ahead; 0 disables prefetch
  // true: the engine calls after_moment(m) when moment m's compute is done (its chunks may move
  // again) and the prefetch runs there; false: at_moment prefetches, with m's chunks still pinned.
  bool prefetch_after_compute = true;
  // During the warm-up (no trace yet), a moment whose accessed chunks need more than its chunk
  // budget goes on, within the device's own limit (capacity_bytes less the live non-model bytes
  // and the reserve), instead of throwing; IterationStats::overdrafts counts such moments. The
  // engine sets it for "default_chunk_size": "auto", which then moves the model into smaller
  // chunks at the warm-up's step (set_trace would refuse that trace).
  bool warmup_overdraft = false;
};

struct ChunkInfo {
  int64_t bytes = 0;
  bool static_on_device = false;  // kStatic: kept on the device (the engine marks param chunks)
  // Never leaves the device, under every policy: it has no host home (optimizer states the engine
  // placed there because the host budget could not hold them). The caller puts it on the device
  // before the scheduler's first moment.
  bool device_only = false;
};

// What the scheduler asks of the chunk store. The engine implements it; the simulator fakes it.
class ChunkMover {
 public:
  virtual ~ChunkMover() = default;
  virtual bool on_device(int64_t chunk_id) = 0;
  // False while the chunk may not leave the device (a tensor in COMPUTE).
  virtual bool movable(int64_t chunk_id) = 0;
  virtual void to_device(int64_t chunk_id) = 0;
  virtual void to_host(int64_t chunk_id) = 0;
};

struct MoveEvent {
  int64_t iteration = 0;
  int64_t moment = 0;
  int64_t chunk_id = 0;
  int64_t bytes = 0;
  bool to_device = true;
  bool prefetch = false;
  int64_t start_us = 0;
  int64_t duration_us = 0;
};

// The device after a moment's moves.
struct MomentRecord {
  int64_t iteration = 0;
  int64_t moment = 0;
  MomentKind kind = MomentKind::kPreForward;
  std::string label;
  int64_t time_us = 0;
  int64_t chunk_bytes = 0;  // resident chunk bytes after the moment's moves
  int64_t non_model_bytes =
      -1;  // max(non_model[m], non_model[m+1]) from the trace; -1 when unknown
  int64_t budget_bytes = 0;
};

struct IterationStats {
  int64_t iteration = 0;
  bool warmup = false;
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  // Of h2d_bytes: set_trace's warm start, the chunks brought back at the end of the warm-up for the
  // first scheduled iteration (loads that iteration would otherwise make); 0 in other iterations.
  int64_t warm_start_h2d_bytes = 0;
  int64_t loads = 0;
  int64_t evictions = 0;
  int64_t prefetches = 0;       // prefetch loads issued
  int64_t prefetches_used = 0;  // prefetched chunks accessed before being evicted
  // after_moment's optional moves (prefetch, early offload) that a tier refused memory for: the
  // rest of that moment's optional moves were dropped and the chunks move at their use instead.
  int64_t optional_moves_refused = 0;
  int64_t peak_chunk_bytes = 0;
  int64_t peak_device_bytes = 0;      // chunks + non-model, when non-model is known
  std::vector<int64_t> budget_bytes;  // per moment
  // Warm-up moments that went past their chunk budget (SchedulerOptions::warmup_overdraft).
  int64_t overdrafts = 0;
};

// Usage (the engine):
//   Scheduler scheduler(options, chunk_table);
//   scheduler.begin_iteration();
//   at each moment m: scheduler.at_moment(m, kind, accessed_chunk_ids, mover);
//   after the warm-up's last moment: scheduler.set_trace(recorder.warmup_trace(), &mover);
//   scheduler.end_iteration();
class Scheduler {
 public:
  Scheduler(SchedulerOptions options, std::map<int64_t, ChunkInfo> chunks);

  // Adds or updates a chunk (bytes and static flag).
  void set_chunk(int64_t chunk_id, ChunkInfo info);
  // A new chunk table, outside an iteration (the engine moved the model into chunks of another
  // size, every chunk on the host): the trace, the residency and the recency go, the next
  // iteration is a warm-up; the history, the timeline and the clock stay.
  void replace_chunks(std::map<int64_t, ChunkInfo> chunks);
  const std::map<int64_t, ChunkInfo>& chunks() const { return chunks_; }
  const SchedulerOptions& options() const { return options_; }

  // Installs the warm-up trace: later moments use its budgets and its access order. Throws when the
  // non-model bytes alone, or the chunks one moment accesses, exceed a moment's budget. With a
  // mover, brings back chunks in order of first use while they fit every moment's budget (counted
  // in the current iteration); call it before the warm-up's end_iteration().
  void set_trace(const Trace& trace, ChunkMover* mover = nullptr);
  // The validation of set_trace alone: throws what set_trace would throw, changes nothing.
  void check_trace(const Trace& trace) const;
  // Forgets the trace, also in the middle of an iteration (the control flow changed): from now on
  // every moment is scheduled as in the warm-up, until the next set_trace.
  void drop_trace();
  bool has_trace() const { return has_trace_; }
  const Trace& trace() const { return trace_; }

  void begin_iteration();
  // Makes every chunk in `accessed` resident (evicting per policy within budget_bytes(m)), then
  // prefetches. With a trace, m must be a moment of it. During the warm-up, live_non_model_bytes
  // (the probe's reading now, if the caller has one) also caps the budget at floor(capacity *
  // overall_ratio) - live_non_model_bytes - reserve_bytes.
  // Chunks in `to_host` (a host-side optimizer's, at a kStep moment; disjoint from `accessed`)
  // are moved to the host first when they are on the device.
  void at_moment(int64_t m, MomentKind kind, const std::vector<int64_t>& accessed,
                 ChunkMover& mover, int64_t live_non_model_bytes = 0,
                 const std::vector<int64_t>& to_host = {});
  // Prefetches after moment m's compute (prefetch_after_compute): m's chunks are movable again, so
  // the prefetch may evict them as Belady would; then offloads early the chunks that go to the host
  // before their next use (also with prefetch_depth 0). A no-op during the warm-up and for kStatic.
  void after_moment(int64_t m, ChunkMover& mover);
  void end_iteration();
  // Forgets the iteration in progress (its statistics; the moves it made stand). The next
  // begin_iteration starts the same iteration number again. A no-op outside an iteration.
  void abort_iteration();

  // Makes room on the device for memory the scheduler does not place (data parallel: a comm
  // group's gathered chunks, whose bytes the trace counts as non-model): evicts at least `bytes`
  // of resident chunks, choosing as at the moment last scheduled, chunks that may move only.
  // Returns false, evicting nothing, when the movable chunks are not enough.
  bool make_room(int64_t bytes, ChunkMover& mover);

  // Chunk bytes allowed on the device at moment m (the warm-up budget before set_trace).
  int64_t budget_bytes(int64_t m) const;

  // The last kHistoryKept finished iterations' statistics (oldest first; nothing grows with the
  // run), and the one in progress.
  static constexpr size_t kHistoryKept = 64;
  const std::vector<IterationStats>& history() const { return history_; }
  const IterationStats& current_stats() const { return stats_; }

  // Timeline of every move and moment, kept while record_timeline is on: off by default, since it
  // grows with every iteration (the engine turns it on with Engine::set_record_timeline).
  const std::vector<MoveEvent>& moves() const { return moves_; }
  const std::vector<MomentRecord>& moment_records() const { return moment_records_; }
  void set_record_timeline(bool on) { record_timeline_ = on; }
  void clear_timeline();
  // Clock for timeline timestamps in microseconds (default: steady clock since construction).
  void set_clock(std::function<int64_t()> now_us);

 private:
  struct Candidate;
  void refresh_residency(ChunkMover& mover);
  const ChunkInfo& info(int64_t chunk_id) const;
  int64_t next_use(int64_t chunk_id, int64_t m) const;  // flattened position, INT64_MAX if never
  bool evict_to_fit(int64_t bytes_to_add, int64_t budget, int64_t m,
                    const std::set<int64_t>& pinned, int64_t prefetch_next_use, ChunkMover& mover);
  void load(int64_t chunk_id, int64_t m, bool prefetch, ChunkMover& mover);
  void evict(int64_t chunk_id, int64_t m, ChunkMover& mover);
  void prefetch_after(int64_t m, const std::set<int64_t>& pinned, ChunkMover& mover);
  // at_moment's warm-up measures for the moment accessing `accessed`: the largest rise of the live
  // non-model bytes so far, and the floor and window of the chunk budget (see budget_bytes).
  void measure_warmup_moment(const std::vector<int64_t>& accessed);
  // at_moment's loads (a moment other than kStatic's step): makes room within `budget` and loads
  // the chunks in `accessed` (`pinned`: the same, each once). Returns the budget, raised where the
  // warm-up overdraws; throws when the chunks do not fit.
  int64_t load_accessed(int64_t m, const std::vector<int64_t>& accessed,
                        const std::set<int64_t>& pinned, int64_t budget, ChunkMover& mover);
  std::string describe_moment(int64_t m) const;
  void install_trace(const Trace& trace, ChunkMover* mover);
  // For warm-up budget errors: the warm-up ratio that would give chunks `chunk_bytes`.
  std::string warmup_advice(int64_t chunk_bytes) const;

  SchedulerOptions options_;
  std::map<int64_t, ChunkInfo> chunks_;
  Trace trace_;
  bool has_trace_ = false;
  NextUseIndex index_;  // kOpt: when each chunk is needed next

  std::set<int64_t> resident_;
  int64_t resident_bytes_ = 0;
  std::map<int64_t, int64_t> last_access_;  // LRU clock per chunk
  int64_t access_clock_ = 0;
  std::set<int64_t> prefetched_;  // prefetched, not yet accessed

  // Warm-up: the bytes of this moment's chunks (floor) and of those plus the chunks used just before
  // (window; both plus the reserve), the live non-model reading of this moment and the last one
  // (-1: none yet), and its largest rise from one moment to the next.
  int64_t warmup_floor_bytes_ = 0;
  int64_t warmup_window_bytes_ = 0;
  int64_t warmup_non_model_bytes_ = 0;
  int64_t warmup_previous_non_model_bytes_ = -1;
  int64_t warmup_growth_bytes_ = 0;
  int64_t iteration_ = -1;
  int64_t last_moment_ = 0;  // the moment at_moment scheduled last
  bool in_iteration_ = false;
  IterationStats stats_;
  std::vector<IterationStats> history_;

  bool record_timeline_ = false;
  std::vector<MoveEvent> moves_;
  std::vector<MomentRecord> moment_records_;
  std::function<int64_t()> now_us_;
};

}  // namespace patrickstar
