"""FP8 (e4m3) weights with block scales, as DeepSeek-V3 checkpoints store them.

A weight W[out, in] stored as float8_e4m3fn comes with `<name>_scale_inv` S[⌈out/b⌉, ⌈in/b⌉] (b = 128 by
default; edge blocks are partial), and W_ij = float32(W8_ij) · S[i // b, j // b].
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from jaxseek.errors import UserError

FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn),)
BLOCK = (128, 128)


def scale_name(name: str) -> str:
  return f"{name}_scale_inv"


def block_size(quantization_config: dict | None) -> tuple[int, int]:
  """The weight block from config.json's `quantization_config` (FP8 only), 128×128 when absent."""
  if not quantization_config:
    return BLOCK
  method = quantization_config.get("quant_method")
  if method != "fp8":
    raise UserError(f"config.json quantization_config.quant_method {method!r} is not supported; jaxseek reads "
                    "fp8 block-scaled checkpoints or unquantised ones")
  block = quantization_config.get("weight_block_size") or BLOCK
  if len(block) != 2:
    raise UserError(f"config.json quantization_config.weight_block_size {block!r} must be [rows, columns]")
  return int(block[0]), int(block[1])


def dequantize(w8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
  """float32(w8) · scale_inv expanded over each block, one block row at a time (edge blocks partial)."""
  if w8.ndim != 2:
    raise UserError(f"FP8 tensor {name} has shape {list(w8.shape)}; block scales need a 2-D weight")
  rows, cols = w8.shape
  grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
  if tuple(scale_inv.shape) != grid:
    raise UserError(f"tensor {scale_name(name)} has shape {list(scale_inv.shape)}, expected {list(grid)} for "
                    f"{name} {list(w8.shape)} in {block[0]}×{block[1]} blocks")
  scale_inv = scale_inv.astype(np.float32)
  out = np.empty((rows, cols), np.float32)
  for i in range(grid[0]):
    r = slice(i * block[0], min((i + 1) * block[0], rows))
    out[r] = w8[r].astype(np.float32) * np.repeat(scale_inv[i], block[1])[:cols]
  return out
