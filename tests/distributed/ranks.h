// What the data parallel tests share: the process group the launcher gives (one process under
// ctest's discovered tests, 2 or 4 ranks under mpirun) and this rank's rows of a global batch.
#pragma once

#include <memory>

#include <ATen/ATen.h>

#include "patrickstar/comm/communicator.h"

namespace patrickstar::test {

// One communicator per process, whichever test file asks first.
inline std::shared_ptr<Communicator> comm() {
  static std::shared_ptr<Communicator> instance = communicator_from_env();
  return instance;
}

// This rank's rows of a global batch (its rows divide evenly among the ranks).
inline at::Tensor my_rows(const at::Tensor& global) {
  const int64_t rows = global.size(0) / comm()->world_size();
  return global.narrow(0, comm()->rank() * rows, rows);
}

}  // namespace patrickstar::test
