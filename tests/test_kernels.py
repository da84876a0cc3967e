"""Every attention, expert-matmul and loss implementation against its reference, in value and gradient."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxseek import config as config_lib
from jaxseek.kernels import choice, flash, gpu, grouped
from jaxseek.kernels.attention import dense_attention
from jaxseek.model import loss as loss_lib

B, T = 2, 48
# packed rows: three documents, and one document with trailing padding (segment 0)
SEGMENTS = np.array([[1] * 10 + [2] * 20 + [3] * 18, [4] * 40 + [0] * 8], np.int32)


def qkv(N, G, K, P, t=T, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (B, t, N, K), dtype), jax.random.normal(ks[1], (B, t, G, K), dtype),
          jax.random.normal(ks[2], (B, t, G, P), dtype), jax.random.normal(ks[3], (B, t, N, P), jnp.float32))


def value_and_grads(attend, q, k, v, w):
  out = attend(q, k, v)
  grads = jax.grad(lambda *a: (attend(*a).astype(jnp.float32) * w).sum(), argnums=(0, 1, 2))(q, k, v)
  return out, grads


def assert_same(got, want, tol):
  (out, grads), (ref_out, ref_grads) = got, want
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=tol, rtol=tol)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=tol, rtol=tol)


# MLA-like (q/k head 12 = nope + rope, v 8, one key head per query head), grouped-query (6 heads over 2)
@pytest.mark.parametrize("N,G,K,P", [(4, 4, 12, 8), (6, 2, 10, 10)])
@pytest.mark.parametrize("packed", [False, True])
def test_blocked_attention_equals_dense(N, G, K, P, packed):
  q, k, v, w = qkv(N, G, K, P)
  seg = jnp.asarray(SEGMENTS) if packed else None
  got = value_and_grads(lambda q, k, v: flash.attention(q, k, v, seg, 0.3, block=16), q, k, v, w)
  assert_same(got, value_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, 0.3), q, k, v, w), 2e-5)


def test_blocked_attention_query_slice_of_the_sequence():
  """Context parallelism: queries 16..31 over all 48 keys, the keys' segment ids given apart."""
  q, k, v, w = qkv(4, 2, 12, 8)
  seg = jnp.asarray(SEGMENTS)
  args = lambda q: (q[:, 16:32], k, v, seg[:, 16:32], 0.3, seg, 16)
  want = dense_attention(*args(q))
  got = flash.attention(*args(q), block=8)
  np.testing.assert_allclose(got, want, atol=2e-6)
  g = jax.grad(lambda k: (flash.attention(q[:, 16:32], k, v, seg[:, 16:32], 0.3, seg, 16, block=8)
                          * w[:, 16:32]).sum())(k)
  r = jax.grad(lambda k: (dense_attention(q[:, 16:32], k, v, seg[:, 16:32], 0.3, seg, 16) * w[:, 16:32]).sum())(k)
  np.testing.assert_allclose(g, r, atol=2e-5)
  assert float(jnp.abs(g[:, 32:]).max()) == 0.0  # keys after the last query get no gradient


def test_blocked_attention_bfloat16_close_to_float32_reference():
  q, k, v, w = qkv(4, 4, 12, 8)
  bf = lambda a: a.astype(jnp.bfloat16)
  got = value_and_grads(lambda q, k, v: flash.attention(q, k, v, None, 0.3, block=16), bf(q), bf(k), bf(v), w)
  want = value_and_grads(lambda q, k, v: dense_attention(q, k, v, None, 0.3), q, k, v, w)
  assert_same(got, want, 6e-2)


def test_blocked_attention_skips_masked_causal_blocks():
  """Query block i visits key blocks 0..i only: the key-block loop runs nq·(nq+1)/2 times, not nq²."""
  q, k, v, _ = qkv(2, 2, 4, 4, t=64)
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: flash.attention(q, k, v, None, 1.0, block=16))(q, k, v))
  assert "while" in jaxpr  # a loop whose trip count depends on the query block, not a fixed nq × nk scan
  assert [int(flash._visible_blocks(i, 0, 16, 16, 4)) for i in range(4)] == [1, 2, 3, 4]
  # queries 24..47 in blocks of 8 over key blocks of 16: last queries 31, 39, 47 reach key blocks 1, 2, 2
  assert [int(flash._visible_blocks(i, 24, 8, 16, 4)) for i in range(3)] == [2, 3, 3]


def test_block_size_divides_the_length():
  assert flash.block_size(48, 16) == 16 and flash.block_size(100, 16) == 10 and flash.block_size(12, 16) == 12
  # a length without a divisor of at least a quarter block is padded to whole blocks, not cut into 1-row blocks
  assert flash.blocks(48, 16) == (16, 48) and flash.blocks(100, 16) == (10, 100) and flash.blocks(12, 16) == (12, 12)
  assert flash.blocks(4099, 512) == (512, 4608) and flash.blocks(53, 16) == (16, 64)


@pytest.mark.parametrize("packed", [False, True])
def test_flash_on_a_prime_length_pads_to_whole_blocks_and_equals_dense(packed):
  """A prime sequence length (53, blocks of 16): the padded keys and queries change nothing, in value and
  gradient, and the loops run 16-row blocks (4 query blocks), not 53 blocks of one row."""
  t = 53
  q, k, v, w = qkv(4, 2, 8, 8, t=t)
  seg = jnp.asarray(np.concatenate([np.ones((B, 20), np.int32), 2 * np.ones((B, t - 20), np.int32)], 1)) \
      if packed else None
  got = value_and_grads(lambda q, k, v: flash.attention(q, k, v, seg, 0.3, block=16), q, k, v, w)
  assert_same(got, value_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, 0.3), q, k, v, w), 2e-5)
  jaxpr = jax.make_jaxpr(lambda q, k, v: flash.attention(q, k, v, seg, 0.3, block=16))(q, k, v)
  lengths = [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  for e in jaxpr.jaxpr.eqns:  # inside the custom_vjp call
    for inner in [getattr(p, "jaxpr", p) for p in e.params.values()]:
      lengths += [x.params["length"] for x in getattr(inner, "eqns", []) if x.primitive.name == "scan"]
  assert lengths == [4]


@pytest.mark.parametrize("packed", [False, True])
def test_tokamax_mask_from_segments_equals_dense(packed):
  """The GPU kernels' mask (per-query key ranges from segment starts), through tokamax's XLA implementation."""
  pytest.importorskip("tokamax")
  q, k, v, w = qkv(4, 4, 12, 8)
  seg = jnp.asarray(SEGMENTS) if packed else None
  got = value_and_grads(lambda q, k, v: gpu.tokamax_attention(q, k, v, seg, 0.3, implementation="xla_chunked"),
                        q, k, v, w)
  assert_same(got, value_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, 0.3), q, k, v, w), 2e-5)
  sliced = gpu.tokamax_attention(q[:, 16:32], k, v, seg[:, 16:32] if packed else None, 0.3,
                                     seg, 16, implementation="xla") if packed else None
  if packed:
    np.testing.assert_allclose(sliced, dense_attention(q[:, 16:32], k, v, seg[:, 16:32], 0.3, seg, 16), atol=2e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_tokamax_queries_padded_to_whole_blocks_equal_dense(packed):
  """Mosaic's attention takes whole query blocks: a length that is not a multiple is padded (queries, and on the
  causal path the keys, the padded queries seeing only padded keys) and sliced back, value and gradients exact."""
  pytest.importorskip("tokamax")
  q, k, v, w = qkv(4, 4, 12, 8)
  T = 40
  q, k, v, w = q[:, :T], k[:, :T], v[:, :T], w[:, :T]
  seg = jnp.asarray(SEGMENTS)[:, :T] if packed else None
  got = value_and_grads(lambda q, k, v: gpu.tokamax_attention(q, k, v, seg, 0.3, implementation="xla",
                                                                  pad_to=16), q, k, v, w)
  assert_same(got, value_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, 0.3), q, k, v, w), 2e-5)
  part = slice(16, 30)  # 14 queries at offset 16 over all 40 keys (context parallelism's gather path)
  sliced = gpu.tokamax_attention(q[:, part], k, v, None if seg is None else seg[:, part], 0.3, seg, 16,
                                     implementation="xla", pad_to=16)
  want = dense_attention(q[:, part], k, v, None if seg is None else seg[:, part], 0.3, seg, 16)
  np.testing.assert_allclose(sliced, want, atol=2e-6)


def test_segment_starts():
  np.testing.assert_array_equal(gpu.segment_starts(jnp.asarray([[1, 1, 2, 2, 2, 0]])), [[0, 0, 2, 2, 2, 5]])


def test_kernel_choice_follows_the_mesh_platform():
  assert choice.attention_kind("auto", 4096, "cpu") == "blocked"
  assert choice.attention_kind("auto", 256, "cpu") == "dense"  # one block: the same computation
  assert choice.matmul_kind("auto", "cpu") == "blocked" and choice.matmul_kind("auto", "tpu") == "ragged_dot"
  with pytest.raises(config_lib.UserError, match="model.attention_impl"):
    choice.attention_kind("mosaic", 4096, "cpu")
  with pytest.raises(config_lib.UserError, match="bfloat16"):
    choice.matmul_kind("tokamax", "gpu", jnp.float32, capability=9.0)
  with pytest.raises(config_lib.UserError, match="model.moe_matmul"):
    choice.matmul_kind("tokamax", "cpu")


# (compute capability, dtype) → what auto picks with tokamax installed: Mosaic GPU attention on sm_90/sm_100 with
# 16-bit inputs, its grouped GEMM on sm_90 (no sm_100 weight-gradient kernel in tokamax 0.0.12), Triton from sm_80,
# XLA's own paths below (tokamax 0.0.12's Mosaic kernels raise below sm_90)
AUTO_ON_GPU = [((8.0, jnp.bfloat16), ("triton", "tokamax_triton")), ((8.6, jnp.bfloat16), ("triton", "tokamax_triton")),
               ((9.0, jnp.bfloat16), ("mosaic", "tokamax")), ((10.0, jnp.bfloat16), ("mosaic", "tokamax_triton")),
               ((12.0, jnp.bfloat16), ("triton", "tokamax_triton")), ((9.0, jnp.float32), ("triton", "blocked")),
               ((8.0, jnp.float32), ("triton", "blocked")), ((7.0, jnp.bfloat16), ("blocked", "blocked"))]


@pytest.mark.parametrize("where, picks", AUTO_ON_GPU)
def test_auto_picks_the_kernels_the_gpu_can_run(where, picks):
  cc, dtype = where
  got = (choice.attention_kind("auto", 4096, "gpu", dtype, tokamax=True, capability=cc),
         choice.matmul_kind("auto", "gpu", dtype, tokamax=True, capability=cc))
  assert got == picks
  if cc == 10.0:  # tokamax's sm_100 Mosaic attention fits head dims of 64 at most in shared memory
    assert choice.attention_kind("auto", 4096, "gpu", dtype, True, cc, (192, 128)) == "triton"
    assert choice.attention_kind("auto", 4096, "gpu", dtype, True, cc, (64, 64)) == "mosaic"
  if picks[1] == "tokamax":  # widths that are not whole tiles of 64 go to Triton
    assert choice.matmul_kind("auto", "gpu", dtype, tokamax=True, capability=cc, dims=(40, 20)) == "tokamax_triton"
    assert choice.matmul_kind("auto", "gpu", dtype, tokamax=True, capability=cc, dims=(2048, 512)) == "tokamax"
  # without tokamax auto takes XLA's paths on any GPU
  assert (choice.attention_kind("auto", 4096, "gpu", dtype, tokamax=False, capability=cc),
          choice.matmul_kind("auto", "gpu", dtype, tokamax=False, capability=cc)) == ("blocked", "blocked")


# a kernel asked for by name on a GPU that cannot run it: (setting key, value, capability, head dims, message)
REFUSED_ON_GPU = [("attention", "mosaic", 8.0, None, "mosaic .*sm_90 and sm_100.* sm_80; use auto \\(it picks triton"),
                  ("attention", "mosaic", 12.0, None, "sm_120"),
                  ("attention", "mosaic", 10.0, (192, 128), "mosaic on sm_100 takes head dims of at most 64.*these "
                                                            "are 192/128; use auto \\(it picks triton"),
                  ("attention", "triton", 7.5, None, "triton needs an sm_80 or newer GPU and this is sm_75"),
                  ("attention", "cudnn", 8.0, (192, 128), "cudnn takes query/key head dim 192 with value head dim 128"),
                  ("attention", "cudnn", 8.0, (256, 256), "sm_90 or newer only"),
                  ("matmul", "tokamax", 8.0, None, "tokamax .*runs on sm_90 GPUs and this is sm_80; use auto \\(it "
                                                   "picks tokamax_triton"),
                  ("matmul", "tokamax", 10.0, None, "runs on sm_90 GPUs and this is sm_100"),
                  ("matmul", "tokamax", 9.0, (40, 20), "multiples of 64, and the expert GEMMs here are 40 × 20"),
                  ("matmul", "tokamax_triton", 7.0, None, "tokamax_triton needs an sm_80")]


@pytest.mark.parametrize("which, setting, cc, heads, message", REFUSED_ON_GPU)
def test_a_kernel_the_gpu_cannot_run_is_refused_in_one_line(which, setting, cc, heads, message):
  with pytest.raises(config_lib.UserError, match=message) as e:
    if which == "attention":
      choice.attention_kind(setting, 4096, "gpu", jnp.bfloat16, tokamax=True, capability=cc, head_dims=heads)
    else:
      choice.matmul_kind(setting, "gpu", jnp.bfloat16, tokamax=True, capability=cc, dims=heads)
  assert "\n" not in str(e.value) and f"model.{'attention_impl' if which == 'attention' else 'moe_matmul'}" in str(e.value)
  # where it can run, the same request stands
  ok = {"mosaic": 9.0 if heads and max(heads) > 64 else 10.0, "triton": 8.0, "cudnn": 9.0, "tokamax": 9.0, "tokamax_triton": 8.0}[setting]
  if which == "attention":
    assert choice.attention_kind(setting, 4096, "gpu", jnp.bfloat16, True, ok, heads) == setting
  else:
    assert choice.matmul_kind(setting, "gpu", jnp.bfloat16, True, ok, (2048, 512)) == setting


def test_startup_summary_names_the_kernels_and_a_missing_tokamax():
  cfg = config_lib.load("configs/bench-v3-1b.yaml")
  line = choice.summary(cfg, "gpu", 8.0, tokamax=True)
  assert line.startswith("kernels on sm_80: attention triton") and "expert GEMM tokamax_triton" in line
  assert "loss chunked" in line and "tokamax is not installed" not in line
  assert "triton builds a dense [batch, query, key] mask" in line and "in its backward" in line
  hopper = choice.summary(cfg, "gpu", 9.0, tokamax=True)
  assert "attention mosaic" in hopper and "dense" not in hopper
  missing = choice.summary(cfg, "gpu", 9.0, tokamax=False)
  assert "attention blocked" in missing and "expert GEMM blocked" in missing
  assert "tokamax is not installed" in missing and "pip install" in missing
  cudnn = choice.summary(config_lib.load("configs/bench-v3-1b.yaml", ["model.attention_impl=cudnn"]), "gpu", 9.0,
                          tokamax=True)
  assert "attention cudnn" in cudnn and "square of train.seq_len" in cudnn
  assert choice.summary(cfg, "cpu").startswith("kernels on cpu: attention blocked")
  # the GPU scheduler's settings: said unused where they do nothing, never "used"
  tuned = config_lib.load("configs/bench-v3-1b.yaml", ["train.latency_hiding_memory=200", "train.latency_hiding=false"])
  assert choice.summary(tuned, "cpu").endswith("| train.latency_hiding=False, train.latency_hiding_memory=200 unused "
                                               "(they set XLA's GPU scheduler)")
  assert "unused" not in choice.summary(cfg, "cpu")
  assert choice.summary(tuned, "gpu", 9.0, tokamax=True).endswith("XLA latency-hiding scheduler off")


def expert_inputs(R=40, D=12, M=10, E=5, seed=1):
  ks = jax.random.split(jax.random.key(seed), 5)
  sizes = jnp.asarray([9, 0, 14, 7, 6], jnp.int32)  # 36 rows in groups, 4 past them
  x = jax.random.normal(ks[0], (R, D))
  ws = [jax.random.normal(kk, s) * 0.3 for kk, s in zip(ks[1:4], [(E, D, M), (E, D, M), (E, M, D)])]
  return x, sizes, ws, jax.random.normal(ks[4], (R, D))


@pytest.mark.parametrize("pad_to", [None, 64])
def test_tokamax_grouped_matmul_path_equals_blocked(pad_to):
  """grouped.ffn_tokamax (gate and up fused into one grouped GEMM) through tokamax's XLA implementation; with
  pad_to=64 (as for Mosaic) the 40 rows are padded to whole tiles and the padding sliced off."""
  pytest.importorskip("tokamax")
  x, sizes, ws, w = expert_inputs()
  used = (jnp.arange(x.shape[0]) < sizes.sum())[:, None]
  run = lambda f: lambda x, *ws: jnp.where(used, f(x, sizes, *ws), 0)
  tok = run(lambda *a: grouped.ffn_tokamax(*a, implementation="xla", pad_to=pad_to))
  ref = run(grouped.ffn_blocked)
  np.testing.assert_allclose(tok(x, *ws), ref(x, *ws), atol=1e-5)
  gt = jax.grad(lambda *a: (tok(*a) * w).sum(), argnums=(0, 1, 2, 3))(x, *ws)
  gr = jax.grad(lambda *a: (ref(*a) * w).sum(), argnums=(0, 1, 2, 3))(x, *ws)
  for a, b in zip(gt, gr):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_loss_equals_full_logits(monkeypatch, dtype):
  monkeypatch.setattr(loss_lib, "CHUNK_ELEMENTS", 4 * 37)  # chunks of 4 tokens of a 37-word vocabulary
  ks = jax.random.split(jax.random.key(2), 3)
  h = jax.random.normal(ks[0], (3, 16, 8)).astype(dtype)
  head = (jax.random.normal(ks[1], (8, 37)) * 0.5).astype(dtype)
  targets = jax.random.randint(ks[2], (3, 16), 0, 37)
  mask = (jnp.arange(16)[None] < jnp.asarray([[16], [9], [3]])).astype(jnp.float32)
  assert loss_lib.chunk_count(3, 16, 37) == 16  # 48 tokens, at most 4 per chunk → 12 needed, 16 divides T
  f = lambda impl: lambda h, head: loss_lib.cross_entropy_sum(h, head, targets, mask, impl)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(f("chunked")(h, head), f("full")(h, head), rtol=tol)
  for a, b in zip(jax.grad(f("chunked"), argnums=(0, 1))(h, head), jax.grad(f("full"), argnums=(0, 1))(h, head)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_chunk_loss_keeps_the_softmax_and_equals_the_chunked_loss_bit_for_bit(dtype):
  """On CPU a batch whose logits are one chunk keeps softmax − one-hot from the forward (no second logits matmul in
  the backward): value and both gradients equal the chunked scan's bit for bit, with a loss mask that weighs
  tokens (not only 0 and 1), at a gradient scale other than 1, in float32 and bfloat16."""
  ks = jax.random.split(jax.random.key(3), 4)
  h = jax.random.normal(ks[0], (3, 16, 8)).astype(dtype)
  head = (jax.random.normal(ks[1], (8, 37)) * 0.5).astype(dtype)
  targets = jax.random.randint(ks[2], (1, 3, 16), 0, 37)
  mask = jax.random.uniform(ks[3], (1, 3, 16)) * (jnp.arange(16) < 11)
  assert loss_lib.chunk_count(3, 16, 37) == 1
  one = lambda h, head: 1.7 * loss_lib._one_chunk_ce(h, head, targets[0], mask[0])
  scan = lambda h, head: 1.7 * loss_lib._chunked_ce(h[None], head, targets, mask)
  np.testing.assert_array_equal(one(h, head), scan(h, head))
  np.testing.assert_array_equal(one(h, head), 1.7 * loss_lib.cross_entropy_sum(h, head, targets[0], mask[0]))
  for a, b in zip(jax.grad(one, argnums=(0, 1))(h, head), jax.grad(scan, argnums=(0, 1))(h, head)):
    assert a.dtype == b.dtype == dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  dots = lambda f: str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(h, head)).count("dot_general")
  # logits, the two gradients; the scan's backward computes logits again (its first chunk and its loop's body)
  assert dots(one) == 3 and dots(scan) == 1 + 2 * 3


@pytest.mark.parametrize("name", ["tiny-v3", "tiny-dense"])  # MLA, grouped-query attention
def test_train_step_memory_grows_linearly_with_length(name):
  """The compiled CPU step's temporaries at length 8192 are at most 2.5× those at 4096 (dense attention: 4×)."""
  from jaxseek.explore import compile as explore_compile

  def temp(T, impl="auto"):
    cfg = config_lib.load(f"configs/{name}.yaml", ["mesh.data=1", "train.batch_size=1", f"train.seq_len={T}",
                                                   f"model.max_position_embeddings={T}", f"model.attention_impl={impl}"])
    return explore_compile.compile_train_step(cfg, cfg.mesh.sizes())["temp_bytes"]

  assert temp(8192) <= 2.5 * temp(4096)
  assert temp(4096, "dense") > 10 * temp(4096)  # the reference holds [T, T] scores


def test_gpu_kernel_runs_per_shard_on_a_mesh():
  """The custom-call kernel inside its shard_map over batch and heads (data 2 × tensor 2) equals the dense
  reference on one device (tokamax's XLA implementation stands in for the GPU kernel)."""
  pytest.importorskip("tokamax")
  from jaxseek.kernels import attention
  from jaxseek.sharding import mesh as mesh_lib

  cfg = config_lib.load("configs/tiny-v3.yaml", ["mesh.data=2", "mesh.tensor=2", "mesh.fsdp=1"])
  mesh = mesh_lib.make_mesh(cfg, jax.devices()[:4])
  q, k, v, w = qkv(4, 2, 12, 8)
  seg = jnp.asarray(SEGMENTS)
  run = jax.jit(lambda q, k, v: attention.gpu_attention(q, k, v, seg, 0.3, implementation="xla_chunked"))
  with jax.set_mesh(mesh):
    got = run(q, k, v)
  np.testing.assert_allclose(got, dense_attention(q, k, v, seg, 0.3), atol=2e-6)


# devices as JAX describes them: an AMD GPU names its platform "gpu" (or "rocm") and reports a gfx architecture
# as its compute capability, its client's platform version naming ROCm
MI300X = SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X", compute_capability="gfx942",
                         client=SimpleNamespace(platform_version="rocm 6.3.1"))
ROCM_BARE = SimpleNamespace(platform="rocm", device_kind="AMD Instinct MI250X")
H200 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0",
                       client=SimpleNamespace(platform_version="cuda 12080"))


@pytest.mark.parametrize("device", [MI300X, ROCM_BARE], ids=["gfx942", "no-capability"])
def test_auto_takes_xla_paths_on_an_amd_gpu(monkeypatch, device):
  """On a ROCm device (the mesh's and the default one) auto picks XLA's paths, the start-up line says why, and
  the CUDA-only kernels asked for by name are refused in one line; an H200 and a plan without a GPU at hand
  (the explorer's, taken as sm_90) still get Mosaic."""
  cfg = config_lib.load("configs/bench-v3-1b.yaml")
  monkeypatch.setattr(jax, "devices", lambda backend=None: [device])
  where, cc = choice.device_target(device)
  assert (where, cc) == ("gpu", None)
  assert choice.attention_kind("auto", 4096, where, jnp.bfloat16, tokamax=True, capability=cc) == "blocked"
  assert choice.matmul_kind("auto", where, jnp.bfloat16, tokamax=True, capability=cc, dims=(2048, 512)) == "blocked"
  line = choice.summary(cfg, where, cc, tokamax=True)
  assert line.startswith("kernels on a GPU without a CUDA compute capability (ROCm): attention blocked"), line
  assert "expert GEMM blocked" in line
  for setting in ("mosaic", "triton", "cudnn"):
    with pytest.raises(config_lib.UserError, match=f"model.attention_impl: {setting}.*without a CUDA compute"):
      choice.attention_kind(setting, 4096, where, jnp.bfloat16, tokamax=True, capability=cc)
  for setting in ("tokamax", "tokamax_triton"):
    with pytest.raises(config_lib.UserError, match=f"model.moe_matmul: {setting}.*without a CUDA compute"):
      choice.matmul_kind(setting, where, jnp.bfloat16, tokamax=True, capability=cc)
  monkeypatch.setattr(jax, "devices", lambda backend=None: [H200])
  assert choice.device_target(H200) == ("gpu", 9.0)
  assert choice.attention_kind("auto", 4096, "gpu", jnp.bfloat16, tokamax=True) == "mosaic"
  monkeypatch.setattr(jax, "devices", lambda backend=None: [SimpleNamespace(platform="cpu")])
  assert choice.matmul_kind("auto", "gpu", jnp.bfloat16, tokamax=True, dims=(2048, 512)) == "tokamax"


def test_blocked_expert_weight_gradients_accumulate_in_float32():
  """grouped.ffn_blocked's weight gradients under bfloat16 compute, 2 experts × 32 row blocks of 256: equal to the
  exact sum rounded once to bfloat16. The inputs make every value exact: x, dy, the weights in {-1, 0, 1} save
  a gate column of 20 (so gate ∈ [20, 23], where bfloat16's and float32's sigmoid are 1 and silu(gate) = gate),
  every hidden value and cotangent an integer below 256 (exact in bfloat16), every block's partial sum and the
  total an integer below 2²⁴ (exact in float32). Accumulated in float32, the only rounding is the final cast;
  accumulated in bfloat16, every block's addition rounds the running sum."""
  R, D, M, E = 16384, 4, 4, 2
  rng = np.random.default_rng(0)
  x = rng.integers(0, 2, (R, D)).astype(np.float32)
  x[:, 0] = 1
  w_gate = rng.integers(0, 2, (E, D, M)).astype(np.float32)
  w_gate[:, 0] = 20
  w_up, w_down = rng.integers(-1, 2, (E, D, M)).astype(np.float32), rng.integers(-1, 2, (E, M, D)).astype(np.float32)
  dy = rng.integers(-1, 2, (R, D)).astype(np.float32)
  sizes = jnp.asarray([R // 2, R // 2], jnp.int32)
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
  loss = lambda *w: (grouped.ffn_blocked(bf16(x), sizes, *w).astype(jnp.float32) * dy).sum()
  got = jax.grad(loss, argnums=(0, 1, 2))(bf16(w_gate), bf16(w_up), bf16(w_down))
  want = [np.zeros_like(w_gate), np.zeros_like(w_up), np.zeros_like(w_down)]
  for e in range(E):
    rows = slice(e * R // 2, (e + 1) * R // 2)
    xe, dye = x[rows], dy[rows]
    gate, up, dh = xe @ w_gate[e], xe @ w_up[e], dye @ w_down[e].T
    want[0][e], want[1][e], want[2][e] = xe.T @ (dh * up), xe.T @ (dh * gate), (gate * up).T @ dye
  assert max(float(np.abs(w).max()) for w in want) > 2**12  # sums well past bfloat16's 8 bits
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(bf16(w), np.float32))


def bfloat16_experts_model(x, sizes, w_gate, w_up, w_down, dy, round_gemms=True):
  """The experts' SwiGLU in bfloat16 compute as the FP8 recipes' grouped GEMMs take it, without the float8: each
  GEMM's exact sum rounded once to bfloat16, SwiGLU and its derivative in float32 from those, the hidden activation
  and its cotangents rounded to bfloat16, the input gradient's two GEMMs summed before rounding. Returns y, dx and
  the three weight gradients (each the exact sum over the group's rows, rounded once)."""
  import ml_dtypes

  bf = lambda a: np.asarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16), np.float64)
  group = np.repeat(np.arange(len(sizes) + 1), [*sizes, len(x) - sum(sizes)])
  y, dx = np.zeros_like(x), np.zeros_like(x)
  dws = [np.zeros_like(w) for w in (w_gate, w_up, w_down)]
  for e in range(len(sizes)):
    rows = group == e
    xe, dye = x[rows], dy[rows]
    gemm = bf if round_gemms else (lambda a: np.asarray(a, np.float32).astype(np.float64))
    gate, up, dh = gemm(xe @ w_gate[e]), gemm(xe @ w_up[e]), gemm(dye @ w_down[e].T)
    sig = 1 / (1 + np.exp(-gate))
    h = bf(gate * sig * up)
    dgate, dup = bf(dh * up * sig * (1 + gate * (1 - sig))), bf(dh * gate * sig)
    y[rows], dx[rows] = bf(h @ w_down[e]), bf(dgate @ w_gate[e].T + dup @ w_up[e].T)
    dws[0][e], dws[1][e], dws[2][e] = bf(xe.T @ dgate), bf(xe.T @ dup), bf(h.T @ dye)
  return y, dx, *dws


@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_bfloat16_experts_run_the_fp8_recipes_swiglu(impl):
  """The bfloat16 expert kernels differ from the FP8 recipes' only in the GEMMs (kernels/fp8_grouped.py): SwiGLU in
  float32 from the GEMMs' outputs, the hidden activation and its cotangents rounded to bfloat16, the input gradient
  summed in float32. Measured: every element equal to the model, ragged_dot's forward with each GEMM rounded to
  bfloat16, blocked's forward and custom backward with XLA:CPU keeping the GEMMs' float32 into SwiGLU (excess
  precision; no other rounding differs). ragged_dot's automatic backward rounds each input-gradient GEMM before the
  sum, so ragged is held to its forward. Allowed: 0.5% of elements one bfloat16 step apart (another XLA's float32 sum
  crossing a rounding boundary). SwiGLU in bfloat16 (the earlier kernels) moved 56-60% of y's elements."""
  rng = np.random.default_rng(3)
  R, D, m, E = 96, 64, 32, 4
  sizes = np.array([30, 0, 40, 20])
  as_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
  x, dy = (as_bf16(rng.standard_normal((R, D)) * rng.lognormal(0, 1, (R, 1))) for _ in range(2))
  w_gate, w_up = as_bf16(rng.standard_normal((2, E, D, m)) * 0.1)
  w_down = as_bf16(rng.standard_normal((E, m, D)) * 0.1)
  ffn = grouped.ffn_blocked if impl == "blocked" else grouped.ffn_ragged
  f = lambda x, wg, wu, wd: ffn(x, jnp.asarray(sizes, jnp.int32), wg, wu, wd)
  y, pull = jax.vjp(f, *(jnp.asarray(a, jnp.bfloat16) for a in (x, w_gate, w_up, w_down)))
  got = [y, *pull(jnp.asarray(dy, jnp.bfloat16))]
  want = bfloat16_experts_model(x, sizes, w_gate, w_up, w_down, dy, round_gemms=impl == "ragged")
  names = ("y", "dx", "dw_gate", "dw_up", "dw_down")[:5 if impl == "blocked" else 1]
  for name, a, b in zip(names, got, want):
    a = np.asarray(a, np.float64)
    off = ~np.isclose(a, b, rtol=2.0 ** -7, atol=2.0 ** -8 * np.abs(b).max())
    print(f"{impl} {name}: {(a != b).mean():.3%} differ, {off.mean():.3%} more than a step")
    assert (a != b).mean() <= 5e-3 and not off.any(), (name, (a != b).mean(), off.mean())


def _transposes(fn, *args) -> list[str]:
  """The transpose instructions of fn's compiled CPU program."""
  return [line for line in jax.jit(fn).lower(*args).compile().as_text().splitlines() if " transpose(" in line]


@pytest.mark.parametrize("spec,x_shape,w_shape", [("BTD,DF->BTF", (2, 8, 16), (16, 24)),
                                                  ("BTNP,NPD->BTD", (2, 8, 3, 4), (3, 4, 16)),
                                                  ("BTQ,QNH->BTNH", (2, 8, 16), (16, 3, 4))])
def test_cpu_projections_run_as_one_matrix_product_whose_weight_gradient_needs_no_transposed_copy(
    spec, x_shape, w_shape):
  """On CPU a projection runs as [rows, K]·[K, columns] (fp8_gemm._flat): its weight gradient then contracts one
  dimension, the rows, and XLA:CPU reads both operands as they are. As an einsum over two leading letters it
  contracted two, and XLA:CPU first copied the activation's gradient transposed ([F, B, T]: 58 ms a step of the
  dense layer's backward in benchmarks/profile_step.py). Values and both gradients equal the einsum's."""
  from jaxseek.kernels import fp8_gemm

  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
  g = jax.random.normal(kg, jnp.einsum(spec, x, w).shape)
  assert fp8_gemm.flat_gemm()
  loss = lambda f: (lambda x, w: (jax.nn.silu(f(x, w)) * g).sum())  # an elementwise op makes the gradient
  flat, einsum = (lambda x, w: fp8_gemm.einsum(spec, x, w, None)), (lambda x, w: jnp.einsum(spec, x, w))
  np.testing.assert_allclose(flat(x, w), einsum(x, w), rtol=1e-6, atol=1e-6)
  for got, want in zip(jax.grad(loss(flat), (0, 1))(x, w), jax.grad(loss(einsum), (0, 1))(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  backward = jax.grad(loss(flat), (0, 1))
  assert _transposes(backward, x, w) == []


def test_the_host_keeps_a_cpu_programs_temporaries_between_runs(tmp_path):
  """sharding/mesh.py keep_host_memory with simulate_cpu_devices: a one-device CPU program's temporaries (one
  block per run) come from memory malloc keeps, where without them the kernel maps and zero-fills the block
  page by page on every run (minor page faults ≈ its pages)."""
  import subprocess
  import sys

  script = tmp_path / "faults.py"
  script.write_text(
      "import resource, sys\n"
      "import jax, jax.numpy as jnp\n"
      "from jaxseek.sharding import mesh as mesh_lib\n"
      "if sys.argv[1] == 'kept':\n"
      "  mesh_lib.simulate_cpu_devices(None)\n"
      "  assert mesh_lib.keep_host_memory()\n"
      "f = jax.jit(lambda x: (jnp.cos(jnp.sin(x) * 2) @ jnp.sin(x)).sum())\n"
      "x = jnp.ones((2048, 2048))\n"
      "temp = f.lower(x).compile().memory_analysis().temp_size_in_bytes\n"
      "f(x).block_until_ready(); f(x).block_until_ready()\n"
      "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
      "for _ in range(4): f(x).block_until_ready()\n"
      "print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4, temp // 4096)\n")
  env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
  env["JAX_PLATFORMS"] = "cpu"
  out = {mode: [float(v) for v in subprocess.run([sys.executable, str(script), mode], capture_output=True,
                                                   text=True, check=True, env=env).stdout.split()]
         for mode in ("kept", "default")}
  (kept, pages), (default, _) = out["kept"], out["default"]
  assert pages > 8000  # a 32 MiB block or more: past malloc's mmap threshold
  # the fault this guards against maps the block anew every run: a fault per page or more (1.25 measured). Kept,
  # it is 0 alone; other work on the machine left up to a quarter (malloc placing the block partly on new heap)
  assert default > 0.9 * pages, out
  assert kept < 0.5 * pages, out


def test_short_layer_stacks_run_unrolled_on_cpu_and_train_as_the_scan_does():
  """transformer.unroll_layers: on CPU a stack of at most UNROLL_LAYERS layers is traced unrolled, without XLA:CPU's
  loop over its layers (which sliced each layer's weights out of the stacks and wrote every residual into a
  zero-filled stacked buffer: docs/cpu.md); under transformer.scanned(), as the explorer's --compile traces it,
  it is a lax.scan. Three training steps of both agree to float32 rounding."""
  import contextlib

  from conftest import load_config, run_steps
  from jaxseek import step as step_lib
  from jaxseek.input import global_batches
  from jaxseek.model import transformer
  from jaxseek.sharding.mesh import make_mesh

  cfg = load_config("tiny-v3", "mesh.data=1", "mesh.fsdp=1", "model.num_hidden_layers=4")  # MoE stack: 3 layers

  def run(scan: bool):
    mesh = make_mesh(cfg, jax.devices()[:1])
    with transformer.scanned() if scan else contextlib.nullcontext():
      trainer, state = step_lib.init_state(cfg, mesh)
      with jax.set_mesh(mesh):
        text = step_lib.compile_step(trainer, cfg, mesh).lower(state, next(global_batches(cfg, mesh))).compile()
      _, records = run_steps(cfg, mesh, trainer, state, global_batches(cfg, mesh), 3)
    loops = text.as_text().count('known_trip_count":{"n":"3"}')  # loops over the MoE stack's layers
    return loops, np.array([r["loss"] for r in records]), np.array([r["grad_norm"] for r in records])

  (unrolled, losses, norms), (scanned, ref_losses, ref_norms) = run(False), run(True)
  assert (unrolled, scanned) == (0, 2), (unrolled, scanned)  # the MoE stack's loop, forward and backward
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)


def test_cpu_projections_in_16_bits_accumulate_in_float32_and_round_once():
  """fp8_gemm._rows16: on CPU a bfloat16 projection multiplies the bfloat16 operands into a float32 result, rounded
  to bfloat16 after, and so do its gradients. A product with a bfloat16 result XLA:CPU ran on float32 copies of
  its operands (2.5 times as long at the benchmark's head shape: docs/cpu.md); the forward has none now (the
  einsum's had two). The weight gradient, which contracts the rows, XLA:CPU still runs on a float32 copy of x.
  Values and gradients are those of float32 to bfloat16 rounding."""
  import re

  from jaxseek.kernels import fp8_gemm

  spec = "BTD,DF->BTF"
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  x, w, g = (jax.random.normal(k, s).astype(jnp.bfloat16) for k, s in ((kx, (2, 8, 32)), (kw, (32, 24)),
                                                                        (kg, (2, 8, 24))))
  project = lambda x, w: fp8_gemm.einsum(spec, x, w, None)
  grad = jax.grad(lambda x, w: (project(x, w) * g).sum(), (0, 1))
  upcasts = lambda f: re.findall(r"= f32\[[\d,]*\]\{[\d,]*\} convert\(", jax.jit(f).lower(x, w).compile().as_text())
  assert upcasts(project) == []
  f32 = lambda *a: [b.astype(jnp.float32) for b in a]
  np.testing.assert_allclose(np.asarray(project(x, w), np.float32), jnp.einsum(spec, *f32(x, w)), rtol=1e-2,
                             atol=2e-2)
  ref = jax.grad(lambda x, w: (jnp.einsum(spec, x, w) * g.astype(jnp.float32)).sum(), (0, 1))(*f32(x, w))
  for got, want in zip(grad(x, w), ref):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-v3"])
def test_cpu_rotary_tables_are_computed_once_a_layer_and_equal_the_direct_formula(name):
  """rope.rotary on CPU: cos and sin come out of one conditional a layer (a [T, 2, R] table looked up where the
  positions lie in [0, T), else computed directly), so a layer's gradient evaluates each once in each branch.
  Computed in place, XLA:CPU fused them into every rotation and its gradient and evaluated them again per head
  (seven fusions a layer in a zero-bubble pipeline's backward: docs/pipeline.md). Both branches give the
  direct formula's values bit for bit: packed positions, positions past T (a decode step's) and T = 1."""
  from flax import nnx

  from conftest import load_config
  from jaxseek.model import attention, rope

  cfg = load_config(name).model
  attn = attention.make_attention(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
  B, T, D = 2, 12, cfg.hidden_size
  x = jax.random.normal(jax.random.key(0), (B, T, D), jnp.float32)
  positions = jnp.asarray([list(range(5)) + list(range(7)), list(range(T))], jnp.int32)
  segments = jnp.asarray([[1] * 5 + [2] * 7, [1] * T], jnp.int32)
  loss = lambda a, x, p, s: jnp.sum(a(x, p, s) ** 2)
  hlo = jax.jit(jax.grad(loss, argnums=1)).lower(attn, x, positions, segments).compile().as_text()
  assert hlo.count(" cosine(") == 2 and hlo.count(" sine(") == 2, (hlo.count(" cosine("), hlo.count(" sine("))

  inv_freq, factor = attention.rope_tables(8, cfg)
  for p in (positions, positions + 100, positions[:, :1] + 3, -positions):
    got = jax.jit(lambda p: rope.rotary(p, inv_freq, factor))(p)
    want = rope._cos_sin(np.asarray(p)[..., None], inv_freq, factor)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_chunked_loss_backward_sums_the_head_gradient_without_a_zero_filled_start():
  """The head's gradient sum over chunks starts from the first chunk's: a zero-filled [D, V] float32 start is a
  buffer of the head's size that XLA kept live beside the loop's carry (DeepSeek-V3's layout compiled for H100s:
  3.45 GiB each) while the gradients stay those of the full logits."""
  ks = jax.random.split(jax.random.key(4), 3)
  h = jax.random.normal(ks[0], (4, 3, 2, 8))  # 4 chunks of 3 × 2 tokens
  head = jax.random.normal(ks[1], (8, 37)) * 0.5
  targets = jax.random.randint(ks[2], (4, 3, 2), 0, 37)
  mask = jnp.ones((4, 3, 2), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda w: loss_lib._chunked_ce(h, w, targets, mask)))(head)
  fills = [e for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim" and e.outvars[0].aval.shape == head.shape]
  assert not fills, fills
  full = lambda w: loss_lib.cross_entropy_sum(h.reshape(12, 2, 8), w, targets.reshape(12, 2), mask.reshape(12, 2),
                                              "full")
  np.testing.assert_allclose(jax.grad(lambda w: loss_lib._chunked_ce(h, w, targets, mask))(head),
                             jax.grad(full)(head), rtol=1e-5, atol=1e-6)
