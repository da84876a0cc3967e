"""Kernels: which implementation runs where, and the implementations the model calls.

  choice.py     which attention, expert GEMM and expert exchange run on the mesh's devices (model.attention_impl,
                model.moe_matmul, model.moe_dispatch), and the start-up line that names them
  attention.py  the one softmax attention: the dense reference, the blocked flash attention or a GPU kernel
  flash.py      the memory-linear blocked attention on any backend, with its recomputing backward
  grouped.py    the experts' grouped SwiGLU (blocked, ragged_dot or tokamax) and the dropless local experts
  gpu.py        the tokamax wrappers: flash attention with per-query key ranges, the grouped GEMM
  fp8.py        FP8 rounding with tile and block scales (train.fp8, FP8 dispatch)
"""
