// Export: statistics JSON, Chrome trace-event JSON and the SVG memory timeline, parsed back.
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "patrickstar/memtracer/export.h"
#include "patrickstar/memtracer/simulator.h"

namespace patrickstar {
namespace export_test {

SimulationResult small_run(int64_t* capacity) {
  GptLikeOptions gpt;
  gpt.layers = 3;
  gpt.chunk_elems = 256;
  gpt.activation_bytes_per_layer = 2048;
  gpt.step_non_model_bytes = 512;
  const SyntheticWorkload workload = make_gpt_like_workload(gpt);
  SimulationOptions options;
  options.scheduler.capacity_bytes = *capacity = workload.total_chunk_bytes / 2;
  options.scheduler.warmup_ratio = 1.0;
  options.iterations = 2;
  return simulate(workload.trace, workload.chunks, options);
}

TEST(Export, StatsJsonRoundTrips) {
  int64_t capacity = 0;
  const SimulationResult result = small_run(&capacity);
  const nlohmann::json parsed = nlohmann::json::parse(stats_to_json(result.iterations));
  ASSERT_EQ(parsed["iterations"].size(), result.iterations.size());
  for (size_t i = 0; i < result.iterations.size(); ++i) {
    const nlohmann::json& it = parsed["iterations"][i];
    const IterationStats& s = result.iterations[i];
    EXPECT_EQ(it["iteration"].get<int64_t>(), s.iteration);
    EXPECT_EQ(it["warmup"].get<bool>(), s.warmup);
    EXPECT_EQ(it["h2d_bytes"].get<int64_t>(), s.h2d_bytes);
    EXPECT_EQ(it["d2h_bytes"].get<int64_t>(), s.d2h_bytes);
    EXPECT_EQ(it["evictions"].get<int64_t>(), s.evictions);
    EXPECT_EQ(it["prefetches_used"].get<int64_t>(), s.prefetches_used);
    EXPECT_EQ(it["peak_device_bytes"].get<int64_t>(), s.peak_device_bytes);
    EXPECT_EQ(it["budget_bytes"].get<std::vector<int64_t>>(), s.budget_bytes);
  }
  EXPECT_TRUE(parsed["iterations"][0]["warmup"].get<bool>());
  EXPECT_GT(parsed["iterations"][1]["h2d_bytes"].get<int64_t>(),
            0);  // half the model fits: traffic

  TrafficBound bound;
  bound.h2d_bytes = 12;
  bound.proven = true;
  bound.method = "m";
  const nlohmann::json b = nlohmann::json::parse(bound_to_json(bound));
  EXPECT_EQ(b["h2d_bytes"].get<int64_t>(), 12);
  EXPECT_TRUE(b["proven"].get<bool>());
}

TEST(Export, ChromeTraceHasMovesAndCounters) {
  int64_t capacity = 0;
  const SimulationResult result = small_run(&capacity);
  ASSERT_FALSE(result.moves.empty());
  const nlohmann::json parsed =
      nlohmann::json::parse(chrome_trace_json(result.moves, result.moments, capacity));
  size_t complete = 0, counters = 0, h2d = 0;
  const int64_t warmup_moments = static_cast<int64_t>(result.iterations[0].budget_bytes.size());
  int64_t last_counter_ts = -1;
  for (const nlohmann::json& event : parsed["traceEvents"]) {
    const std::string ph = event["ph"];
    if (ph == "X") {
      ++complete;
      EXPECT_GE(event["dur"].get<int64_t>(), 1);
      EXPECT_GE(event["ts"].get<int64_t>(), 0);
      h2d += event["cat"] != "evict" ? 1 : 0;
    } else if (ph == "C") {
      ++counters;
      const int64_t ts = event["ts"].get<int64_t>();
      EXPECT_GE(ts, last_counter_ts);  // the logical clock only moves forward
      last_counter_ts = ts;
      // Counters follow result.moments; the warm-up's budget is a ratio, not a measurement.
      if (static_cast<int64_t>(counters) <= warmup_moments) continue;
      EXPECT_LE(event["args"]["chunk_bytes"].get<int64_t>() +
                    event["args"]["non_model_bytes"].get<int64_t>(),
                capacity);
    }
  }
  EXPECT_EQ(complete, result.moves.size());
  EXPECT_EQ(counters, result.moments.size());
  size_t loads = 0;
  for (const IterationStats& s : result.iterations) loads += static_cast<size_t>(s.loads);
  EXPECT_EQ(h2d, loads);
}

// A copy queue's timeline goes onto two more tracks: copies on "copy thread", blocking waits on
// "compute waits for copies", each an "X" event at the span's time; none without spans.
TEST(Export, ChromeTraceHasCopyAndWaitTracks) {
  int64_t capacity = 0;
  const SimulationResult result = small_run(&capacity);
  const std::vector<CopySpan> copies = {{1, false, "param chunk 0 (id 0) to device", 5, 40},
                                        {2, false, "grad chunk 3 (id 9) to host", 45, 0},
                                        {2, true, "", 30, 15}};
  auto threads_and_events = [&](const std::vector<CopySpan>& spans) {
    const nlohmann::json parsed =
        nlohmann::json::parse(chrome_trace_json(result.moves, result.moments, capacity, spans));
    std::map<int, std::string> names;
    std::vector<nlohmann::json> on_copy_tracks;
    for (const nlohmann::json& event : parsed["traceEvents"]) {
      if (event["name"] == "thread_name") names[event["tid"].get<int>()] = event["args"]["name"];
    }
    for (const nlohmann::json& event : parsed["traceEvents"]) {
      if (event["ph"] != "X") continue;
      const std::string track = names.at(event["tid"].get<int>());
      if (track == "copy thread" || track == "compute waits for copies") {
        on_copy_tracks.push_back(event);
        on_copy_tracks.back()["track"] = track;
      }
    }
    return std::make_pair(names, on_copy_tracks);
  };
  const auto [names, events] = threads_and_events(copies);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0]["track"], "copy thread");
  EXPECT_EQ(events[0]["name"], "param chunk 0 (id 0) to device");
  EXPECT_EQ(events[0]["ts"].get<int64_t>(), 5);
  EXPECT_EQ(events[0]["dur"].get<int64_t>(), 40);
  EXPECT_EQ(events[1]["dur"].get<int64_t>(), 1);  // a zero-length copy stays visible
  EXPECT_EQ(events[2]["track"], "compute waits for copies");
  EXPECT_EQ(events[2]["name"], "wait for copy 2");
  EXPECT_EQ(events[2]["ts"].get<int64_t>(), 30);
  EXPECT_EQ(events[2]["args"]["event"].get<int64_t>(), 2);
  const auto [plain_names, plain_events] = threads_and_events({});
  EXPECT_TRUE(plain_events.empty());
  for (const auto& [tid, name] : plain_names) EXPECT_NE(name, "copy thread");
}

TEST(Export, SvgPlotAndFile) {
  int64_t capacity = 0;
  const SimulationResult result = small_run(&capacity);
  const std::string svg = memory_timeline_svg(result.moments, capacity);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  size_t polylines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos;
       at = svg.find("<polyline", at + 1)) {
    ++polylines;
  }
  EXPECT_EQ(polylines, 5u);
  EXPECT_NE(svg.find("non-model bytes (activations)"), std::string::npos);
  EXPECT_NE(svg.find("bytes (MiB)"), std::string::npos);

  const std::string path =
      (std::filesystem::temp_directory_path() / "ps_memtracer_export_test.svg").string();
  write_text_file(path, svg);
  std::ifstream in(path);
  std::stringstream back;
  back << in.rdbuf();
  EXPECT_EQ(back.str(), svg);
  std::filesystem::remove(path);
  EXPECT_THROW(write_text_file("/nonexistent-dir/x.svg", svg), c10::Error);
}

}  // namespace export_test
}  // namespace patrickstar
