"""skylb.config: a deployment file is checked whole at load, regional overrides included, and merged deeply."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from skylb.config import (BalancerOverrides, ConfigError, DeploymentConfig, balancer_environment, balancer_settings,
                          load_config)
from skylb.environment import BALANCER_VARIABLES, CONTROLLER_VARIABLES


def write(tmp_path: Path, text: str) -> Path:
    """``text`` as a YAML file under ``tmp_path``."""
    path = tmp_path / "deployment.yaml"
    path.write_text(text)
    return path


def test_a_typo_in_a_regions_balancer_is_rejected_at_load_with_its_path(tmp_path):
    """A misspelt key in ``regions.us.balancer`` fails load_config, naming the key's full path."""
    path = write(tmp_path, "regions:\n  us:\n    balancer:\n      queue_timout_s: 5\n  eu: {}\n")
    with pytest.raises(ConfigError, match=r"regions\.us\.balancer\.queue_timout_s: Extra inputs are not permitted"):
        load_config(path)


@pytest.mark.parametrize(("override", "where"), [
    ("retry_policy: {num_retris: 1}", "regions.us.balancer.retry_policy.num_retris"),
    ("priorities: {enabeld: true}", "regions.us.balancer.priorities.enabeld"),
    ("port: -1", "regions.us.balancer.port"),
    ("retry_policy: {base_interval_ms: 900}", "regions.us.balancer.retry_policy"),
    ("policy: skylb-fast", "regions.us.balancer.policy"),
    ("policies: {skylb: {match_treshold: 0.5}}", "regions.us.balancer.policies"),
])
def test_nested_keys_values_and_rules_of_an_override_are_checked_at_load(tmp_path, override, where):
    """Nested typos, out-of-range values, rules across fields and unknown policies in an override fail at load."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, f"regions:\n  us:\n    balancer: {{{override}}}\n"))
    assert where in str(err.value)


def test_balancer_and_controller_refuse_the_typo_alike(tmp_path):
    """`skylb balancer` (any region) and `skylb controller` exit 2 on the same file, naming the key."""
    path = write(tmp_path, "regions:\n  us:\n    balancer: {queue_timout_s: 5}\n  eu: {}\n")
    for args in (["balancer", "--region", "eu"], ["controller"]):
        out = subprocess.run([sys.executable, "-m", "skylb", *args, "--config", str(path)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and "regions.us.balancer.queue_timout_s" in out.stderr, (args, out.stderr)


def test_regional_override_merges_deeply(tmp_path):
    """A region's ``retry_policy: {num_retries: 1}`` keeps the shared ``budget_percent: 50``; other regions keep
    the shared section whole; mappings merge key by key, lists are replaced."""
    cfg = load_config(write(tmp_path, """
balancer:
  retry_policy: {budget_percent: 50}
  peer_urls: {eu: "http://proxy:1"}
  api_keys: [a, b]
regions:
  us:
    balancer:
      retry_policy: {num_retries: 1}
      peer_urls: {asia: "http://proxy:2"}
      api_keys: [c]
  eu: {}
"""))
    us, eu = cfg.balancer_for("us"), cfg.balancer_for("eu")
    assert (us.retry_policy.num_retries, us.retry_policy.budget_percent) == (1, 50.0)
    assert (eu.retry_policy.num_retries, eu.retry_policy.budget_percent) == (2, 50.0)
    assert us.peer_urls == {"eu": "http://proxy:1", "asia": "http://proxy:2"}
    assert us.api_keys == ["c"] and eu.api_keys == ["a", "b"]


def test_an_override_holds_only_the_keys_given():
    """A parsed override dumps only the keys the file set (renamed keys renamed), so unset ones never replace
    shared values, and a config written back from a loaded one loads the same."""
    override = BalancerOverrides.model_validate({"tau": 3, "retry_policy": {"num_retries": 0},
                                                 "read_timeout_s": 9, "advertise_url": None})
    assert override.model_dump() == {"tau": 3, "retry_policy": {"num_retries": 0}, "idle_timeout_s": 9,
                                     "advertise_url": None}
    cfg = DeploymentConfig.model_validate({"balancer": {"tau": 5}, "regions": {"us": {"balancer": override}}})
    again = DeploymentConfig.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump())))
    assert again.balancer_for("us") == cfg.balancer_for("us")


def test_environment_overrides_come_from_one_table():
    """balancer_environment reads the balancer's variables (empty ones count as unset) into a partial section."""
    environ = {"SKYLB_PEER_TOKEN": "peer-1", "SKYLB_METRICS_TOKEN": "", "SKYLB_REDIS_URL": "redis://r:6379/0",
               "SKYLB_REPLICA_API_KEY": " key ", "UNRELATED": "x"}
    assert balancer_environment(environ) == {"peer_token": "peer-1", "replica_api_key": "key",
                                             "quota": {"redis_url": "redis://r:6379/0"}}


def test_settings_layers_file_region_environment_flags(tmp_path):
    """A balancer's settings: the shared section, the region's overrides, the environment, then the flags."""
    cfg = load_config(write(tmp_path, """
balancer: {peer_token: from-file, port: 1000, quota: {wait_s: 3}}
regions: {us: {balancer: {port: 2000}}}
"""))
    settings = balancer_settings(cfg, "us", {"port": None, "policy": "least-load"},
                                 environ={"SKYLB_PEER_TOKEN": "from-env", "SKYLB_REDIS_URL": "redis://r"})
    assert (settings.port, settings.policy, settings.peer_token) == (2000, "least-load", "from-env")
    assert (settings.quota.redis_url, settings.quota.wait_s) == ("redis://r", 3)


@pytest.mark.parametrize(("command", "variables"), [
    ("balancer", BALANCER_VARIABLES), ("controller", CONTROLLER_VARIABLES)])
def test_help_lists_the_environment_variables(command, variables):
    """`skylb balancer --help` and `skylb controller --help` name every variable the process reads, and
    --log-level."""
    out = subprocess.run([sys.executable, "-m", "skylb", command, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--log-level" in out.stdout
    for var in variables:
        assert f"${var.name}:" in out.stdout


def test_the_demos_sections_are_checked_by_the_demo_not_the_product(tmp_path):
    """``emulator`` and ``latency`` belong to the demo: load_config keeps them as given, bench.launch.settings refuses a
    typo in them naming the file and the key."""
    from bench.launch.settings import emulator_settings, latency_settings

    path = write(tmp_path, "emulator: {engin: vllm}\nlatency: {rtt_ms: {us-eu: 9}}\n")
    cfg = load_config(path)
    assert latency_settings(cfg).rtt("eu", "us") == 9
    with pytest.raises(ConfigError, match=r"config .*: emulator\.engin: Extra inputs are not permitted"):
        emulator_settings(cfg, source=path)
