// cheri_block on the CUDA backend (tests arrive with the kernels).
#include "cuda_test_support.h"
