"""Gradient fidelity of the train.fp8 recipes: each recipe's whole-model gradient, and each of its GEMMs, against
float32 compute on the same parameters and batch, at several points of a run, beside bfloat16's own error.

  python benchmarks/fp8_fidelity.py --points 0 50 150 --runs false rowwise \
      --recipes false tensorwise rowwise mxfp8 blockwise

trains configs/tiny-v3-256.yaml (a tiny DeepSeek-V3 at FP8 tile widths, ~3M parameters, bfloat16 compute) on
python-stdlib bytes on one CPU device for max(points) steps (the cosine schedule's length, so the last point ends the
run; warm-up 10% of it), once per `--runs` setting of train.fp8 (false: bfloat16), and at each point takes the
parameters, the router biases, Adam's moments and the batch the next step trains on. On that batch and those
parameters it computes the gradient of the objective with every recipe of `--recipes` in bfloat16 and with
train.fp8=false in float32 (the reference), and compares them over all parameters (the float32 master weights'
gradients):

  rel       ‖g − g₃₂‖ / ‖g₃₂‖ (also on the routed experts' weights alone: `experts`, and the rest: `other`)
  cos       g·g₃₂ / (‖g‖ ‖g₃₂‖)
  bias      (g − g₃₂)·g₃₂ / ‖g₃₂‖²: the error's component along the reference (−1% = the gradient 1% shorter)
  flushed   elements where g is 0 and g₃₂ is not, over those where g₃₂ is not
  adam      ‖u(g) − u(g₃₂)‖ / ‖u(g₃₂)‖, u(g) = m̂/(√v̂ + ε) the direction of the Adam step the run would take
            next with gradient g: its moments at that point updated with g and bias-corrected (optim.b1, b2,
            eps; learning rate and weight decay left out). At step 0 the moments are empty and u(g) = sign(g)
            (to ε): the update error is then 2·√(the fraction of elements whose sign flips)

With `--gemms` (default on) the same gradients run once more with every projection GEMM (kernels/fp8_gemm.py's
einsum) and the routed experts' grouped SwiGLU (kernels/grouped.py's expert_ffn) reporting operands, outputs and
gradients to the host; each output is compared with float64 of the same operands (the compute dtype's values): the
projections' y, dx and dw, the experts' y, dx, dw_in (gate and up) and dw_down (the SwiGLU between their GEMMs in
float64 too). Printed: the median over the model's GEMMs of that relative error, and the largest fraction of an
output's elements flushed to zero (the max error in the JSON). blockwise's experts take inputs already rounded
(model/moe.py), so their columns show only the bfloat16 GEMMs.

The defaults take about 35 minutes on 2 shared CPU cores (two 150-step runs, 5 recipes at 5 points, each compiled
twice). Results go to benchmarks/results.jsonl (bench "fp8_fidelity", one record per run, point and recipe).
"""

from __future__ import annotations

import argparse
import functools
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import common
from jaxseek import config as config_lib
from jaxseek import objective
from jaxseek import step as step_lib
from jaxseek.input import GlobalBatches
from jaxseek.kernels import fp8_gemm, grouped
from jaxseek.sharding.mesh import make_mesh

CONFIG = common.ROOT / "configs/tiny-v3-256.yaml"
RECIPES = ("false", *fp8_gemm.RECIPES)
EXPERT_WEIGHTS = ("w_gate_EDM", "w_up_EDM", "w_down_EMD")


def load(config: Path, *overrides: str) -> config_lib.Config:
  return config_lib.load(config, ["mesh.data=1", "checkpoint.every=0", *overrides])


def gradient_fn(cfg: config_lib.Config, mesh):
  """(params, biases, batch) → the gradient of the objective (float32, the parameters' tree) as `cfg` computes it
  (its train.fp8 and train.compute_dtype), on one microbatch, loss scale 1."""
  trainer = step_lib.make_trainer(cfg, mesh, backend_checks=False)

  @jax.jit
  def gradient(params, biases, batch):
    state = types.SimpleNamespace(grad_residual={}, loss_scale=jnp.ones((), jnp.float32), biases=biases)
    batch = step_lib.step_batch(cfg, batch)
    fn = objective.objective_fn(trainer, cfg, state, batch, 1)
    return jax.grad(lambda p: fn(p, batch)[0])(params)

  def run(params, biases, batch):
    with jax.set_mesh(mesh):
      return jax.device_get(gradient(params, biases, batch))

  return run


def flat(tree) -> tuple[np.ndarray, np.ndarray]:
  """All leaves as one float64 vector, and a mask of the routed experts' weights in it."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  values = np.concatenate([np.asarray(v, np.float64).ravel() for _, v in leaves])
  expert = np.concatenate([np.full(np.size(v), any(w in jax.tree_util.keystr(p) for w in EXPERT_WEIGHTS))
                           for p, v in leaves])
  return values, expert


def relative(g: np.ndarray, ref: np.ndarray) -> float:
  return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


def adam_update(g: np.ndarray, moments: tuple | None, b1: float, b2: float, eps: float) -> np.ndarray:
  """The direction Adam's next step takes with gradient g from `moments` (count, m, v as flat vectors; None: the
  first step): m̂/(√v̂ + ε) after adding g to both moments (without the learning rate and weight decay)."""
  count, m, v = moments if moments is not None else (0, 0.0, 0.0)
  t = count + 1
  m_hat = (b1 * m + (1 - b1) * g) / (1 - b1 ** t)
  v_hat = (b2 * v + (1 - b2) * g ** 2) / (1 - b2 ** t)
  return m_hat / (np.sqrt(v_hat) + eps)


def fidelity(g: np.ndarray, ref: np.ndarray, moments: tuple | None = None, optim=None,
             expert: np.ndarray | None = None) -> dict[str, float]:
  """The metrics of the module docstring for a gradient g against the reference `ref` (flat float64 vectors);
  `moments`, `optim`: Adam's state and settings for `adam` (default: the first step, b1 0.9, b2 0.95, ε 1e-8)."""
  d = g - ref
  norm = np.linalg.norm(ref)
  nonzero = ref != 0
  adam = functools.partial(adam_update, moments=moments, b1=getattr(optim, "b1", 0.9), b2=getattr(optim, "b2", 0.95),
                           eps=getattr(optim, "eps", 1e-8))
  out = {"rel": relative(g, ref), "cos": float(g @ ref / (np.linalg.norm(g) * norm)),
         "bias": float(d @ ref / norm ** 2), "flushed": float((nonzero & (g == 0)).sum() / max(nonzero.sum(), 1)),
         "adam": relative(adam(g), adam(ref))}
  if expert is not None and expert.any():
    out["experts"] = relative(g[expert], ref[expert])
    out["other"] = relative(g[~expert], ref[~expert])
  return out


def moments(opt_state) -> tuple | None:
  """Adam's (count, first moment, second moment) in `opt_state`, the moments as flat float64 vectors; None before
  the first step."""
  adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0]
  count = int(adam.count)
  return (count, flat(adam.mu)[0], flat(adam.nu)[0]) if count else None


# --- each GEMM against float64 -------------------------------------------------------------------------------

def _f64(a) -> np.ndarray:
  return np.asarray(a, np.float64)


def compare(got, exact: np.ndarray) -> dict[str, float]:
  """A GEMM output against its float64 value: relative error, and the fraction of elements flushed to zero."""
  got = _f64(got)
  nonzero = exact != 0
  return {"rel": relative(got, exact), "flushed": float((nonzero & (got == 0)).sum() / max(nonzero.sum(), 1))}


def _gemm_errors(spec: str, x, w, y, g, dx, dw) -> dict[str, dict[str, float]]:
  """A projection's forward, input- and weight-gradient outputs against float64 products of its operands."""
  n = fp8_gemm.Letters(spec)
  x, w, g = _f64(x), _f64(w), _f64(g)
  exact = (np.einsum(spec, x, w), np.einsum(f"{n.ys},{n.ws}->{n.xs}", g, w), np.einsum(f"{n.xs},{n.ys}->{n.ws}", x, g))
  return {k: compare(a, b) for k, a, b in zip(("y", "dx", "dw"), (y, dx, dw), exact)}


def swiglu_reference(x, sizes, w_gate, w_up, w_down, dy):
  """The grouped SwiGLU and its gradients in float64 (rows past the groups give zeros): y, dx, dw_in, dw_down."""
  x, w_gate, w_up, w_down, dy = (_f64(a) for a in (x, w_gate, w_up, w_down, dy))
  y, dx = np.zeros_like(x), np.zeros_like(x)
  dwg, dwu, dwd = np.zeros_like(w_gate), np.zeros_like(w_up), np.zeros_like(w_down)
  start = 0
  for e, size in enumerate(np.asarray(sizes)):
    rows = slice(start, start + size)
    start += size
    xe, dye = x[rows], dy[rows]
    gate, up = xe @ w_gate[e], xe @ w_up[e]
    sig = 1 / (1 + np.exp(-gate))
    h = gate * sig * up
    y[rows] = h @ w_down[e]
    dh = dye @ w_down[e].T
    d_up, d_gate = dh * gate * sig, dh * up * sig * (1 + gate * (1 - sig))
    dx[rows] = d_gate @ w_gate[e].T + d_up @ w_up[e].T
    dwg[e], dwu[e], dwd[e] = xe.T @ d_gate, xe.T @ d_up, h.T @ dye
  return y, dx, np.concatenate([dwg, dwu], -1), dwd


class GemmRecorder:
  """While a gradient is traced, fp8_gemm.einsum and grouped.expert_ffn replaced by versions whose backward reports
  operands, outputs and gradients to the host (jax.debug.callback), compared there with float64 as they arrive."""

  def __init__(self):
    self.records: dict[str, list[dict]] = {"proj": [], "experts": []}

  def __enter__(self):
    self.saved = fp8_gemm.einsum, grouped.expert_ffn
    fp8_gemm.einsum, grouped.expert_ffn = self._einsum, self._expert_ffn
    return self

  def __exit__(self, *exc):
    fp8_gemm.einsum, grouped.expert_ffn = self.saved

  def _einsum(self, spec, x, w, recipe, upcast=False):
    inner = functools.partial(self.saved[0], spec, recipe=recipe, upcast=upcast)

    @jax.custom_vjp
    def run(x, w):
      return inner(x, w)

    def bwd(res, g):
      y, pull = jax.vjp(inner, *res)
      dx, dw = pull(g)
      jax.debug.callback(lambda *a: self.records["proj"].append(_gemm_errors(spec, *a)), *res, y, g, dx, dw)
      return dx, dw

    run.defvjp(lambda x, w: (inner(x, w), (x, w)), bwd)
    return run(x, w)

  def _expert_ffn(self, x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, matmul="auto"):
    inner = lambda x, sizes, wg, wu, wd: self.saved[1](x, sizes, wg, wu, wd, matmul)

    def record(x, sizes, wg, wu, wd, dy, y, dx, dwg, dwu, dwd):
      got = (y, dx, np.concatenate([_f64(dwg), _f64(dwu)], -1), dwd)
      exact = swiglu_reference(x, sizes, wg, wu, wd, dy)
      self.records["experts"].append({k: compare(a, b) for k, a, b in zip(("y", "dx", "dw_in", "dw_down"), got,
                                                                           exact)})

    @jax.custom_vjp
    def run(*args):
      return inner(*args)

    def bwd(res, dy):
      x, sizes, *ws = res
      y, pull = jax.vjp(lambda x, *ws: inner(x, sizes, *ws), x, *ws)
      grads = pull(dy)
      jax.debug.callback(record, *res, dy, y, *grads)
      return grads[0], None, *grads[1:]

    run.defvjp(lambda *args: (inner(*args), args), bwd)
    return run(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD)

  def measure(self, gradient, *args) -> dict[str, dict[str, float]]:
    """Runs `gradient(*args)` (traced under this recorder) and returns, per output (proj_y, ..., experts_dw_down),
    the median and the largest relative error over the model's GEMMs and the largest fraction flushed to zero."""
    for records in self.records.values():
      records.clear()
    with self:
      gradient(*args)
    jax.effects_barrier()
    out = {}
    for prefix, records in self.records.items():
      for key in (records[0] if records else ()):
        rel = np.array([r[key]["rel"] for r in records])
        out[f"{prefix}_{key}"] = {"median": float(np.median(rel)), "max": float(rel.max()), "n": len(rel),
                                  "flushed_max": max(r[key]["flushed"] for r in records)}
    return out


# --- the run ----------------------------------------------------------------------------------------------------

def snapshots(cfg: config_lib.Config, mesh, points: list[int]):
  """Trains `cfg` for max(points) steps, yielding (step, params, biases, Adam's moments, batch) at each point: the
  state before that step and the batch it trains on."""
  trainer = step_lib.make_trainer(cfg, mesh)
  state = trainer.init()
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  batches = GlobalBatches(cfg, mesh)
  try:
    for step in range(max(points) + 1):
      batch = next(batches)
      if step in points:
        yield step, state.params, state.biases, moments(state.opt_state), batch
      if step < max(points):
        with jax.set_mesh(mesh):
          state, metrics = step_fn(state, batch)
        if step % 25 == 0:
          print(f"  step {step}: loss {float(metrics['loss']):.4f}", flush=True)
  finally:
    batches.close()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", type=Path, default=CONFIG)
  parser.add_argument("--points", type=int, nargs="+", default=[0, 50, 150], help="steps at which to compare")
  parser.add_argument("--runs", nargs="+", default=["false", "rowwise"], help="train.fp8 of the training runs")
  parser.add_argument("--recipes", nargs="+", default=list(RECIPES), help="train.fp8 of the compared gradients")
  parser.add_argument("--gemms", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--results", default=None)
  parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
  args = parser.parse_args()
  steps = max(args.points)
  base = [f"train.steps={max(steps, 1)}", f"optim.warmup_steps={steps // 10}", *args.overrides]
  cfg = lambda *more: load(args.config, *base, *more)
  mesh = make_mesh(cfg(), jax.devices()[:1])
  grads = {r: gradient_fn(cfg(f"train.fp8={r}"), mesh) for r in args.recipes}
  recorded = {r: (GemmRecorder(), gradient_fn(cfg(f"train.fp8={r}"), mesh)) for r in args.recipes if args.gemms}
  reference = gradient_fn(cfg("train.fp8=false", "train.compute_dtype=float32"), mesh)
  rows = []
  for run in args.runs:
    print(f"training {args.config.name} with train.fp8={run} for {steps} steps", flush=True)
    for point, params, biases, adam, batch in snapshots(cfg(f"train.fp8={run}"), mesh, args.points):
      if point == 0 and run != args.runs[0]:
        continue  # every run starts from the same parameters
      ref, expert = flat(reference(params, biases, batch))
      for recipe in args.recipes:
        g = flat(grads[recipe](params, biases, batch))[0]
        row = dict(run="-" if point == 0 else run, step=point, recipe=recipe,
                   **fidelity(g, ref, adam, cfg().optim, expert))
        if recipe in recorded:
          recorder, gradient = recorded[recipe]
          row["gemms"] = recorder.measure(gradient, params, biases, batch)
        rows.append(row)
        print(line(row), flush=True)
  for row in rows:
    common.append_result(args.results or common.RESULTS, dict(
        bench="fp8_fidelity", config=args.config.name, overrides=base, points=args.points, **row))
  report(rows)


GEMM_KEYS = ("proj_y", "proj_dx", "proj_dw", "experts_y", "experts_dx", "experts_dw_in", "experts_dw_down")


def line(row: dict) -> str:
  return (f"{row['run']:<8} {row['step']:>5} {row['recipe']:<10} {row['rel']:>7.2%} {row.get('experts', 0):>8.2%} "
          f"{row.get('other', 0):>7.2%} {row['cos']:>8.5f} {row['bias']:>+8.2%} {row['flushed']:>8.3%} "
          f"{row['adam']:>7.2%}")


def gemm_line(row: dict) -> str:
  gemms = row["gemms"]
  cells = "".join(f" {gemms[k]['median']:>9.2%}" if k in gemms else f" {'':>9}" for k in GEMM_KEYS)
  flushed = max(g["flushed_max"] for g in gemms.values())
  return f"{row['run']:<8} {row['step']:>5} {row['recipe']:<10}{cells} {flushed:>9.3%}"


def report(rows: list[dict]) -> None:
  print("\nWhole-model gradient against float32 compute on the same parameters and batch (run: the training run's "
        "train.fp8; step 0 is both runs' initialisation)")
  print(f"{'run':<8} {'step':>5} {'recipe':<10} {'rel':>7} {'experts':>8} {'other':>7} {'cos':>8} {'bias':>8} "
        f"{'flushed':>8} {'adam':>7}")
  for row in rows:
    print(line(row))
  if any("gemms" in r for r in rows):
    print("\nEach GEMM against float64 of its own operands: the median relative error over the model's GEMMs "
          "(flushed: the largest fraction of an output's elements flushed to zero)")
    names = ("proj y", "proj dx", "proj dw", "exp y", "exp dx", "exp dw_in", "exp dw_dn")
    print(f"{'run':<8} {'step':>5} {'recipe':<10}" + "".join(f" {k:>9}" for k in names) + f" {'flushed':>9}")
    for row in rows:
      if "gemms" in row:
        print(gemm_line(row))


if __name__ == "__main__":
  main()
