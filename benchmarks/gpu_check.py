"""Each GPU kernel path against its reference path, on the GPU: value and gradients, bf16 inputs.

  python benchmarks/gpu_check.py [--out FILE.jsonl]

attention: tokamax Mosaic GPU / Triton flash attention vs the dense reference (MLA head dims 192/128 and grouped
query attention 128/128, causal, packed documents); experts: tokamax's grouped GEMM vs the blocked path; dispatch:
ragged_all_to_all vs the fixed-slot all_to_all path (one GPU's expert axis); fp8: train.fp8's FP8 GEMMs vs the same
recipe on float32 copies of its e4m3 operands; loss: chunked vs full logits;
attention memory: the compiled temporaries of value and gradients for packed documents at two lengths, per
kernel (cuDNN's dense mask grows with the square of the length, the others linearly). Kernels this GPU's compute
capability cannot run (choice.attention_kind / matmul_kind refuse them) are reported as skipped. Prints one line
per check and appends JSON lines; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxseek.errors import UserError
from jaxseek.kernels import choice, flash, fp8_gemm, fp8_grouped, gpu, grouped
from jaxseek.kernels.attention import dense_attention
from jaxseek.model import loss as loss_lib
from jaxseek.sharding import exchange, experts


def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def compare(fn, ref, args, tol):
  """Relative errors of value and gradients (wrt every argument) of fn against ref, both jitted."""
  w = jax.random.normal(jax.random.key(9), jax.eval_shape(ref, *args).shape, jnp.float32)
  both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(lambda *b: (f(*b).astype(jnp.float32) * w).sum(),
                                                         argnums=tuple(range(len(a))))(*a)))
  (out, grads), (rout, rgrads) = both(fn)(*args), both(ref)(*args)
  errs = [rel_err(out, rout)] + [rel_err(g, r) for g, r in zip(grads, rgrads)]
  return {"errors": errs, "ok": all(e <= tol for e in errs), "tol": tol}


def attention_cases():
  B, T = 2, 1024
  segments = jnp.concatenate([jnp.full((B, 300), 1), jnp.full((B, 500), 2), jnp.full((B, 224), 3)], 1).astype(jnp.int32)
  for name, N, G, K, P in [("mla 192/128", 16, 16, 192, 128), ("gqa 128, 16 over 4", 16, 4, 128, 128)]:
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, N, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, G, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, G, P), jnp.bfloat16)
    for packed in (False, True):
      seg = segments if packed else None
      ref = lambda q, k, v: dense_attention(q, k, v, seg, K**-0.5)
      for impl in ("mosaic", "triton", "cudnn", "blocked"):
        if impl == "blocked":
          fn = lambda q, k, v: flash.attention(q, k, v, seg, K**-0.5)
        else:
          fn = lambda q, k, v, impl=impl: gpu.tokamax_attention(q, k, v, seg, K**-0.5, implementation=impl)
        yield f"attention {impl} {name}{' packed' if packed else ''}", fn, ref, (q, k, v), 2e-2


def expert_cases():
  R, D, M, E = 8192, 2048, 512, 32
  ks = jax.random.split(jax.random.key(1), 4)
  sizes = jnp.asarray(np.random.default_rng(0).multinomial(R, np.ones(E) / E), jnp.int32)
  x = jax.random.normal(ks[0], (R, D), jnp.bfloat16)
  ws = [(jax.random.normal(kk, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
        for kk, s in zip(ks[1:], [(E, D, M), (E, D, M), (E, M, D)])]
  ref = lambda x, *w: grouped.ffn_blocked(x, sizes, *w)
  for impl in ("mosaic", "triton"):
    yield f"experts tokamax {impl}", lambda x, *w, impl=impl: grouped.ffn_tokamax(x, sizes, *w, implementation=impl), \
        ref, (x, *ws), 2e-2


def dispatch_cases():
  """The exact-size dispatch (ragged_all_to_all, its plan and receive layout) against the fixed-slot path, on an
  expert axis of one GPU: the same routed copies, the same experts, bfloat16 and FP8 rows."""
  X, D, M, E, K = 4096, 2048, 512, 32, 4
  ks = jax.random.split(jax.random.key(3), 6)
  idx = jax.lax.top_k(jax.random.normal(ks[0], (X, E)), K)[1].astype(jnp.int32)
  weights = jax.nn.softmax(jax.random.normal(ks[1], (X, K)), -1)
  x = jax.random.normal(ks[2], (X, D), jnp.bfloat16)
  ws = [(jax.random.normal(kk, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
        for kk, s in zip(ks[3:], [(E, D, M), (E, D, M), (E, M, D)])]
  mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
  cap = exchange.capacity(X, K, 1, E, None)
  rows = exchange.receive_rows(X, K, 1, cap, 2.0)
  on_mesh = lambda f: lambda x, w, *ws: jax.shard_map(lambda *a: f(a[0], idx, *a[1:])[0], mesh=mesh,
                                                        in_specs=jax.P(), out_specs=jax.P(), check_vma=False)(x, w, *ws)
  for fp8 in (False, True):
    fixed = on_mesh(lambda *a, fp8=fp8: experts.experts_parallel(*a, ("expert",), 1, cap, fp8_dispatch=fp8))
    ragged = on_mesh(lambda *a, fp8=fp8: experts.experts_parallel_ragged(*a, ("expert",), 1, cap, rows,
                                                                          fp8_dispatch=fp8))
    yield f"dispatch ragged vs fixed{' fp8' if fp8 else ''}", ragged, fixed, (x, weights, *ws), 2e-2


def fp8_cases():
  """train.fp8's GPU GEMMs against the same recipe through XLA's upcast path (the e4m3 values and scales are the
  same; only the kernels differ): a projection (XLA's FP8 GEMM; on sm_100 also cuDNN's MXFP8) and the experts'
  grouped SwiGLU (tokamax's Triton kernel on e4m3 rows vs lax.ragged_dot of their values)."""
  ks = jax.random.split(jax.random.key(4), 6)
  x = jax.random.normal(ks[0], (4, 2048, 2048), jnp.bfloat16)
  w = (jax.random.normal(ks[1], (2048, 1024), jnp.float32) * 0.02).astype(jnp.bfloat16)
  cc = choice.capability() or 0.0
  for recipe in ("rowwise", "tensorwise") + (("mxfp8",) if cc >= fp8_gemm.MXFP8_SM else ()):
    ref = lambda x, w, recipe=recipe: fp8_gemm.einsum("BTD,DF->BTF", x, w, recipe, upcast=True)
    yield f"fp8 projection {recipe}", lambda x, w, recipe=recipe: fp8_gemm.einsum("BTD,DF->BTF", x, w, recipe), \
        ref, (x, w), 2e-2
  R, D, M, E = 8192, 2048, 512, 32
  sizes = jnp.asarray(np.random.default_rng(0).multinomial(R, np.ones(E) / E), jnp.int32)
  xr = jax.random.normal(ks[2], (R, D), jnp.bfloat16)
  ws = [(jax.random.normal(kk, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
        for kk, s in zip(ks[3:], [(E, D, M), (E, D, M), (E, M, D)])]
  yield "fp8 experts rowwise", lambda x, *w: fp8_grouped.ffn(x, sizes, *w, "rowwise", True), \
      lambda x, *w: fp8_grouped.ffn(x, sizes, *w, "rowwise", False), (xr, *ws), 2e-2


def loss_cases():
  B, T, D, V = 4, 2048, 2048, 32768
  ks = jax.random.split(jax.random.key(2), 3)
  h = jax.random.normal(ks[0], (B, T, D), jnp.bfloat16)
  head = (jax.random.normal(ks[1], (D, V), jnp.float32) * 0.02).astype(jnp.bfloat16)
  targets = jax.random.randint(ks[2], (B, T), 0, V)
  mask = jnp.ones((B, T), jnp.float32)
  loss = lambda impl: lambda h, head: loss_lib.cross_entropy_sum(h, head, targets, mask, impl)[None]
  yield "loss chunked", loss("chunked"), loss("full"), (h, head), 1e-2


def attention_memory(impl: str, T: int, B: int = 1, N: int = 16, K: int = 192, P: int = 128, sharding=None) -> int:
  """Compiled temporary bytes of one packed-document attention's value and gradients (bf16, MLA head dims);
  `sharding`: where to compile (default: the default device; a compile-only GPU device for a deviceless run)."""
  q = jax.ShapeDtypeStruct((B, T, N, K), jnp.bfloat16, sharding=sharding)
  k = jax.ShapeDtypeStruct((B, T, N, K), jnp.bfloat16, sharding=sharding)
  v = jax.ShapeDtypeStruct((B, T, N, P), jnp.bfloat16, sharding=sharding)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sharding)
  if impl == "blocked":
    fn = lambda q, k, v, seg: flash.attention(q, k, v, seg, K**-0.5)
  else:
    fn = lambda q, k, v, seg: gpu.tokamax_attention(q, k, v, seg, K**-0.5, implementation=impl)
  loss = lambda q, k, v, seg: fn(q, k, v, seg).astype(jnp.float32).sum()
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def memory_rows(runs):
  for impl in ("mosaic", "triton", "cudnn", "blocked"):
    if not runs(impl):
      continue
    sizes = {T: attention_memory(impl, T) for T in (4096, 8192)}
    yield {"check": f"attention memory {impl}", "temp_bytes": sizes, "growth_4096_to_8192": sizes[8192] / sizes[4096]}


def can_run(name: str) -> str | None:
  """Why this GPU cannot run check `name`'s kernel (None: it can)."""
  cc = choice.capability()
  try:
    for impl in ("mosaic", "triton", "cudnn"):
      if f"attention {impl}" in name:
        choice.attention_kind(impl, 1024, "gpu", jnp.bfloat16, capability=cc,
                               head_dims=(192, 128) if "mla" in name else (128, 128))
    if "experts tokamax" in name:
      choice.matmul_kind("tokamax" if "mosaic" in name else "tokamax_triton", "gpu", jnp.bfloat16, capability=cc)
  except UserError as e:
    return str(e)
  return None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  print(f"devices: {jax.devices()}", flush=True)
  failed = 0
  for cases in (attention_cases, expert_cases, fp8_cases, dispatch_cases, loss_cases):
    for name, fn, ref, inputs, tol in cases():
      start = time.perf_counter()
      why = can_run(name)
      if why:
        print(f"skip {name}  ({why})", flush=True)
        continue
      try:
        row = compare(fn, ref, inputs, tol)
      except Exception as e:  # a kernel that does not build here is a failed check, not the end of the suite
        row = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
      row.update(check=name, seconds=round(time.perf_counter() - start, 1), device=jax.devices()[0].device_kind)
      failed += not row["ok"]
      print(("ok   " if row["ok"] else "FAIL ") + name + f"  {row.get('errors', row.get('error'))}", flush=True)
      if args.out:
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")
  for row in memory_rows(lambda impl: not can_run(f"attention {impl} mla")):
    row["device"] = jax.devices()[0].device_kind
    print(f"     {row['check']}: temporaries {row['temp_bytes']} bytes at lengths 4096/8192, "
          f"×{row['growth_4096_to_8192']:.2f} for twice the length", flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
