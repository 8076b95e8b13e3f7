// The Python-side ForwardBatch and KDAAttnBackend (component.cc binds them; model.cc takes them too).
#pragma once

#include <memory>
#include <mutex>

#include "kda/kernels/kda/kda.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/model_executor/forward_batch_info.h"

namespace kda::python {

// The backend and a lock: a layer forward runs without the GIL and uses the backend's metadata and
// scratch, so forwards (and init_forward_metadata) on one backend from several Python threads take turns.
struct PyBackend {
  explicit PyBackend(kernels::KernelImpl k) : be(k) {}
  layers::attention::linear::KDAAttnBackend be;
  std::mutex mu;
};

struct PyForwardBatch {
  model_executor::ForwardBatch fb;
  std::shared_ptr<PyBackend> backend;  // the shared backend (fb.attn_backend points at it)

  void set_backend(std::shared_ptr<PyBackend> b) {
    backend = std::move(b);
    fb.attn_backend = backend ? &backend->be : nullptr;
  }
};

}  // namespace kda::python
