"""deploy/prometheus and deploy/grafana: the rules pass `promtool check rules` and their unit tests (one per alert,
`promtool test rules`), the example Prometheus configuration passes `promtool check config`, and the dashboard's
queries name only metrics SkyLB exports. That every panel finds data is tests/test_metrics_live.py's job."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tests.system import require_binary

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "skylb-dashboard.json"


def _promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check_and_every_alert_has_a_unit_test():
    """`promtool check rules` accepts skylb-rules.yml; `promtool test rules` passes; each alert is named in an
    alert_rule_test that expects it to fire at some time and not at another."""
    checked = _promtool("check", "rules", "skylb-rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", "skylb-rules.test.yml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    rules = yaml.safe_load((PROMETHEUS / "skylb-rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert {"SkyLBBalancerDown", "SkyLBReplicaEjected", "SkyLBForwardingSaturated", "SkyLBQueueWaitOverTarget",
            "SkyLBQuotaRejectionsClimbing"} <= alerts
    tests = yaml.safe_load((PROMETHEUS / "skylb-rules.test.yml").read_text())["tests"]
    for alert in alerts:
        cases = [c for t in tests for c in t.get("alert_rule_test", []) if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in cases) and any(not c["exp_alerts"] for c in cases), alert


def test_a_broken_alert_fails_its_unit_test(tmp_path):
    """The unit tests can fail: with SkyLBReplicaEjected's expression inverted, `promtool test rules` fails."""
    broken = (PROMETHEUS / "skylb-rules.yml").read_text().replace(
        'skylb_replica_available{reason="ejected (outlier detection)"} == 0',
        'skylb_replica_available{reason="ejected (outlier detection)"} == 1')
    (tmp_path / "skylb-rules.yml").write_text(broken)
    (tmp_path / "skylb-rules.test.yml").write_text((PROMETHEUS / "skylb-rules.test.yml").read_text())
    tested = _promtool("test", "rules", "skylb-rules.test.yml", cwd=tmp_path)
    assert tested.returncode != 0 and "SkyLBReplicaEjected" in tested.stdout + tested.stderr


def test_example_prometheus_config_passes_promtool_check_config(tmp_path):
    """deploy/prometheus/prometheus.yml (its token file pointed at a real file) passes `promtool check config`,
    rules included."""
    token = tmp_path / "token"
    token.write_text("secret\n")
    config = (PROMETHEUS / "prometheus.yml").read_text().replace("/etc/prometheus/skylb-metrics-token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    (tmp_path / "skylb-rules.yml").write_text((PROMETHEUS / "skylb-rules.yml").read_text())
    checked = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_dashboard_queries_name_only_exported_metrics():
    """Every skylb_* name in the dashboard's and the rules' queries is one the balancer or controller defines (a
    renamed metric cannot leave a panel or a rule behind)."""
    sources = "\n".join(p.read_text() for p in [*(ROOT / "skylb").rglob("*.py"), *(ROOT / "controller").rglob("*.py")])
    defined = set(re.findall(r'"(skylb_[a-z0-9_]+)"', sources))
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = yaml.safe_load((PROMETHEUS / "skylb-rules.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert len(exprs) > 30
    used = {m for e in exprs for m in re.findall(r"(?<![:\w])(skylb_[a-z0-9_]+)", e)}
    suffixes = ("_total", "_bucket", "_count", "_sum")
    missing = {m for m in used if m not in defined and not any(m.endswith(s) and m[:-len(s)] in defined
                                                               for s in suffixes)}
    assert used and not missing
