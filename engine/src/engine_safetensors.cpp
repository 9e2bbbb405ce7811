// Engine::save_safetensors: the master weights as a Hugging Face checkpoint, one chunk at a time.
#include <exception>
#include <memory>

#include <c10/util/Exception.h>

#include "engine_core.h"
#include "engine_internal.h"
#include "safetensors_format.h"

namespace patrickstar {
using namespace engine_detail;  // NOLINT: this folder's private helpers

SafetensorsSaveReport EngineCore::save_safetensors(const std::string& folder,
                                                   const SafetensorsOptions& options) const {
  // The states as they were before the backward, with the delayed update in flight written in.
  const StateAccess access = pipeline_->access();
  const Layout& layout = store().layout();
  // The plan: every parameter written, in chunk order (the order the values come in).
  std::vector<std::string> written_as(params_.size());
  SafetensorsFolderWriter::Plan plan;
  for (TensorId id : tensors_in_chunk_order(layout)) {
    const Param& p = params_[id];
    std::string name = options.rename ? options.rename(p.name) : p.name;
    if (name.empty()) continue;
    plan.emplace_back(name, p.tensor.sizes().vec());
    written_as[static_cast<size_t>(id)] = std::move(name);
  }
  // Rank 0 writes; every rank takes part in the gathers whatever happens to rank 0's files, so
  // that a failed write stops every rank at the agreement below rather than hanging the others.
  std::unique_ptr<SafetensorsFolderWriter> writer;
  std::string error;
  const auto guarded = [&](auto&& f) {
    if (!error.empty()) return;
    try {
      f();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
      writer.reset();
    } catch (const std::exception& e) {
      error = e.what();
      writer.reset();  // its temporary files go
    }
  };
  if (rank() == 0) {
    guarded([&] { writer = std::make_unique<SafetensorsFolderWriter>(folder, plan, options); });
  }
  const auto write = [&](TensorId id, const at::Tensor& value) {
    const std::string& name = written_as[static_cast<size_t>(id)];
    if (writer && !name.empty()) guarded([&] { writer->write(name, value); });
  };
  for (int64_t i = 0; i < layout.chunk_count(); ++i) {
    if (!dp_.values_from_owners()) {
      for (TensorId id : layout.tensors_in_chunk(i)) write(id, access.weight(id));
      access.finish_views();  // one chunk staged at a time (disk tier)
    } else {
      const at::Tensor chunk =
          dp_.master_chunk_everywhere(access, i, master_kind());  // a collective
      if (!writer) continue;                                // only rank 0 writes
      for (TensorId id : layout.tensors_in_chunk(i))
        write(id, DataParallel::value_in(store().layout(), chunk, id));
    }
  }
  SafetensorsSaveReport report;
  if (writer) guarded([&] { report = writer->commit(); });
  if (dp_.only_others_failed(!error.empty())) {
    error = "save_safetensors: rank 0 could not write \"" + folder + "\" (its error says why)";
  }
  TORCH_CHECK(error.empty(), error);
  return report;
}

}  // namespace patrickstar
