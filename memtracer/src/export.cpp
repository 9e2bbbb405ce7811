#include "patrickstar/memtracer/export.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace patrickstar {

std::string stats_to_json(const std::vector<IterationStats>& iterations) {
  nlohmann::json list = nlohmann::json::array();
  for (const IterationStats& s : iterations) {
    list.push_back({{"iteration", s.iteration},
                    {"warmup", s.warmup},
                    {"h2d_bytes", s.h2d_bytes},
                    {"d2h_bytes", s.d2h_bytes},
                    {"loads", s.loads},
                    {"evictions", s.evictions},
                    {"prefetches", s.prefetches},
                    {"prefetches_used", s.prefetches_used},
                    {"peak_chunk_bytes", s.peak_chunk_bytes},
                    {"peak_device_bytes", s.peak_device_bytes},
                    {"budget_bytes", s.budget_bytes}});
  }
  return nlohmann::json{{"iterations", list}}.dump(2);
}

std::string bound_to_json(const TrafficBound& bound) {
  return nlohmann::json{{"h2d_bytes", bound.h2d_bytes},
                        {"d2h_bytes", bound.d2h_bytes},
                        {"loads", bound.loads},
                        {"evictions", bound.evictions},
                        {"period_iterations", bound.period_iterations},
                        {"proven", bound.proven},
                        {"method", bound.method}}
      .dump(2);
}

std::string chrome_trace_json(const std::vector<MoveEvent>& moves,
                              const std::vector<MomentRecord>& moments, int64_t capacity_bytes,
                              const std::vector<CopySpan>& copies,
                              const std::vector<CopySpan>& optimizer_thread) {
  constexpr int kPid = 1;
  constexpr int kComputeTid = 1;
  constexpr int kH2dTid = 2;
  constexpr int kD2hTid = 3;
  constexpr int kCopyTid = 4;
  constexpr int kWaitTid = 5;
  constexpr int kOptimizerTid = 6;
  nlohmann::json events = nlohmann::json::array();
  auto thread_name = [&](int tid, const char* name) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", kPid},
                      {"tid", tid},
                      {"args", {{"name", name}}}});
  };
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", kPid},
                    {"args", {{"name", "patrickstar device"}}}});
  thread_name(kComputeTid, "moments");
  thread_name(kH2dTid, "h2d issued");
  thread_name(kD2hTid, "d2h issued");
  if (!copies.empty()) {
    thread_name(kCopyTid, "copy thread");
    thread_name(kWaitTid, "compute waits for copies");
  }
  if (!optimizer_thread.empty()) thread_name(kOptimizerTid, "optimizer thread (host Adam ahead)");
  for (const CopySpan& span : optimizer_thread) {
    events.push_back({{"name", span.label},
                      {"cat", "adam ahead"},
                      {"ph", "X"},
                      {"ts", span.start_us},
                      {"dur", std::max<int64_t>(span.duration_us, 1)},
                      {"pid", kPid},
                      {"tid", kOptimizerTid}});
  }
  for (const CopySpan& span : copies) {
    events.push_back({{"name", span.wait ? "wait for copy " + std::to_string(span.event)
                                         : span.label},
                      {"cat", span.wait ? "copy wait" : "copy"},
                      {"ph", "X"},
                      {"ts", span.start_us},
                      {"dur", std::max<int64_t>(span.duration_us, 1)},
                      {"pid", kPid},
                      {"tid", span.wait ? kWaitTid : kCopyTid},
                      {"args", {{"event", span.event}}}});
  }
  for (const MoveEvent& move : moves) {
    const std::string name =
        std::string(move.to_device ? "h2d" : "d2h") + " chunk " + std::to_string(move.chunk_id);
    events.push_back({{"name", name},
                      {"cat", move.to_device ? (move.prefetch ? "prefetch" : "load") : "evict"},
                      {"ph", "X"},
                      {"ts", move.start_us},
                      {"dur", std::max<int64_t>(move.duration_us, 1)},
                      {"pid", kPid},
                      {"tid", move.to_device ? kH2dTid : kD2hTid},
                      {"args",
                       {{"chunk_id", move.chunk_id},
                        {"bytes", move.bytes},
                        {"iteration", move.iteration},
                        {"moment", move.moment}}}});
  }
  for (const MomentRecord& record : moments) {
    events.push_back({{"name", std::string(moment_kind_name(record.kind)) + " " + record.label},
                      {"cat", "moment"},
                      {"ph", "i"},
                      {"s", "t"},
                      {"ts", record.time_us},
                      {"pid", kPid},
                      {"tid", kComputeTid},
                      {"args", {{"iteration", record.iteration}, {"moment", record.moment}}}});
    nlohmann::json counters = {{"chunk_bytes", record.chunk_bytes},
                               {"budget_bytes", record.budget_bytes},
                               {"capacity_bytes", capacity_bytes}};
    if (record.non_model_bytes >= 0) counters["non_model_bytes"] = record.non_model_bytes;
    events.push_back({{"name", "device memory"},
                      {"ph", "C"},
                      {"ts", record.time_us},
                      {"pid", kPid},
                      {"args", counters}});
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

std::string memory_timeline_svg(const std::vector<MomentRecord>& moments, int64_t capacity_bytes) {
  constexpr double kWidth = 960, kHeight = 420;
  constexpr double kLeft = 80, kRight = 170, kTop = 30, kBottom = 50;
  const double plot_width = kWidth - kLeft - kRight;
  const double plot_height = kHeight - kTop - kBottom;
  constexpr double kMiB = 1024.0 * 1024.0;

  int64_t y_max = std::max<int64_t>(capacity_bytes, 1);
  for (const MomentRecord& r : moments) {
    y_max =
        std::max({y_max, r.chunk_bytes + std::max<int64_t>(r.non_model_bytes, 0), r.budget_bytes});
  }
  const size_t n = moments.size();
  auto x_at = [&](size_t i) {
    return kLeft +
           (n <= 1 ? 0.0 : plot_width * static_cast<double>(i) / static_cast<double>(n - 1));
  };
  auto y_at = [&](int64_t bytes) {
    return kTop + plot_height * (1.0 - static_cast<double>(bytes) / static_cast<double>(y_max));
  };
  auto number = [](double v) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.1f", v);
    return std::string(text);
  };
  auto polyline = [&](const char* color, const char* dash, auto value_of) {
    std::ostringstream points;
    for (size_t i = 0; i < n; ++i) {
      points << number(x_at(i)) << ',' << number(y_at(value_of(moments[i]))) << ' ';
    }
    std::ostringstream line;
    line << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\""
         << (dash[0] != '\0' ? std::string(" stroke-dasharray=\"") + dash + "\"" : "")
         << " points=\"" << points.str() << "\"/>\n";
    return line.str();
  };

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << "<text x=\"" << kLeft << "\" y=\"18\">Device memory per moment</text>\n";
  // Axes, ticks and labels.
  svg << "<line x1=\"" << kLeft << "\" y1=\"" << kTop + plot_height << "\" x2=\""
      << kLeft + plot_width << "\" y2=\"" << kTop + plot_height << "\" stroke=\"black\"/>\n";
  svg << "<line x1=\"" << kLeft << "\" y1=\"" << kTop << "\" x2=\"" << kLeft << "\" y2=\""
      << kTop + plot_height << "\" stroke=\"black\"/>\n";
  for (int tick = 0; tick <= 4; ++tick) {
    const int64_t bytes = y_max * tick / 4;
    svg << "<text x=\"" << kLeft - 6 << "\" y=\"" << number(y_at(bytes) + 4)
        << "\" text-anchor=\"end\">" << number(static_cast<double>(bytes) / kMiB) << "</text>\n";
  }
  svg << "<text x=\"16\" y=\"" << kTop + plot_height / 2 << "\" transform=\"rotate(-90 16 "
      << kTop + plot_height / 2 << ")\" text-anchor=\"middle\">bytes (MiB)</text>\n";
  svg << "<text x=\"" << kLeft + plot_width / 2 << "\" y=\"" << kHeight - 12
      << "\" text-anchor=\"middle\">moment (" << n << " moments over all iterations)</text>\n";
  // Series.
  svg << polyline("black", "6,3", [&](const MomentRecord&) { return capacity_bytes; });
  svg << polyline("gray", "2,2", [](const MomentRecord& r) { return r.budget_bytes; });
  svg << polyline("steelblue", "", [](const MomentRecord& r) { return r.chunk_bytes; });
  svg << polyline("darkorange", "",
                  [](const MomentRecord& r) { return std::max<int64_t>(r.non_model_bytes, 0); });
  svg << polyline("firebrick", "", [](const MomentRecord& r) {
    return r.chunk_bytes + std::max<int64_t>(r.non_model_bytes, 0);
  });
  // Legend.
  const char* names[] = {"capacity", "chunk budget", "chunk bytes", "non-model bytes (activations)",
                         "chunks + non-model"};
  const char* colors[] = {"black", "gray", "steelblue", "darkorange", "firebrick"};
  for (int i = 0; i < 5; ++i) {
    const double y = kTop + 10 + 18 * i;
    const double x = kLeft + plot_width + 12;
    svg << "<line x1=\"" << x << "\" y1=\"" << y << "\" x2=\"" << x + 20 << "\" y2=\"" << y
        << "\" stroke=\"" << colors[i] << "\" stroke-width=\"2\"/>";
    svg << "<text x=\"" << x + 26 << "\" y=\"" << y + 4 << "\">" << names[i] << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out.good(), "cannot open '", path, "' for writing");
  out << text;
  out.close();
  TORCH_CHECK(out.good(), "writing '", path, "' failed (disk full?)");
}

}  // namespace patrickstar
