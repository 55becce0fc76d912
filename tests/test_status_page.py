"""The status page (skylb/status_page, controller/status_view.py): in a real headless Chromium driven by Selenium
against a live three-region deployment, the login form sets an HttpOnly, SameSite=Strict session cookie and no token
appears in any URL the browser asks for; the revision and figures the page draws match ``/skylb/v1/status`` of the
same revision, on the controller and on a balancer. Chromium and chromedriver come from Debian's packages
(deploy/system/install-packages.sh): skipped without them, a failure under CI=true. The session cookie and
protected mode are pinned without a browser.
"""

from __future__ import annotations

import fnmatch
import json
import time
import tomllib
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import pytest
import requests
from aiohttp.test_utils import make_mocked_request
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from skylb import status_page
from skylb.status_page import ADMIN_SESSION, PEER_SESSION, SESSION_TTL_S, PageAccess, session_ok, session_value
from tests.cluster import MODEL, Cluster, get_json, post_json
from tests.procs import free_port
from tests.system import require_binary

REGIONS = ["us", "eu", "asia"]
ADMIN = "admin-status-page-4d9e2a7c1b8f6035"
PEER = "peer-status-page-b7e03f5a92c4d816"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
HEALTH = {"interval_s": 0.3, "fastinter_s": 0.2, "timeout_s": 0.5, "rise": 1, "fall": 2}
#: asia's closest region is eu: asia fails over there.
RTT_MS = {"us-eu": 80, "us-asia": 200, "eu-asia": 150}
#: The page's tables as {table id: {row key: {field: text}}}, read from the DOM the page drew.
READ_TABLES = """
const out = {};
for (const id of ["regions", "replicas", "forwarding", "rules", "quotas"]) {
  out[id] = {};
  for (const row of document.querySelectorAll(`#${id} tbody tr[data-key]`)) {
    const cells = {};
    for (const td of row.querySelectorAll("td[data-field]"))
      cells[td.dataset.field] = td.dataset.value ?? td.textContent;
    out[id][row.dataset.key] = cells;
  }
}
const when = document.getElementById("snapshot-time");
return {revision: document.getElementById("revision").textContent, tables: out,
        time_text: when.textContent, time_unix: when.dataset.unix || null};
"""


def _request(remote: str, cookie: str | None = None, headers: dict | None = None, name: str = ADMIN_SESSION):
    """A GET / from ``remote`` with session cookie ``name`` set to ``cookie`` (aiohttp's own request factory)."""
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (remote, 4000) if name == "peername" else default
    headers = {**(headers or {}), **({"Cookie": f"{name}={cookie}"} if cookie else {})}
    return make_mocked_request("GET", "/", headers=headers, transport=transport)


def test_session_cookie_is_bound_to_the_token_and_expires():
    """A session made with the token is accepted until it expires; another token's, another cookie's, a tampered or
    an expired one is not; the Bearer token (a reverse proxy) is accepted too."""
    now = time.time()
    good = session_value(ADMIN, ADMIN_SESSION, now)
    assert session_ok(_request("10.0.0.5", good), ADMIN, ADMIN_SESSION, now)
    assert not session_ok(_request("10.0.0.5", good), ADMIN, ADMIN_SESSION, now + SESSION_TTL_S + 1)
    assert not session_ok(_request("10.0.0.5", good), PEER, ADMIN_SESSION, now)
    assert not session_ok(_request("10.0.0.5", good, name=PEER_SESSION), ADMIN, PEER_SESSION, now)
    tampered = good[:-1] + ("0" if good[-1] != "0" else "1")
    assert not session_ok(_request("10.0.0.5", tampered), ADMIN, ADMIN_SESSION, now)
    assert not session_ok(_request("10.0.0.5", f"{int(now) + 10**6}.{good.split('.')[1]}"), ADMIN, ADMIN_SESSION, now)
    assert not session_ok(_request("10.0.0.5", "garbage"), ADMIN, ADMIN_SESSION, now)
    access = PageAccess(ADMIN, "the admin token", "controller")
    assert access.allowed(_request("10.0.0.5", good))
    assert not access.allowed(_request("127.0.0.1"))  # a token is configured: loopback logs in too
    assert access.allowed(_request("10.0.0.5", headers={"Authorization": f"Bearer {ADMIN}"}))
    assert not access.allowed(_request("10.0.0.5", headers={"Authorization": "Bearer wrong"}))


def test_a_proxys_bearer_token_is_a_throttled_guess_as_a_login_is():
    """A wrong ``Authorization: Bearer`` on the page counts on the server's throttle: after GUESS_FREE_FAILURES
    wrong ones the address is locked out and even the right token from it is not compared (not allowed), while
    another address is; once the lockout ends the right token is allowed and starts the count again."""
    from skylb.tokens import GUESS_FREE_FAILURES, GuessThrottle

    now = [0.0]
    access = PageAccess(ADMIN, "the admin token", "controller", throttle=GuessThrottle(clock=lambda: now[0]))

    def bearer(address: str, token: str) -> bool:
        return access.allowed(_request(address, headers={"Authorization": f"Bearer {token}"}))

    assert not any(bearer("10.0.0.5", "wrong") for _ in range(GUESS_FREE_FAILURES + 1))
    assert access.throttle.locked_for_s("10.0.0.5") == 1.0
    assert not bearer("10.0.0.5", ADMIN) and bearer("10.0.0.6", ADMIN)
    now[0] += 1.0
    assert bearer("10.0.0.5", ADMIN) and access.throttle.failed("10.0.0.5") == 0.0


def test_protected_mode_opens_the_page_on_this_machine_only():
    """Without a configured token the page answers loopback clients and no one else, and no cookie opens it."""
    access = PageAccess(None, "the admin token", "controller")
    assert access.allowed(_request("127.0.0.1")) and access.allowed(_request("::1"))
    assert not access.allowed(_request("10.0.0.5"))
    assert not access.allowed(_request("10.0.0.5", session_value("anything", ADMIN_SESSION, time.time())))


def test_the_wheel_ships_the_page():
    """pyproject's package data covers every file of the page (HTML, CSS, script), so an installed wheel serves it."""
    root = Path(status_page.__file__).parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["skylb"]
    static = Path(status_page.__file__).parent / "static"
    files = [p.relative_to(root / "skylb").as_posix() for p in static.iterdir()]
    assert len(files) >= 5 and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files)


@pytest.fixture
def browser(tmp_path, monkeypatch):
    """Headless Chromium from Debian through chromedriver, with the performance log (every URL it asks for);
    Selenium Manager stays offline. Quit at the end, also on failure."""
    chromium = require_binary("chromium")
    driver_path = require_binary("chromedriver")
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not download a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium'}", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    service = webdriver.ChromeService(executable_path=driver_path, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(15)
    try:
        yield driver
    finally:
        driver.quit()


def _deploy(procs, tmp_path) -> Cluster:
    """Three regions, one emulated replica each and a dead one in asia (unhealthy); a model quota on every balancer.
    Then asia's balancer is killed, so asia fails over to eu (epoch 1), and us-1 is drained, so four requests to us
    are forwarded to eu."""
    cluster = Cluster(procs, tmp_path, peer_token=PEER, admin_token=ADMIN,
                      balancer={"quotas": {"models": {MODEL: {"requests_per_minute": 600}}}},
                      controller={"health": HEALTH, "failover": {"rtt_ms": RTT_MS}})
    controller = cluster.start_controller(REGIONS)
    urls = cluster.start_emulator(3, "--time-scale", "0.05")
    for (region, url), replica_id in zip([*zip(REGIONS, urls), ("asia", f"http://127.0.0.1:{free_port()}")],
                                         ["us-1", "eu-1", "asia-1", "asia-2"]):
        status, body, _ = post_json(f"{controller}/v1/replicas", {"region": region, "url": url, "id": replica_id},
                                    headers=ADMIN_HEADERS)
        assert status == 201, body
    for region in REGIONS:
        cluster.start_balancer(region, REGIONS)
    for region in REGIONS:
        cluster.wait_replicas_healthy(region, 1, timeout_s=20)  # generous: a loaded CI machine
        cluster.wait_peers_probed(region, 2, timeout_s=20)
    next(p for p in procs.procs if p.name == "balancer-asia").kill()
    cluster.wait_until(lambda: {(a["region"], a["balancer_region"], a["epoch"]) for a in get_json(
        f"{controller}/v1/assignments")["assignments"]} >= {("asia", "eu", 1)}, timeout_s=20,
        what="asia failed over to eu")
    assert post_json(f"{controller}/v1/replicas/us-1/drain", {}, headers=ADMIN_HEADERS)[0] == 200
    cluster.wait_until(lambda: (s := cluster.status("us")) and [p["region"] for p in s["peers"]] == ["eu"]
                       and all(r["draining"] for r in s["replicas"]), timeout_s=20,
                       what="us-1 draining, eu us's only peer")
    for i in range(4):
        status, body, headers = post_json(f"{cluster.balancers['us']}/v1/completions",
                                          {"model": MODEL, "prompt": f"status page {i}", "max_tokens": 4})
        assert status == 200 and headers["X-SkyLB-Served-By"].startswith("eu/"), (status, body, headers)
    cluster.wait_until(lambda: not next(r for r in get_json(f"{controller}/v1/replicas")["replicas"]
                                        if r["id"] == "asia-2")["healthy"], timeout_s=20,
                       what="asia-2 marked unhealthy")
    return cluster


def _login(browser, url: str, token: str) -> None:
    """Open ``url``, which must answer the login form, and log in with ``token``; return once the form's page has been
    replaced (submit() only starts the navigation)."""
    browser.get(url)
    field = browser.find_element(By.ID, "token")
    field.send_keys(token)
    field.submit()
    WebDriverWait(browser, 15).until(expected_conditions.staleness_of(field))


def _wait_drawn(browser, predicate, what: str, timeout_s: float = 15.0) -> dict:
    """Poll the page every 0.2 s until it has drawn a revision and ``predicate(page)`` holds; AssertionError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = browser.execute_script(READ_TABLES)
        if page["revision"].isdigit() and predicate(page):
            return page
        assert time.monotonic() < deadline, f"the page never showed {what}; last: {page}"
        time.sleep(0.2)


def _text(value) -> str:
    return "-" if value is None else str(value)


def _controller_figures(view: dict) -> dict:
    """The figures the controller's page draws, from ``/skylb/v1/status``, in the page's text."""
    own = {b["region"]: b for b in view["balancers"]}

    def state(b: dict) -> str:
        return "up" if b["reachable"] else f"unreachable ({b['error']})"
    regions = {a["region"]: {"balancer_region": a["balancer_region"], "epoch": str(a["epoch"]),
                             "url": own[a["region"]]["url"], "state": state(own[a["region"]]),
                             "healthy": "yes" if own[a["region"]]["healthy"] else "no",
                             **{k: _text(own[a["region"]][k]) for k in ("queue_len", "in_flight",
                                                                         "available_replicas")}}
               for a in view["regions"]}
    region_of = {b["url"]: b["region"] for b in view["balancers"]}
    replicas = {r["id"]: {"region": r["region"], "engine": r["engine"], "healthy": "yes" if r["healthy"] else "no",
                          "draining": "yes" if r["draining"] else "no",
                          "available": "yes" if r["available"]
                          else (r["reason"] or ("no" if r["available"] is False else "-")),
                          **{k: _text(r[k]) for k in ("pending", "running", "outstanding")},
                          "kv_usage": None if r["kv_usage"] is None else float(r["kv_usage"]),
                          "balancer": _text(region_of.get(r["balancer"], r["balancer"]))}
                for r in view["replicas"]}
    forwarding = {f"{b['region']}>{p['region']}": {"forwarded": str(p["forwarded"]), "queue_len": str(p["queue_len"])}
                  for b in view["balancers"] for p in b["peers"]}
    rules = {f"{b['region']}>{rule}": {"placements": str(n)} for b in view["balancers"]
             for rule, n in (b["placed_by_rule"] or {}).items()}
    return {"regions": regions, "replicas": replicas, "forwarding": forwarding, "rules": rules}


def _drawn(page: dict, figures: dict) -> dict:
    """The page's tables cut to the fields ``figures`` has (a KV cache use as a number, None when not shown)."""
    def value(field: str, text: str | None):
        if field == "kv_usage" and text is not None:
            return None if text == "-" else float(text)
        return text
    return {table: {key: {f: value(f, page["tables"][table].get(key, {}).get(f)) for f in fields}
                    for key, fields in rows.items()} for table, rows in figures.items()}


def _assert_matches_status(browser, status_of, figures_of) -> dict:
    """Wait until the page draws the revision that ``status_of()`` answers, with the same rows and figures; returns
    the page."""
    seen = {}

    def same(page: dict) -> bool:
        status = status_of()
        revision = status.get("revision", status.get("membership_revision"))
        seen.update(page=page, status=status)
        figures = figures_of(status)
        return (page["revision"] == str(revision) and _drawn(page, figures) == figures
                and all(set(page["tables"][table]) == set(rows) for table, rows in figures.items()))

    try:
        page = _wait_drawn(browser, same, "the revision and figures of /skylb/v1/status")
    except AssertionError as exc:
        status = seen.get("status", {})
        raise AssertionError(f"{exc}; /skylb/v1/status: revision "
                             f"{status.get('revision', status.get('membership_revision'))}, "
                             f"figures {figures_of(status) if status else None}") from None
    unix = float(page["time_unix"])
    assert abs(unix - time.time()) < 10
    assert page["time_text"] == datetime.fromtimestamp(int(unix), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return page


def _no_token_in_any_url(browser) -> list[str]:
    urls = [browser.current_url]
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    assert not [u for u in urls if ADMIN in u or PEER in u or "token=" in u]
    return urls


def test_status_page_in_chromium_matches_the_status_of_its_revision(procs, tmp_path, browser):
    """Three regions: the controller's page asks for the admin token in a form (a wrong one is refused), then sets
    an HttpOnly, SameSite=Strict cookie and draws the revision and figures of /skylb/v1/status (asia failed over to
    eu at epoch 1, its balancer down, asia-2 unhealthy, us-1 draining, us's four forwarded requests, the quota
    buckets in use); eu's balancer page does the same with the peer token for the regions it serves; Ollama's
    clients still get "Ollama is running" at /; no URL carries a token."""
    cluster = _deploy(procs, tmp_path)
    controller = cluster.controller_url
    _login(browser, f"{controller}/", "wrong")
    assert "not the admin token" in browser.find_element(By.ID, "login-error").text
    assert browser.get_cookie(ADMIN_SESSION) is None
    _login(browser, f"{controller}/", ADMIN)
    cookie = browser.get_cookie(ADMIN_SESSION)
    assert cookie and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    page = _assert_matches_status(browser, lambda: get_json(f"{controller}/skylb/v1/status", headers=ADMIN_HEADERS),
                                  _controller_figures)
    tables = page["tables"]
    assert tables["replicas"]["asia-2"]["healthy"] == "no" and tables["replicas"]["us-1"]["draining"] == "yes"
    assert tables["regions"]["asia"]["balancer_region"] == "eu" and tables["regions"]["asia"]["epoch"] == "1"
    assert tables["regions"]["asia"]["healthy"] == "no" and tables["regions"]["asia"]["state"].startswith("unreach")
    assert tables["forwarding"]["us>eu"]["forwarded"] == "4"
    assert sum(int(row["placements"]) for key, row in tables["rules"].items() if key.startswith("us>")) >= 4
    assert set(tables["forwarding"]) == {"us>eu", "eu>us"}  # asia's balancer is down
    assert {row["bucket"] for row in tables["quotas"].values()} - {"(no bucket in use)"}

    eu = cluster.balancers["eu"]
    _login(browser, f"{eu}/", PEER)
    page = _assert_matches_status(browser, lambda: cluster.status("eu"), lambda s: {
        "replicas": {r["id"]: {"pending": _text(r["pending"]), "running": _text(r["running"]),
                               "healthy": "yes" if r["healthy"] else "no"} for r in s["replicas"]},
        "regions": {region: {"epoch": str(epoch), "queue_len": str(s["queue_len"]) if region == "eu" else "-"}
                    for region, epoch in s["served_regions"].items()}})
    assert {"eu-1", "asia-1"} <= set(page["tables"]["replicas"]) and set(page["tables"]["regions"]) == {"eu", "asia"}
    assert browser.get_cookie(ADMIN_SESSION) and browser.get_cookie(PEER_SESSION)["httpOnly"]  # one host, both
    browser.find_element(By.CSS_SELECTOR, "header form button").click()  # log out: the form again
    # The click only starts the form's navigation: wait for the login form rather than read the old page.
    WebDriverWait(browser, 15).until(expected_conditions.presence_of_element_located((By.ID, "token")))
    assert browser.get_cookie(PEER_SESSION) is None
    with urllib.request.urlopen(f"{eu}/", timeout=5) as resp:
        assert resp.read() == b"Ollama is running"
    _no_token_in_any_url(browser)


def test_a_static_balancers_page_names_its_region_on_each_replica(procs, tmp_path, browser):
    """A balancer started with --replica serves its one region: its page shows that region on every replica row
    (it showed "-": a balancer's status does not name a replica's region)."""
    cluster = Cluster(procs, tmp_path, peer_token=PEER)
    replicas = cluster.start_emulator(2, "--time-scale", "0.1")
    cluster.start_static_balancer(replicas)
    status = cluster.status("local")
    _login(browser, f"{cluster.balancers['local']}/", PEER)
    read = """const out = {};
for (const row of document.querySelectorAll("#replicas tbody tr[data-key]"))
  out[row.dataset.key] = row.querySelector('td[data-field="region"]')?.textContent;
return out;"""
    deadline = time.monotonic() + 15
    while len(rows := browser.execute_script(read)) < 2:
        assert time.monotonic() < deadline, f"the page never drew both replicas: {rows}"
        time.sleep(0.2)
    assert rows == {r["id"]: status["region"] for r in status["replicas"]}


def test_a_static_balancers_page_offers_log_out_to_a_session_only_and_answers_the_favicon(procs, tmp_path):
    """A balancer started with --replica: /favicon.ico is 204 with no request log line; the page has no Log out for
    a reverse proxy's Bearer token (no session) and has one after a login; its status says the membership is static
    (no controller revision), which the page shows instead of "membership revision null"."""
    cluster = Cluster(procs, tmp_path, peer_token=PEER)
    [replica] = cluster.start_emulator(1, "--time-scale", "0.1")
    balancer = cluster.start_static_balancer([replica])
    url = cluster.balancers["local"]
    icon = requests.get(f"{url}/favicon.ico", timeout=5)
    assert icon.status_code == 204 and not icon.content
    html = {"Accept": "text/html"}
    page = requests.get(f"{url}/", headers={**html, "Authorization": f"Bearer {PEER}"}, timeout=5)
    assert page.status_code == 200 and 'id="revision"' in page.text and "Log out" not in page.text
    with requests.Session() as browser:
        assert browser.post(f"{url}/skylb/login", data={"token": PEER}, allow_redirects=False,
                            timeout=5).status_code == 303
        page = browser.get(f"{url}/", headers=html, timeout=5)
        assert page.status_code == 200 and "Log out" in page.text
    status = cluster.status("local")
    assert status["static_membership"] is True and status["membership_revision"] is None
    assert "favicon" not in balancer.log()
