"""Pipeline schedule cost: step time and compiled temp memory against microbatches and repeats, with the bubble.

  python benchmarks/bench_pipeline.py [--stages 4] [--micro 1 2 4 8 16] [--repeats 1 2]
                                      [--schedules gpipe 1f1b dualpipev]
                                      [--batch 32] [--seq 128]

A dense model of 8 layers (DeepSeek LLM layout, hidden 256) on --stages simulated CPU devices, mesh
pipeline=S, against the same model on one device (no pipeline). Per schedule (gpipe: all forwards then all
backwards, circular with R > 1 chunks per stage; 1f1b: one forward and one backward a tick, interleaved with
R > 1; dualpipev: two chunks a stage on a V, run once whatever --repeats says), microbatch count M and repeats R: median step time over 3 steps after a warm-up, the compiled step's
temp memory per device (XLA's memory_analysis), and the bubble (= (S − 1)/(R·M + S − 1) when S divides M). The
simulated devices share this machine's cores, so a step costs the work of every stage including the bubble
ticks: time / single-device time should track ticks / (R·M) (1F1B also recomputes each stage's forward in its
backward: about 4/3 of the work).
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
  parser.add_argument("--results", default=None)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", args.stages)
  import common
  from jaxseek import step as step_lib
  from jaxseek.input import global_batches
  from jaxseek.sharding import schedules
  from jaxseek.sharding.pipeline import bubble_fraction, num_ticks
  from jaxseek.sharding.mesh import make_mesh

  model = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=args.layers,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)

  def measure(stages: int, micro: int, repeats: int = 1, schedule: str = "gpipe") -> tuple[float, float]:
    cfg = common.config_lib.from_dict({"model": model, "mesh": {"pipeline": stages, "data": 1},
                                       "data": {"source": "synthetic"},
                                       "train": {"batch_size": args.batch, "seq_len": args.seq,
                                                 "microbatches": micro, "pipeline_repeats": repeats,
                                                 "pipeline_schedule": schedule, "steps": 100}})
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
      for _ in range(3):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times), temp

  base_time, base_temp = measure(1, 1)
  S = args.stages
  print(f"dense {args.layers} layers, batch {args.batch} x {args.seq}; one device without pipeline: "
        f"step {base_time:.3f} s, temp {base_temp / 2**20:.1f} MiB")
  print(f"{'schedule':>17} {'S':>2} {'R':>2} {'M':>3} {'bubble':>7} {'ticks/RM':>9} {'step s':>7} {'vs 1 dev':>9} "
        f"{'temp MiB/dev':>13}")
  for kind in args.schedules:
    for repeats in ([2] if kind == "dualpipev" else args.repeats):
      schedule = {"gpipe": "gpipe", "1f1b": "1f1b" if repeats == 1 else "interleaved_1f1b",
                  "dualpipev": "dualpipev"}[kind]
      for micro in args.micro:
        step, temp = measure(S, micro, repeats, schedule)
        if kind == "gpipe":
          ideal, bubble = num_ticks(S, micro, repeats) / (repeats * micro), bubble_fraction(S, micro, repeats)
        else:
          table = schedules.dualpipev(S, micro) if kind == "dualpipev" else schedules.one_f_one_b(S, micro, repeats)
          bubble = table.bubble()
          ideal = 1 / (1 - bubble)
        name = schedule if repeats == 1 or kind != "gpipe" else "circular"
        print(f"{name:>17} {S:>2} {repeats:>2} {micro:>3} {100 * bubble:>6.1f}% {ideal:>9.2f} {step:>7.3f} "
              f"{step / base_time:>8.2f}x {temp / 2**20:>13.1f}", flush=True)
        common.append_result(args.results or common.RESULTS, dict(
            bench="pipeline", schedule=name, stages=S, repeats=repeats, microbatches=micro, bubble=bubble,
            step_s=step, single_device_step_s=base_time, temp_bytes=temp))


if __name__ == "__main__":
  sys.exit(main())
