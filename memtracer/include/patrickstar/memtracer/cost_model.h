// Predicted before measured: the time of one steady iteration on a GPU, from the iteration's
// moments (their compute, given as FLOPs and bytes) and the chunk moves the scheduler made in it,
// with the moves overlapped as the asynchronous copy queue would overlap them. Every figure the
// prediction rests on is a field of GpuCostModel, printed with the result; nothing is measured
// here. Pure functions of their arguments; thread-safe.
//
// The timeline: one compute stream and one copy queue, both in order.
// - The host waits for the end of the iteration before (the trainer reads the loss, the step
//   checks for overflow), then runs ahead of the GPU: an iteration's copies are issued at its
//   start, in the order the scheduler made them, each starting once the queue is free and the
//   compute of the last moment that touched the chunk (read it on the device or updated it with
//   the host Adam) is done, so the values it carries are final.
// - A moment computes once the compute before it is done and every chunk it accesses has
//   arrived (the last copy to the device of that chunk issued before the moment completes). The
//   time compute waits for a copy is exposed copy time.
// - A moment lasts flops / (peak_flops * compute_efficiency) + device_bytes / device_memory
//   bandwidth + host_adam_params / host_adam_params_per_s (the host Adam runs while the stream
//   waits for it, as the engine's step does).
// - The same iteration repeats: iterations are replayed until one lasts what the one before it
//   lasted (at most 16), and its length is the step time.
// - Where the host Adam runs against the iteration is the StepSchedule below: inside the step
//   moment as the engine runs it today (serial), on an optimizer thread as each chunk index's
//   gradients become final in backward (overlapped), or during the next iteration (delayed).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "patrickstar/memtracer/scheduler.h"
#include "patrickstar/memtracer/trace.h"

namespace patrickstar {

struct GpuCostModel {
  std::string name;
  double peak_flops = 0;                // dense half-precision tensor-core FLOP/s
  double compute_efficiency = 0;        // share of the peak a moment's kernels reach
  double h2d_bytes_per_s = 0;           // pinned host to device
  double d2h_bytes_per_s = 0;           // device to pinned host
  double device_memory_bytes_per_s = 0; // the device's memory bandwidth (Adam on the device)
  double host_adam_params_per_s = 0;    // the host Adam's rate
  std::string sources;                  // where each figure comes from, for the printout
};

// The named model ("h100"); throws c10::Error naming the known models otherwise.
GpuCostModel gpu_cost_model(const std::string& name);

// What a moment computes: matmul FLOPs, bytes the device reads and writes outside matmuls (the
// device Adam's states) and parameters the host Adam updates.
struct MomentCost {
  double flops = 0;
  double device_bytes = 0;
  double host_adam_params = 0;
};

// How the step's host Adam is placed against the iteration's compute.
enum class StepSchedule {
  // Every host update inside the step moment: the GPU waits for it (the engine today).
  kSerial,
  // Each chunk index's host update runs on an optimizer thread (one host resource, updates in
  // turn) as soon as its gradients are final (the moment `ready_after` is done) and its chunks are
  // home; its chunks' moves to the host at the step are issued right after that moment instead.
  // The step moment waits for the last update: the result is the serial step's.
  kOverlapped,
  // ZeRO-Offload's delayed parameter update: iteration t's host updates start after its step
  // moment and run while iteration t+1 computes; a chunk's load in iteration t+2 waits for them
  // (iteration t+1 computes with weights one update old), and so does iteration t+1's step moment
  // (one update in flight: the engine's step lands it before handing over its own). Assumes the
  // host keeps a second
  // gradient buffer, so the next step's gradients do not wait for the update reading the last.
  kDelayed,
};

// One chunk index's host Adam update: `params` parameters (at the host Adam's rate), whose
// gradients are final once moment `ready_after` is done; `chunk_ids`: the chunks it reads and
// writes (those the step moment accesses on the host).
struct HostUpdate {
  double params = 0;
  int64_t ready_after = -1;
  std::vector<int64_t> chunk_ids;
};

struct Prediction {
  double step_seconds = 0;          // one steady iteration, end to end
  double compute_seconds = 0;       // the moments' compute, summed (serial: with the host Adam)
  double host_adam_seconds = 0;     // the host Adam's work per iteration, wherever it runs
  double adam_wait_seconds =
      0;  // overlapped, delayed: the step moment waiting for the optimizer thread
  double h2d_seconds = 0;           // the copy queue busy with loads
  double d2h_seconds = 0;           // and with evictions
  double exposed_copy_seconds = 0;  // compute waiting for copies, per iteration
  double flops = 0;                 // per iteration
  double tflops = 0;                // flops / step_seconds / 1e12
  int64_t iterations_replayed = 0;
};

// `costs[m]` is moment m's compute (one per trace moment); `moves` are the moves of one scheduled
// iteration (MoveEvent::moment indexes the trace; their iteration field is ignored). Chunks not
// moved in the iteration stay where they are, ready. Throws c10::Error for costs of the wrong
// length, a move at a moment outside the trace, a chunk missing from `chunks`, or a model with a
// rate that is not positive.
Prediction predict_iteration(const Trace& trace, const std::vector<MomentCost>& costs,
                             const std::vector<MoveEvent>& moves,
                             const std::map<int64_t, ChunkInfo>& chunks, const GpuCostModel& model);

// The same with the host Adam placed by `schedule`. kSerial takes the host Adam from the moments'
// costs (MomentCost::host_adam_params) and ignores `updates`; kOverlapped and kDelayed take it
// from `updates` and ignore the moments' host_adam_params. Throws c10::Error also for an update
// ready after a moment outside the trace, or with a negative count of parameters.
Prediction predict_iteration(const Trace& trace, const std::vector<MomentCost>& costs,
                             const std::vector<MoveEvent>& moves,
                             const std::map<int64_t, ChunkInfo>& chunks, const GpuCostModel& model,
                             StepSchedule schedule, const std::vector<HostUpdate>& updates);

}  // namespace patrickstar
