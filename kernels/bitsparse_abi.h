// Generated from bitsparse_core/backends/cuda/abi.py (abi.header()); do not edit.
#pragma once
#define BS_BF16 0
#define BS_FP16 1
#define BS_FP32 2
#define BS_E4M3 3
#define BS_E5M2 4
#define BS_MODE_PACK 0
#define BS_MODE_RELU 1
#define BS_MODE_RELU2 2
#define BS_MODE_MASKED 3
#define BS_MODE_RELU_GATED 4
#define BS_OP_UNPACK 0
#define BS_OP_RELU2 1
#define BS_OP_GATED 2
#define BS_OP_GATED_DENSE 3
#define BS_OP_RELU2_AND_SQUARE 4
#define BS_OP_GATED_PRODUCT 5
#define BS_THREADS 256
#define BS_WARPS 8
#define BS_STATUS_NOSIGN_VIOLATION 1
#define BS_STATUS_OVERFLOW 2
