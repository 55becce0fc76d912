"""The controller crashes mid-traffic (issue 9 acceptance, with real processes): `kill -9` it, balancers keep
serving on the membership they hold (static stability), no request is lost, and the restarted controller has the
same membership and revision from its store, and balancers follow it again."""

from __future__ import annotations

import time

from tests.cluster import Cluster, get_json
from tests.test_failover import _Load

HEALTH = {"interval_s": 0.5, "fastinter_s": 0.2, "timeout_s": 0.5, "rise": 2, "fall": 3}


def _membership(url: str) -> dict:
    m = get_json(f"{url}/v1/membership")
    for b in m["balancers"]:
        b.pop("last_seen")  # heartbeats move it; everything else must be the same
    return m


def test_kill_9_the_controller_mid_traffic(procs, tmp_path):
    cluster = Cluster(procs, tmp_path, controller={"health": HEALTH})
    url = cluster.start_controller(["us", "eu"])
    port = int(url.rsplit(":", 1)[1])
    for region in ("us", "eu"):
        urls = cluster.start_emulator(2, "--time-scale", "0.05", name=f"emulator-{region}")
        for i, replica_url in enumerate(urls):
            cluster.add_replica(region, replica_url, replica_id=f"{region}-{i + 1}")
        cluster.start_balancer(region, ["us", "eu"])
    for region in ("us", "eu"):
        cluster.wait_replicas_healthy(region, 2)
    before = _membership(url)

    with _Load(list(cluster.balancers.values())) as load:
        time.sleep(0.5)
        next(p for p in procs.procs if p.name == f"controller-{port}").kill()
        time.sleep(2.0)  # balancers serve on without a controller
        served_without = len(load.statuses)
        cluster.wait_until(lambda: not cluster.status("us")["controller_reachable"], timeout_s=10,
                           what="us's balancer noticing the controller is gone")
        cluster.start_controller(["us", "eu"], port=port)
        assert _membership(url) == before  # same replicas, balancers, health, assignments and revision
        cluster.wait_until(lambda: cluster.status("us")["controller_reachable"], timeout_s=15,
                           what="us's balancer following the restarted controller")
        # The restarted controller works: a replica added now reaches the balancer.
        (extra,) = cluster.start_emulator(1, "--time-scale", "0.05", name="emulator-us-extra")
        cluster.add_replica("us", extra, replica_id="us-3")
        cluster.wait_replicas_healthy("us", 3)
        time.sleep(0.5)
    assert served_without > 0 and load.statuses and set(load.statuses) == {200}, load.statuses
    print(f"\n{len(load.statuses)} requests across the crash and restart, all 200 "
          f"({served_without} answered by the time the controller had been dead 2 s)")
