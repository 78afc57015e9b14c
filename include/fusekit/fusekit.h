// Umbrella header: the whole public API of fusekit.
#pragma once

#include "fusekit/error.h"
#include "fusekit/runtime.h"
#include "fusekit/tensor.h"
#include "fusekit/ops/causal_attention.h"
#include "fusekit/ops/cheri_block.h"
#include "fusekit/ops/layernorm_linear_gelu.h"
#include "fusekit/ops/mhc_post.h"
#include "fusekit/ops/trimul.h"
