"""The metrics of a live three-region deployment, as operators read them: `promtool check metrics` on every
balancer's and the controller's /metrics, and a real Prometheus (Debian's ``prometheus``) scraping them every second
while the deployment serves a little load, so that every panel of deploy/grafana/skylb-dashboard.json (its PromQL,
with the dashboard's variables substituted) and every recording rule of deploy/prometheus/skylb-rules.yml returns
data through Prometheus's HTTP API.

The load makes the events the panels show: region us has one replica and gets long prompts at once (its prefill
backlog fills, so requests are forwarded to peers); tenant "tiny" may send 2 requests a minute (quota rejections);
asia has, beside its two replicas, a llama.cpp server still loading its model, registered as a generic
OpenAI-compatible replica: its /v1/models answers (so its probe says healthy) while generation answers 503 "Loading
model", so each request sent there is retried elsewhere and outlier detection ejects it.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import yaml

from bench.launch.procs import ProcGroup, free_port, free_ports, wait_http
from tests.cluster import MODEL, Cluster
from tests.system import require_binary

pytestmark = pytest.mark.xdist_group("cpu_heavy")  # with the other CPU-heavy tests (tests/test_llamacpp.py)

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "skylb-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "skylb-rules.yml"
KEYS = {"alpha": "key-alpha-0123456789", "tiny": "key-tiny-0123456789"}
#: Grafana's $__rate_interval for Prometheus's default 15 s scrape interval (4 x 15 s); the test's load is younger.
RATE_INTERVAL = "1m"
LONG_PROMPT = "tell me about the regions of the world " * 160  # about 1,300 tokens: two fill us's prefill backlog
REGIONS = {"us": 1, "eu": 2, "asia": 2}  # emulated vLLM replicas per region
PEER_TOKEN, ADMIN_TOKEN = "peer-token-metrics-live-9c1e47b2", "admin-token-metrics-live-3f8a60d5"
BALANCER = {"probe_interval_ms": 100, "tenants": {t: [k] for t, k in KEYS.items()},
            "quotas": {"tenants": {"tiny": {"limits": {"*": {"requests_per_minute": 2}}}}},
            "quota": {"wait_s": 0.2, "local_share": 1.0},
            "outlier_detection": {"consecutive_gateway_failure": 1, "base_ejection_time_s": 1.0}}


class Live:
    """The deployment's URLs: controller, balancers and replicas by region, Prometheus; the load's statuses."""

    def __init__(self):
        self.controller = ""
        self.balancers: dict[str, str] = {}
        self.replicas: dict[str, list[str]] = {}
        self.prometheus = ""
        self.statuses: list[int] = []


def _wait_all(waits: list) -> None:
    """Wait until each (Proc, URL) answers (bounded: 30 s each); name the process and its log when one fails."""
    for proc, url in waits:
        try:
            wait_http(url, timeout_s=30, proc=proc.popen)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{proc.name}: {exc}\n--- log ---\n{proc.log()[-4000:]}") from exc


def _start_deployment(procs: ProcGroup, tmp: Path, live: Live) -> None:
    """Controller, emulated vLLM replicas (one process), the loading llama.cpp replica, then a balancer per region,
    each group started at once and then waited for (a loaded machine starts Python processes slowly); the replicas
    registered through the controller's API. Returns once every balancer sees its replicas and its two peers."""
    cluster = Cluster(procs, tmp, balancer=BALANCER, controller={"health": {"interval_s": 0.5}},
                      peer_token=PEER_TOKEN, admin_token=ADMIN_TOKEN)
    config = str(cluster.config(list(REGIONS)))
    ports = iter(free_ports(2 + sum(REGIONS.values()) + len(REGIONS)))
    live.controller = f"http://127.0.0.1:{next(ports)}"
    live.replicas = {r: [f"http://127.0.0.1:{next(ports)}" for _ in range(n)] for r, n in REGIONS.items()}
    vllm = [u for urls in live.replicas.values() for u in urls]
    loading = f"http://127.0.0.1:{next(ports)}"
    _wait_all([
        (procs.skylb("controller", "--config", config, "--port", live.controller.rsplit(":", 1)[1],
                     name="controller", env=cluster.env), f"{live.controller}/healthz"),
        (procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--time-scale", "0.2",
                     *[a for u in vllm for a in ("--port", u.rsplit(":", 1)[1])], name="emulator"),
         f"{vllm[-1]}/health"),
        (procs.skylb("emulator", "--engine", "llamacpp", "--model", MODEL, "--port", loading.rsplit(":", 1)[1],
                     "--load-seconds", "600", name="emulator-loading"), f"{loading}/v1/models")])
    for url in vllm:
        wait_http(f"{url}/health", timeout_s=30)
    live.balancers = {r: f"http://127.0.0.1:{next(ports)}" for r in REGIONS}
    _wait_all([(procs.skylb("balancer", "--config", config, "--region", r, "--port", url.rsplit(":", 1)[1],
                            "--controller", live.controller, name=f"balancer-{r}", env=cluster.env), f"{url}/healthz")
               for r, url in live.balancers.items()])
    live.replicas["asia"].append(loading)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for region, urls in live.replicas.items():
        for i, url in enumerate(urls):
            body = ({"region": region, "url": url, "engine": "openai", "id": "asia-loading"} if url == loading
                    else {"region": region, "url": url, "engine": "vllm", "id": f"{region}-{i}"})
            requests.post(f"{live.controller}/v1/replicas", json=body, headers=admin, timeout=10).raise_for_status()
    cluster.balancers.update(live.balancers)
    for region in REGIONS:
        cluster.wait_replicas_healthy(region, len(live.replicas[region]), timeout_s=20)
        cluster.wait_peers_probed(region, len(REGIONS) - 1, timeout_s=20)


def _start_prometheus(procs: ProcGroup, tmp: Path, live: Live) -> None:
    """Debian's Prometheus on loopback, scraping every balancer (with the peer token) and the controller each
    second, with SkyLB's rules."""
    (tmp / "token").write_text(PEER_TOKEN + "\n")
    (tmp / "skylb-rules.yml").write_text(RULES.read_text())
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": ["skylb-rules.yml"],
              "scrape_configs": [
                  {"job_name": "skylb-balancer", "honor_labels": True,
                   "authorization": {"type": "Bearer", "credentials_file": str(tmp / "token")},
                   "static_configs": [{"targets": [u.removeprefix("http://") for u in live.balancers.values()]}]},
                  {"job_name": "skylb-controller",
                   "static_configs": [{"targets": [live.controller.removeprefix("http://")]}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    live.prometheus = f"http://127.0.0.1:{port}"
    procs.start([require_binary("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                 "--log.level=warn"], name="prometheus", wait_url=f"{live.prometheus}/-/ready", timeout_s=30)
def _query(prometheus: str, expr: str) -> list[dict]:
    """The result of an instant query (Prometheus HTTP API ``/api/v1/query``)."""
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                timeout=10) as resp:
        answer = json.loads(resp.read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _wait_scraped(prometheus: str, n_targets: int) -> None:
    """Until every target has been scraped and is up (bounded: 15 s)."""
    for _ in range(150):
        up = _query(prometheus, "up")
        if len(up) == n_targets and all(s["value"][1] == "1" for s in up):
            return
        time.sleep(0.1)
    raise AssertionError(f"Prometheus targets not all up: {up}")


def _one(base: str, *, key: str, prompt: str, stream: bool, max_tokens: int = 12) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    with requests.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=60, stream=stream) as answer:
        for _ in answer.iter_content(chunk_size=None):
            pass
        return answer.status_code


def _wave(live: Live, wave: int) -> list[int]:
    """One round of load at once: long prompts at us, short streams and whole answers at eu and asia, three
    requests of tenant tiny at eu. Returns the statuses."""
    alpha, urls = KEYS["alpha"], live.balancers
    calls = [(urls["us"], dict(key=alpha, prompt=f"{wave} {i} {LONG_PROMPT}", stream=True)) for i in range(6)]
    calls += [(urls[r], dict(key=alpha, prompt=f"{r} {wave} {i}", stream=i % 3 != 2)) for r in ("eu", "asia")
              for i in range(5)]
    calls += [(urls["eu"], dict(key=KEYS["tiny"], prompt=f"tiny {wave} {i}", stream=True)) for i in range(3)]
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: _one(c[0], **c[1]), calls))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A three-region deployment that served two waves of load while Prometheus scraped it every second."""
    require_binary("prometheus")
    require_binary("promtool")
    tmp = tmp_path_factory.mktemp("metrics-live")
    live = Live()
    with ProcGroup(tmp / "logs") as procs:  # every process stopped at the end, also on failure
        _start_deployment(procs, tmp, live)
        _start_prometheus(procs, tmp, live)
        _wait_scraped(live.prometheus, len(live.balancers) + 1)
        live.statuses = _wave(live, 1)
        time.sleep(2.2)  # two scrapes between the waves: every series is seen before its counters rise again
        live.statuses += _wave(live, 2)
        time.sleep(2.2)  # and two after
        yield live


def _scrape(url: str, token: str | None) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=headers), timeout=10) as resp:
        return resp.read()


def test_promtool_check_metrics_is_clean_on_every_balancer_and_the_controller(live):
    """Each balancer's /metrics after the load (every family with samples: latencies, tokens, quota, retries,
    ejections) and the controller's /metrics pass `promtool check metrics`; the controller's has its membership
    by state, revision, health checks by result and leadership."""
    assert live.statuses.count(200) >= 20 and 429 in live.statuses, live.statuses
    promtool = require_binary("promtool")
    texts = {region: _scrape(url, PEER_TOKEN) for region, url in live.balancers.items()}
    texts["controller"] = _scrape(live.controller, None)
    for name, text in texts.items():
        checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
        assert checked.returncode == 0, (name, checked.stdout + checked.stderr)
    for family in (b"skylb_e2e_latency_seconds_bucket", b"skylb_inter_token_latency_seconds_bucket",
                   b"skylb_prompt_tokens_total", b"skylb_completion_tokens_total"):
        assert family in texts["us"], family
    assert b"skylb_outlier_ejections_total" in texts["asia"] and b"skylb_retries_total" in texts["asia"]
    controller = texts["controller"].decode()
    assert 'skylb_controller_replicas{region="eu",state="healthy"} 2.0' in controller
    assert 'skylb_controller_balancers{region="us",state="healthy"} 1.0' in controller
    assert 'skylb_controller_health_checks_total{region="eu",result="success",target="replica"}' in controller
    assert "skylb_controller_leader 1.0" in controller and "skylb_controller_membership_revision " in controller


def _has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_every_dashboard_panel_and_recording_rule_has_data_in_prometheus(live):
    """The dashboard's region variable lists the three regions; every query of every panel, with $region as
    Grafana writes a multi-value selection and $__rate_interval as for a 15 s scrape, returns at least one finite
    sample; so does every recording rule Prometheus evaluated."""
    dashboard = json.loads(DASHBOARD.read_text())
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "region"]
    metric = variable["definition"].removeprefix("label_values(").split(",")[0]
    with urllib.request.urlopen(f"{live.prometheus}/api/v1/label/region/values?match[]={metric}",
                                timeout=10) as resp:
        regions = sorted(json.loads(resp.read())["data"])
    assert regions == sorted(live.balancers)
    empty = []
    queries = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) >= 20
    for title, expr in queries:
        promql = expr.replace("$region", f"({'|'.join(regions)})").replace("$__rate_interval", RATE_INTERVAL)
        if not _has_data(_query(live.prometheus, promql)):
            empty.append(f"{title}: {promql}")
    rules = yaml.safe_load(RULES.read_text())
    for record in [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]:
        if not _has_data(_query(live.prometheus, record)):
            empty.append(f"recording rule {record}")
    assert not empty, "no data for:\n" + "\n".join(empty)
