// The CUDA backend of causal_attention: not written yet. The launcher is in place so that the
// entry point dispatches as every operator's does; until the kernels arrive it refuses the call.
#include "fusekit/error.h"
#include "ops/causal_attention/causal_attention_params.h"

namespace fusekit::detail {

void launch_causal_attention(const CausalAttentionParams& /*p*/, int /*device*/,
                             Stream /*stream*/) {
  throw Error("causal_attention: the CUDA backend is not implemented yet; run it on the CPU");
}

}  // namespace fusekit::detail
