"""A screenshot of the status page (README, "Status page"): the local three-region deployment (bench/launch/local.py) with
two emulated replicas per region, a model quota set through the controller, us loaded past its replicas so that
requests are forwarded, and the controller's page opened in headless Chromium (Debian's ``chromium`` and
``chromedriver``, driven by Selenium; nothing is downloaded), logged in through its form with the run's admin
token, saved as a PNG.

Run it with ``skylb bench status_page [--out docs/status-page.png]`` (or ``python -m bench.live.status_page``); about a
minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.launch.local import Deployment
from skylb.config import default_config_path, load_config

__all__ = ["build_parser", "take_screenshot", "main"]

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "status-page.png"


def _post(url: str, body: dict, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return resp.status
    except OSError:
        return 0


def _load(url: str, model: str, stop: threading.Event, clients: int = 96, limit: int = 2000) -> None:
    """``clients`` closed-loop clients sending completions to ``url`` until ``stop`` (at most ``limit`` in all)."""
    count = iter(range(limit))

    def client() -> None:
        while not stop.is_set() and next(count, None) is not None:
            _post(f"{url}/v1/completions", {"model": model, "prompt": f"status page {time.time()}",
                                            "max_tokens": 60}, {})
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)


def _browser(width: int, height: int):
    from selenium import webdriver
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not download a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                f"--window-size={width},{height}", "--no-first-run"):
        options.add_argument(arg)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    return webdriver.Chrome(service=service, options=options)


def take_screenshot(out: Path, *, settle_s: float = 8.0, width: int = 1500, height: int = 1100) -> Path:
    """Run the deployment, load it, and save the controller's status page to ``out`` (PNG); returns ``out``.
    Raises RuntimeError when the deployment does not start."""
    from selenium.webdriver.common.by import By
    cfg = load_config(default_config_path())
    data = cfg.model_dump()
    data["regions"] = {r: {**v, "replicas": 2} for r, v in data["regions"].items()}
    cfg = type(cfg).model_validate(data)
    with tempfile.TemporaryDirectory(prefix="skylb-status-page-") as run_dir:
        deployment = Deployment(cfg, Path(run_dir))
        stop = threading.Event()
        try:
            deployment.start()
            admin = {"Authorization": f"Bearer {deployment.admin_token}"}
            model = deployment.emulator.model
            _post(f"{deployment.controller_url}/v1/quotas", {"model": model, "requests_per_minute": 6000}, admin)
            load = threading.Thread(target=_load, args=(deployment.balancer_urls["us"], model, stop), daemon=True)
            load.start()
            driver = _browser(width, height)
            try:
                driver.get(f"{deployment.controller_url}/")
                field = driver.find_element(By.ID, "token")
                field.send_keys(deployment.admin_token)
                field.submit()
                time.sleep(settle_s)  # a few polls: the forwarding rates need two snapshots
                # The whole page, however many tables it has now: the window grows to the document's height.
                full = driver.execute_script("return document.documentElement.scrollHeight")
                if full > height:
                    driver.set_window_size(width, full + (height - driver.execute_script(
                        "return window.innerHeight")))
                    time.sleep(0.5)
                out.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(out))
            finally:
                driver.quit()
        finally:
            stop.set()
            deployment.stop()
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of `skylb bench status_page`."""
    parser = argparse.ArgumentParser(prog="skylb bench status_page", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"PNG to write (default {DEFAULT_OUT})")
    parser.add_argument("--settle-s", type=float, default=8.0,
                        help="seconds of load before the screenshot (default 8)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Take the screenshot; 0 on success, 1 when the deployment or the browser failed (the reason is printed)."""
    args = build_parser().parse_args(argv)
    try:
        print(take_screenshot(args.out, settle_s=args.settle_s))
    except (RuntimeError, OSError) as exc:
        print(f"status page screenshot failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
