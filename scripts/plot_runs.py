"""Plot loss (and eval_loss), throughput, MFU and MoE balance of one or more runs from their metrics.jsonl into one
PNG.

  python scripts/plot_runs.py RUN_DIR [RUN_DIR ...] [--out FILE.png] [--smooth N]

One run writes RUN_DIR/plots.png, several write ./runs.png (one colour per run), unless --out says otherwise.
--smooth N draws the loss as a moving average over N points with the raw curve faint behind it.
Needs matplotlib (pip install -e ".[plot]").
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jaxseek import metrics  # noqa: E402
from jaxseek.errors import UserError, cli  # noqa: E402

FIGSIZE = (12.0, 8.0)  # inches; with DPI the PNG is 1200 x 800 pixels
DPI = 100
REQUIRED = ("step", "loss")
MOE_KEY, MOE_WORST_KEY = "moe_load_max_over_mean", "moe_load_max_over_mean_worst"
MARKERS_UP_TO = 40  # draw point markers on a curve with at most this many points (sparse logging)


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _records(path: Path) -> list[tuple[int, dict]]:
  """(line number, record) per non-blank line; a last line cut off mid-write (no newline) is skipped with a note."""
  records, partial = metrics.jsonl_records(path)
  if partial is not None:
    print(f"note: {path}:{partial} is incomplete (still being written?); skipped", file=sys.stderr)
  out = []
  for number, record in records:
    for key in REQUIRED:
      if key not in record:
        raise UserError(f"{path}:{number}: no {key!r} key")
    step = record["step"]
    if not _number(step) or not math.isfinite(step) or step != int(step):
      raise UserError(f"{path}:{number}: step {step!r} is not an integer")
    if record["loss"] is not None and not _number(record["loss"]):
      raise UserError(f"{path}:{number}: loss {record['loss']!r} is not a number")
    out.append((number, record))
  return out


def load_metrics(run_dir: str | Path) -> dict[str, list]:
  """Scalar metrics of a run, one list per key aligned with the sorted list under "step".

  A step logged twice (a resumed run repeats the steps after its last checkpoint) keeps its last record. A key a
  record lacks (or logs as null) is None there; a key no record has is absent. List-valued keys are left out.
  """
  run_dir = Path(run_dir)
  if not run_dir.exists():
    raise UserError(f"run directory {run_dir} does not exist")
  if not run_dir.is_dir():
    raise UserError(f"{run_dir} is not a directory; give a run directory (the one holding metrics.jsonl)")
  path = run_dir / "metrics.jsonl"
  if not path.is_file():
    raise UserError(f"{run_dir} has no metrics.jsonl; is it a run directory (train.run_dir)?")
  by_step = {int(record["step"]): record for _, record in _records(path)}  # later lines win
  if not by_step:
    raise UserError(f"{path} is empty: the run has logged no step yet")
  steps = sorted(by_step)
  keys = []
  for step in steps:
    keys += [k for k, v in by_step[step].items() if k != "step" and _number(v) and k not in keys]
  out: dict[str, list] = {"step": steps}
  for key in keys:
    out[key] = [by_step[s][key] if _number(by_step[s].get(key)) else None for s in steps]
  return out


def series(metrics: dict[str, list], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
  """(steps, values) of one key, leaving out the steps that lack it; empty lists when no step has it."""
  values = metrics.get(key) or []
  pairs = [(s, v * scale) for s, v in zip(metrics["step"], values) if v is not None]
  return [s for s, _ in pairs], [v for _, v in pairs]


def moving_average(values: Sequence[float], n: int) -> list[float]:
  """Trailing mean over the last n finite points (fewer at the start); a non-finite point stays as it is."""
  out, window = [], []
  for v in values:
    if math.isfinite(v):
      window = (window + [v])[-n:]
      out.append(sum(window) / len(window))
    else:
      out.append(v)
  return out


def _labels(run_dirs: Sequence[Path]) -> list[str]:
  """Legend label per run: the directory's name, or the path as given where two runs share a name."""
  names = [Path(d).resolve().name or str(d) for d in run_dirs]
  labels = [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]
  return [label if labels.count(label) == 1 else f"{label} ({i + 1})" for i, label in enumerate(labels)]


def _empty(ax, text: str) -> None:
  ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=12, color="0.4")
  ax.set_xticks([])
  ax.set_yticks([])


def _line(ax, xs: list[int], ys: list[float], **kwargs) -> None:
  if len(xs) <= MARKERS_UP_TO:
    kwargs.setdefault("marker", "o")
    kwargs.setdefault("markersize", 3)
  ax.plot(xs, ys, **kwargs)


def _draw_run(axes, label: str, metrics: dict[str, list], color: str, smooth: int, has: dict[str, bool]) -> None:
  """One run's curves on the four panels; marks in `has` which panels got data."""
  ax_loss, ax_tps, ax_mfu, ax_moe = axes
  steps, loss = series(metrics, "loss")
  if smooth > 1:
    _line(ax_loss, steps, loss, color=color, alpha=0.25, linewidth=1)
    ax_loss.plot(steps, moving_average(loss, smooth), color=color, linewidth=1.8, label=label)
  else:
    _line(ax_loss, steps, loss, color=color, linewidth=1.5, label=label)
  xs, ys = series(metrics, "eval_loss")  # held-out loss (eval.every): dashed, a point per evaluation
  if xs:
    ax_loss.plot(xs, ys, color=color, linewidth=1.5, linestyle="--", marker="s", markersize=4, label=f"{label} (eval)")
  for ax, key, scale in ((ax_tps, "tokens_per_sec", 1.0), (ax_mfu, "mfu", 100.0)):
    xs, ys = series(metrics, key, scale)
    if xs:
      has[key] = True
      _line(ax, xs, ys, color=color, linewidth=1.5, label=label)
  for key, style in ((MOE_KEY, dict(linewidth=1.5, label=label)), (MOE_WORST_KEY, dict(linewidth=1.2, linestyle="--"))):
    xs, ys = series(metrics, key)
    if xs:
      has[MOE_KEY] = True
      _line(ax_moe, xs, ys, color=color, **style)


def plot(runs: dict[str, dict[str, list]], out: str | Path, smooth: int = 1) -> Path:
  """Draws the runs (legend label → load_metrics output) into one PNG at out; returns its path."""
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
  except ImportError:
    raise UserError('plotting needs matplotlib: pip install -e ".[plot]"')
  out = Path(out)
  if not out.parent.is_dir():
    raise UserError(f"--out {out}: folder {out.parent} does not exist")

  fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
  FigureCanvasAgg(fig)  # the Agg backend: PNG output with no display
  (ax_loss, ax_tps), (ax_mfu, ax_moe) = fig.subplots(2, 2)
  panels = {
      ax_loss: ("loss", "loss" + (f" (moving average over {smooth} points)" if smooth > 1 else "")),
      ax_tps: ("tokens/s", "throughput"),
      ax_mfu: ("MFU (%)", "model FLOPs utilisation"),
      ax_moe: ("expert load max / mean", "MoE balance"),
  }
  for ax, (ylabel, title) in panels.items():
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)

  has = {"tokens_per_sec": False, "mfu": False, MOE_KEY: False}
  for i, (label, metrics) in enumerate(runs.items()):
    _draw_run((ax_loss, ax_tps, ax_mfu, ax_moe), label, metrics, f"C{i % 10}", smooth, has)

  ax_loss.legend(fontsize=9)
  if not has["tokens_per_sec"]:
    _empty(ax_tps, "no tokens_per_sec metrics")
  if not has["mfu"]:
    _empty(ax_mfu, "no MFU metrics")
  if has[MOE_KEY]:
    ax_moe.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")  # perfectly balanced experts
    styles = [Line2D([], [], color="0.3", linestyle="-", label="mean over layers"),
              Line2D([], [], color="0.3", linestyle="--", label="worst layer")]
    ax_moe.legend(handles=styles, fontsize=9)
  else:
    _empty(ax_moe, "no MoE metrics")
  if len(runs) == 1:
    label, metrics = next(iter(runs.items()))
    fig.suptitle(f"{label}: steps {metrics['step'][0]}-{metrics['step'][-1]}")
  else:
    fig.suptitle(f"{len(runs)} runs")
  try:
    fig.savefig(out, dpi=DPI, format="png")
  except OSError as e:
    raise UserError(f"cannot write {out}: {e.strerror or e}")
  return out


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
  p.add_argument("--out", help="PNG to write (default: RUN_DIR/plots.png for one run, ./runs.png for several)")
  p.add_argument("--smooth", type=int, default=1, metavar="N", help="moving average of the loss over N points")
  return p


@cli
def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  if args.smooth < 1:
    raise UserError(f"--smooth {args.smooth}: give a number of points, 1 or more")
  run_dirs = [Path(d) for d in args.run_dirs]
  runs = dict(zip(_labels(run_dirs), (load_metrics(d) for d in run_dirs)))
  if args.out:
    out = Path(args.out)
  else:
    out = run_dirs[0] / "plots.png" if len(run_dirs) == 1 else Path("runs.png")
  print(plot(runs, out, args.smooth))
  return 0


if __name__ == "__main__":
  sys.exit(main())
