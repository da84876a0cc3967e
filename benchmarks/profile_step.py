"""Where jaxseek's train step spends its time on CPU: a profile of the step, summed by model part.

  python benchmarks/profile_step.py [--steps 3] [--batch 8] [--seq 256] [--set KEY=VALUE ...]
                                    [--jax section.key=value ...] [--top 15] [--trace DIR]

The model is bench_vs_hf.py's (benchmarks/common.py SMALL_V3 with a 4,096-word vocabulary, random weights; --set
changes it, --jax overrides jaxseek's config). The step is compiled and run twice, then `--steps` steps run under
`jax.profiler` (the trace stays in --trace, readable by TensorBoard or Perfetto). Each XLA operation's self time
(its span less its children's) on the executor's threads is attributed by the named scope in its HLO op name:

  attention   the attention sublayer (norm, projections, rotary, scores, softmax, output)
  experts     the routed experts' grouped SwiGLU (kernels/grouped.py, scope routed_experts)
  moe other   the rest of the MoE sublayer: router, shared expert, sort and unsort
  mlp         the dense layers' MLP
  loss head   the final projection and cross entropy (model/loss.py)
  other       the rest under autodiff: embedding, the layer loop's slicing and stacking, residual adds
  optimizer   everything outside autodiff: AdamW, the bias update, metrics

split into forward (jvp) and backward (transpose). Thread time exceeds the step's wall time where both threads
work at once. Prints the table and the `--top` operations.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import tempfile

PARTS = (("loss_head", "loss head"), ("routed_experts", "experts"), ("/moe/", "moe other"),
         ("/attention/", "attention"), ("/mlp/", "mlp"))
DEFINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ")
OP_NAME = re.compile(r'op_name="([^"]*)"')


def part_of(op_name: str) -> tuple[str, str]:
  """(part, direction) of an operation from its HLO op name."""
  direction = "backward" if "transpose(jvp" in op_name else "forward" if "jvp(" in op_name else "update"
  if direction == "update":
    return "optimizer", direction
  return next((label for key, label in PARTS if key in op_name), "other"), direction


def op_names(hlo: str) -> dict[str, tuple[str, str]]:
  """instruction name → (op name, shape) of a compiled module's text."""
  out = {}
  for line in hlo.splitlines():
    d = DEFINE.match(line)
    if d:
      found = OP_NAME.search(line)
      out[d.group(1)] = (found.group(1) if found else "", d.group(2))
  return out


def self_times(trace_dir: str, names: dict) -> tuple[collections.Counter, collections.Counter]:
  """Self time (ns) per instruction and per thread, over the executor threads of the trace."""
  import jax

  path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
  per_op, per_thread = collections.Counter(), collections.Counter()
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    for line in plane.lines:
      if line.name == "python" or "PjRt" in line.name:
        continue
      events = sorted(((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events),
                      key=lambda e: (e[0], -e[1]))
      stack = []

      def close(upto):
        while stack and stack[-1][1] <= upto:
          start, end, name, children = stack.pop()
          own = end - start - children
          per_op[name if name in names else "(runtime)"] += own
          per_thread[line.name] += own
          if stack:
            stack[-1][3] += end - start

      for start, end, name in events:
        close(start)
        stack.append([start, end, name, 0])
      close(float("inf"))
  return per_op, per_thread


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
  parser.add_argument("--jax", nargs="*", default=[], metavar="SECTION.KEY=VALUE")
  parser.add_argument("--top", type=int, default=15)
  parser.add_argument("--trace", default=None, help="folder for the trace (default: a temporary one)")
  args = parser.parse_args()
  import bench_vs_hf

  bench_vs_hf._jax_overrides(args.jax)
  import jax

  import common
  from jaxseek.convert import hf

  model = common.parse_sets([*bench_vs_hf.DEFAULT_SETS, *args.set], common.SMALL_V3)
  raw = common.config_lib.to_dict(common.config_lib.Config(model=hf.model_config(model, 0)))["model"]
  timer = common.StepTimer(common.with_overrides(common.make_config(raw, args.batch, args.seq), args.jax))
  names = op_names(timer.step_fn.as_text())
  times, _ = timer.run(args.steps, warmup=2)
  trace = args.trace or tempfile.mkdtemp(prefix="jaxseek-profile-")
  jax.profiler.start_trace(trace)
  timer.run(args.steps, warmup=0)
  jax.profiler.stop_trace()
  per_op, per_thread = self_times(trace, names)
  report(per_op, per_thread, names, args, statistics.median(times[2:]), trace)


def report(per_op, per_thread, names, args, step_s: float, trace: str) -> None:
  ms = lambda ns: ns / args.steps / 1e6
  table = collections.Counter()
  for name, ns in per_op.items():
    table[part_of(names[name][0]) if name in names else ("runtime", "")] += ns
  total = sum(table.values())
  print(f"step {step_s:.3f} s (median of {args.steps}, unprofiled); thread time per step {ms(total):.0f} ms on "
        f"{len(per_thread)} threads; trace in {trace}")
  print(f"{'part':<12} {'forward':>9} {'backward':>9} {'update':>9} {'total ms':>9} {'share':>6}")
  parts = sorted({p for p, _ in table}, key=lambda p: -sum(v for (q, _), v in table.items() if q == p))
  for part in parts:
    row = [table[(part, d)] for d in ("forward", "backward", "update")] + [table[(part, "")]]
    print(f"{part:<12} {ms(row[0]):>9.0f} {ms(row[1]):>9.0f} {ms(row[2] + row[3]):>9.0f} {ms(sum(row)):>9.0f} "
          f"{100 * sum(row) / total:>5.1f}%")
  print(f"top {args.top} operations (self ms per step, op name):")
  for name, ns in per_op.most_common(args.top + 1):
    if name in names:
      print(f"  {ms(ns):7.1f}  {names[name][1][:28]:<28} {names[name][0].split('jit(main)/')[-1][-90:]}")


if __name__ == "__main__":
  main()
