// The CUDA backend of the cheri_block family: not written yet. The launchers are in place so that
// the entry points dispatch as every operator's do; until the kernels arrive they refuse the call.
#include "fusekit/error.h"
#include "ops/cheri_block/cheri_block_params.h"

namespace fusekit::detail {

namespace {

[[noreturn]] void not_implemented(const char* function) {
  throw Error(concat(function, ": the CUDA backend is not implemented yet; run it on the CPU"));
}

}  // namespace

void launch_dilated_conv_norm(const CheriBlockParams& /*p*/, int /*device*/, Stream /*stream*/) {
  not_implemented("dilated_conv_norm");
}

void launch_dilated_conv_norm_backward(const CheriBlockParams& /*p*/, int /*device*/,
                                       Stream /*stream*/) {
  not_implemented("dilated_conv_norm_backward");
}

void launch_cheri_block(const CheriBlockParams& /*p*/, int /*device*/, Stream /*stream*/) {
  not_implemented("cheri_block");
}

void launch_cheri_block_backward(const CheriBlockParams& /*p*/, int /*device*/,
                                 Stream /*stream*/) {
  not_implemented("cheri_block_backward");
}

void launch_cheri_block_inference(const CheriBlockParams& /*p*/, int /*device*/,
                                  Stream /*stream*/) {
  not_implemented("cheri_block_inference");
}

}  // namespace fusekit::detail
