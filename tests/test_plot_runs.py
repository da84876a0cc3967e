"""scripts/plot_runs.py: metrics.jsonl loading (resumed steps, missing values), the PNG, and its one-line errors."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxseek.errors import UserError

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plot_runs", ROOT / "scripts" / "plot_runs.py")
plot_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_runs)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MOE = {"moe_load_max_over_mean": 1.5, "moe_load_max_over_mean_worst": 2.5, "moe_dropped_fraction": 0.0,
       "balance_loss": 1.0, "moe_bias_range": 0.01, "moe_load_max_over_mean_by_layer": [1.5, 2.5]}


def record(step: int, loss: float, **extra) -> dict:
  return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, **extra}


def write_run(folder: Path, records: list[dict]) -> Path:
  folder.mkdir(parents=True)
  (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  return folder


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
  """A MoE run resumed after step 2 (steps 2 and 3 logged twice) whose first line lacks tokens/s, and a dense run."""
  timing = {"tokens_per_sec": 1000.0, "mfu": 0.2, "step_time_s": 0.5, "data_wait_s": 0.01}
  moe = write_run(tmp_path / "moe-run", [
      record(1, 5.0, **MOE),
      record(2, 4.0, **timing, **MOE),
      record(3, 3.9, **timing, **MOE),
      record(2, 4.1, **timing, **MOE),  # the resumed run repeats steps 2 and 3: these records win
      record(3, 3.5, **{**timing, "tokens_per_sec": 1200.0}, **MOE),
      record(4, 3.0, **timing, **MOE),
  ])
  dense = write_run(tmp_path / "dense-run", [record(s, 6.0 - s, **timing) for s in range(1, 6)])
  return moe, dense


def check_png(path: Path) -> None:
  assert path.read_bytes()[:8] == PNG_SIGNATURE
  width, height = (round(inches * plot_runs.DPI) for inches in plot_runs.FIGSIZE)
  assert matplotlib.image.imread(path).shape[:2] == (height, width)


def test_load_metrics_keeps_last_record_per_step_and_skips_missing(runs):
  moe, dense = runs
  metrics = plot_runs.load_metrics(moe)
  assert metrics["step"] == [1, 2, 3, 4]
  assert metrics["loss"] == [5.0, 4.1, 3.5, 3.0]
  assert metrics["tokens_per_sec"] == [None, 1000.0, 1200.0, 1000.0]
  assert plot_runs.series(metrics, "tokens_per_sec") == ([2, 3, 4], [1000.0, 1200.0, 1000.0])
  assert plot_runs.series(metrics, "mfu", 100.0) == ([2, 3, 4], [20.0, 20.0, 20.0])
  assert "moe_load_max_over_mean_by_layer" not in metrics  # list-valued keys are ignored
  assert metrics["moe_load_max_over_mean_worst"] == [2.5] * 4
  assert "moe_load_max_over_mean" not in plot_runs.load_metrics(dense)
  assert plot_runs.series(plot_runs.load_metrics(dense), "moe_load_max_over_mean") == ([], [])


def test_moving_average():
  assert plot_runs.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
  assert plot_runs.moving_average([2.0, 4.0], 1) == [2.0, 4.0]


def test_several_runs_overlaid_into_one_png(runs, tmp_path, capsys):
  out = tmp_path / "both.png"
  assert plot_runs.main([str(runs[0]), str(runs[1]), "--out", str(out), "--smooth", "3"]) == 0
  assert capsys.readouterr().out.strip() == str(out)
  check_png(out)


def test_one_run_default_output_and_no_moe(runs, capsys):
  dense = runs[1]
  assert plot_runs.main([str(dense)]) == 0
  assert capsys.readouterr().out.strip() == str(dense / "plots.png")
  check_png(dense / "plots.png")


def test_several_runs_default_to_runs_png_in_cwd(runs, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert plot_runs.main([str(runs[0]), str(runs[1])]) == 0
  check_png(tmp_path / "runs.png")


def test_incomplete_last_line_is_skipped(tmp_path, capsys):
  run = write_run(tmp_path / "live", [record(1, 2.0), record(2, 1.5)])
  with open(run / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "lo')  # the trainer is writing this line right now
  assert plot_runs.load_metrics(run)["step"] == [1, 2]
  assert "metrics.jsonl:3 is incomplete" in capsys.readouterr().err


@pytest.mark.parametrize("name, content, needle", [
    ("empty", "", "metrics.jsonl is empty"),
    ("blank", "\n\n", "metrics.jsonl is empty"),
    ("corrupt", json.dumps(record(1, 2.0)) + "\n{not json\n" + json.dumps(record(3, 1.0)) + "\n",
     "metrics.jsonl:2: not valid JSON"),
    ("array", "[1, 2]\n", "metrics.jsonl:1: not a JSON object"),
    ("nostep", json.dumps({"loss": 1.0}) + "\n", "metrics.jsonl:1: no 'step' key"),
    ("badstep", json.dumps(record(1, 1.0)) + "\n" + json.dumps({"step": "x", "loss": 1.0}) + "\n",
     "metrics.jsonl:2: step 'x' is not an integer"),
])
def test_bad_metrics_file_names_file_and_line(tmp_path, capsys, name, content, needle):
  run = tmp_path / name
  run.mkdir()
  (run / "metrics.jsonl").write_text(content)
  with pytest.raises(UserError, match=needle) as e:
    plot_runs.load_metrics(run)
  assert str(run / "metrics.jsonl") in str(e.value)
  assert plot_runs.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
  assert not (tmp_path / "x.png").exists()


def test_missing_run_dir_or_metrics_file(tmp_path, runs, capsys):
  missing = tmp_path / "nope"
  assert plot_runs.main([str(runs[0]), str(missing)]) == 2
  assert f"run directory {missing} does not exist" in capsys.readouterr().err
  bare = tmp_path / "bare"
  bare.mkdir()
  assert plot_runs.main([str(bare)]) == 2
  assert f"{bare} has no metrics.jsonl" in capsys.readouterr().err
  assert plot_runs.main([str(runs[0]), "--out", str(tmp_path / "no" / "such" / "x.png")]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert plot_runs.main([str(runs[0]), "--smooth", "0"]) == 2
  assert "--smooth 0" in capsys.readouterr().err


def test_cli_exits_2_without_traceback(tmp_path):
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_runs.py"), str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip().count("\n") == 0 and "does not exist" in out.stderr


def test_eval_loss_is_a_dashed_curve_on_the_loss_panel(tmp_path):
  from matplotlib.figure import Figure

  run = write_run(tmp_path / "eval-run", [record(s, 6.0 - s, **({"eval_loss": 7.0 - s} if s % 2 == 0 else {}))
                                         for s in range(1, 6)])
  axes = Figure().subplots(2, 2).flatten()
  plot_runs._draw_run(axes, "eval-run", plot_runs.load_metrics(run), "C0", 1, {})
  lines = {line.get_label(): line for line in axes[0].get_lines()}
  assert list(lines["eval-run (eval)"].get_xdata()) == [2, 4]
  assert list(lines["eval-run (eval)"].get_ydata()) == [5.0, 3.0] and lines["eval-run (eval)"].get_linestyle() == "--"
  assert list(lines["eval-run"].get_xdata()) == [1, 2, 3, 4, 5]
