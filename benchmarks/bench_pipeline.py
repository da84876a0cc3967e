"""Pipeline schedule cost: step time and compiled temp memory against microbatches and repeats, with the bubble.

  python benchmarks/bench_pipeline.py [--stages 4] [--micro 1 2 4 8 16] [--repeats 1 2]
                                      [--schedules gpipe 1f1b zb_h1 zbv dualpipev zbv-kept ...]
                                      [--batch 32] [--seq 128]

A dense model of 8 layers (DeepSeek LLM layout, hidden 256) on --stages simulated CPU devices, mesh
pipeline=S, against the same model on one device (no pipeline). Per schedule (gpipe: all forwards then all
backwards, circular with R > 1 chunks per stage; 1f1b: one forward and one backward a tick, interleaved with
R > 1; the zero-bubble tables, their backward split into b and W: zb_h1 with R = 1, zbv and dualpipev with two
chunks a stage on a V, whatever --repeats says), microbatch count M and repeats R: median step time over 3 steps
after a warm-up, the compiled step's temp memory per device (XLA's memory_analysis), the bubble of the table the
step runs (F = 1, B = 2; F = b = W = 1 when split) beside its formula ((S − 1)/(R·M + S − 1) for 1F1B when S
divides M, (S − 1)/(3M + S − 1) for ZB-H1, (S − 1)/(6M + S − 1) on the V), and what a stage keeps (stage inputs,
cotangents, stashes for W, and forward residuals for b). A "-kept" suffix (zb_h1-kept, zbv-kept, dualpipev-kept)
runs the schedule with train.pipeline_recompute=false: F keeps the forward's residuals, b does not recompute
the forward, and the table is the unit order (F = b = W = 1). The simulated devices share this machine's cores, so a step costs the work of every
stage whatever the bubble: the split's cost shows as the ratio of a zero-bubble schedule's step time to 1F1B's
(1F1B and the zero-bubble tables also recompute each chunk's forward in its backward: about 4/3 of the work).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--micro", type=int, nargs="*", default=[1, 2, 4, 8, 16])
  parser.add_argument("--repeats", type=int, nargs="*", default=[1, 2])
  parser.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b"])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--steps", type=int, default=3, help="timed steps per run (the median is reported)")
  parser.add_argument("--results", default=None)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", args.stages)
  import common
  from jaxseek import step as step_lib
  from jaxseek.input import global_batches
  from jaxseek.pipeline import tables
  from jaxseek.pipeline.stages import bubble as formula_bubble
  from jaxseek.sharding.mesh import make_mesh

  model = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=args.layers,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)

  def measure(stages: int, micro: int, repeats: int = 1, schedule: str = "gpipe",
              recompute: bool = True) -> tuple[float, float]:
    cfg = common.config_lib.from_dict({"model": model, "mesh": {"pipeline": stages, "data": 1},
                                       "data": {"source": "synthetic"},
                                       "train": {"batch_size": args.batch, "seq_len": args.seq,
                                                 "microbatches": micro, "pipeline_repeats": repeats,
                                                 "pipeline_schedule": schedule, "steps": 100,
                                                 "pipeline_recompute": recompute}})
    mesh = make_mesh(cfg, jax.devices()[:stages])
    trainer, state = step_lib.init_state(cfg, mesh)
    batches = global_batches(cfg, mesh)
    batch = next(batches)
    with jax.set_mesh(mesh):
      compiled = step_lib.compile_step(trainer, cfg, mesh).lower(state, batch).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      state, metrics = compiled(state, batch)
      float(metrics["loss"])
      times = []
      for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times), temp

  base_time, base_temp = measure(1, 1)
  S = args.stages
  print(f"dense {args.layers} layers, batch {args.batch} x {args.seq}; one device without pipeline: "
        f"step {base_time:.3f} s, temp {base_temp / 2**20:.1f} MiB")
  print(f"{'schedule':>17} {'S':>2} {'R':>2} {'M':>3} {'bubble':>7} {'formula':>8} {'kept i/c/s':>11} {'step s':>7} "
        f"{'vs 1 dev':>9} {'temp MiB/dev':>13}")
  fixed = {"dualpipev": 2, "zbv": 2, "zb_h1": 1}  # chunks a stage these schedules run
  for kind in args.schedules:
    recompute = not kind.endswith("-kept")
    kind = kind.removesuffix("-kept")
    for repeats in ([fixed[kind]] if kind in fixed else args.repeats):
      schedule = {"gpipe": "gpipe", "1f1b": "1f1b" if repeats == 1 else "interleaved_1f1b"}.get(kind, kind)
      for micro in args.micro:
        step, temp = measure(S, micro, repeats, schedule, recompute)
        kept, formula = "-", formula_bubble(schedule, S, micro, repeats)
        if kind == "gpipe":
          bubble = formula
        else:
          table = tables.table(schedule, S, micro, repeats, recompute=recompute)
          bubble = table.bubble()
          kept = f"{table.slots}/{table.grad_slots}/{table.stash_slots}"
          kept += f"/{table.residual_slots}" if table.residual_slots else ""
        name = schedule if repeats == 1 or kind != "gpipe" else "circular"
        name += "" if recompute else "-kept"
        print(f"{name:>17} {S:>2} {repeats:>2} {micro:>3} {100 * bubble:>6.1f}% {100 * formula:>7.1f}% {kept:>11} "
              f"{step:>7.3f} {step / base_time:>8.2f}x {temp / 2**20:>13.1f}", flush=True)
        common.append_result(args.results or common.RESULTS, dict(
            bench="pipeline", schedule=name, stages=S, repeats=repeats, microbatches=micro, bubble=bubble,
            formula_bubble=formula, kept=kept, step_s=step, single_device_step_s=base_time, temp_bytes=temp))


if __name__ == "__main__":
  sys.exit(main())
