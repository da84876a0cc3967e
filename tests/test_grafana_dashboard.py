"""docs/grafana-dashboard.json: imports cleanly, queries only metrics the trainer exports, filters every one by run."""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"

# What the trainer's Prometheus writer exports (jaxseek/metrics.py); each must have a panel.
REQUIRED = {
    "jaxseek_step", "jaxseek_loss", "jaxseek_learning_rate", "jaxseek_grad_norm", "jaxseek_tokens_per_second",
    "jaxseek_mfu", "jaxseek_tflops_per_device", "jaxseek_step_time_seconds", "jaxseek_data_wait_seconds",
    "jaxseek_checkpoint_block_seconds", "jaxseek_device_memory_bytes", "jaxseek_moe_load_max_over_mean",
    "jaxseek_moe_load_max_over_mean_worst", "jaxseek_moe_dropped_fraction", "jaxseek_moe_extra_round_fraction",
    "jaxseek_skipped_steps_total",
}
OPTIONAL = {"jaxseek_host_memory_bytes", "jaxseek_mtp_loss", "jaxseek_eval_loss", "jaxseek_eval_perplexity",
            "jaxseek_eval_mtp_loss"}  # also exported; the dashboard may show them
ROWS = ["Progress", "Throughput", "Memory & I/O", "MoE balance"]
SELECTOR = re.compile(r"\b(jaxseek_[a-z0-9_]+)\b(\{[^}]*\})?")
RUN_FILTER = 'run=~"$run"'


@pytest.fixture(scope="module")
def dashboard() -> dict:
  return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
  """Every panel, rows' nested panels included."""
  out = []
  for panel in dashboard["panels"]:
    out.append(panel)
    out += panel.get("panels", [])
  return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
  return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]


def test_imports_with_a_prometheus_input(dashboard):
  assert dashboard["schemaVersion"] == 39 and dashboard["refresh"] == "10s" and dashboard["uid"]
  assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
      ("DS_PROMETHEUS", "datasource", "prometheus")]
  variables = {v["name"]: v for v in dashboard["templating"]["list"]}
  assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
  run = variables["run"]
  assert run["definition"] == "label_values(jaxseek_step, run)" and run["includeAll"] and run["multi"]
  assert run["datasource"]["uid"] == "${DS_PROMETHEUS}"
  for panel in panels(dashboard):
    if panel["type"] != "row":
      assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
      assert panel["targets"] and all(t["datasource"] == panel["datasource"] for t in panel["targets"])


def test_rows_and_layout(dashboard):
  assert [p["title"] for p in dashboard["panels"] if p["type"] == "row"] == ROWS
  cells = set()
  ids = [p["id"] for p in panels(dashboard)]
  assert len(ids) == len(set(ids))
  for panel in panels(dashboard):
    g = panel["gridPos"]
    assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
    cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
    assert not cells & cell, f"{panel['title']} overlaps another panel"
    cells |= cell


def test_every_query_is_an_exported_metric_filtered_by_run(dashboard):
  seen = set()
  for title, expr in queries(dashboard):
    matches = SELECTOR.findall(expr)
    assert matches, f"{title}: {expr} names no jaxseek metric"
    for metric, selector in matches:
      assert metric in REQUIRED | OPTIONAL, f"{title}: {metric} is not exported by the trainer"
      assert RUN_FILTER in selector, f"{title}: {expr} does not filter by {RUN_FILTER}"
      seen.add(metric)
  assert REQUIRED <= seen, f"no panel for {sorted(REQUIRED - seen)}"


def test_stat_panels_and_units(dashboard):
  by_title = {p["title"]: p for p in panels(dashboard)}
  stat_metrics = {SELECTOR.match(t["expr"]).group(1) for p in panels(dashboard) if p["type"] == "stat"
                  for t in p["targets"]}
  assert {"jaxseek_step", "jaxseek_loss"} <= stat_metrics
  assert all(p["type"] in ("row", "stat", "timeseries") for p in panels(dashboard))

  def unit(metric: str) -> set[str]:
    return {p["fieldConfig"]["defaults"].get("unit") for p in panels(dashboard) if p["type"] == "timeseries"
            and any(SELECTOR.match(t["expr"]).group(1) == metric for t in p["targets"])}

  assert unit("jaxseek_mfu") == {"percentunit"}
  assert unit("jaxseek_device_memory_bytes") == {"bytes"}
  assert unit("jaxseek_step_time_seconds") == {"s"}
  memory = next(p for p in by_title.values() if "jaxseek_device_memory_bytes" in json.dumps(p.get("targets")))
  assert "{{device}}" in memory["targets"][0]["legendFormat"]  # one series per device


def test_metric_names_match_the_exporter():
  """The names above are the ones jaxseek/metrics.py serves (read from its source: no jax import)."""
  source = (ROOT / "jaxseek" / "metrics.py").read_text()
  gauges = next(node.value for node in ast.parse(source).body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "PROMETHEUS_GAUGES" for t in node.targets))
  exported = set(ast.literal_eval(gauges).values())
  for name in ("jaxseek_device_memory_bytes", "jaxseek_skipped_steps"):  # a per-device gauge and a counter
    assert f'"{name}"' in source
    exported.add(name)
  exported.add("jaxseek_skipped_steps_total")  # prometheus_client serves a counter with the _total suffix
  assert REQUIRED | OPTIONAL <= exported
