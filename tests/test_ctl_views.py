"""controller/ctl_views.py: `skylb-ctl status` built from the membership and the balancers' statuses, no process."""

from __future__ import annotations

from controller.ctl_views import status_tables, system_status

MEMBERSHIP = {"revision": 7, "assignments": [{"region": "us", "balancer_region": "us", "epoch": 0}],
              "balancers": [{"region": "us", "url": "http://us.lb"}, {"region": "eu", "url": "http://eu.lb"}],
              "replicas": [{"id": "us-1", "region": "us", "engine": "vllm", "url": "http://r1"}]}


def test_status_lists_each_balancers_placements_by_rule_most_first():
    """A balancer's ``placed_by_rule`` goes into the view and, most placements first, into a table of its own; a
    balancer that did not answer has none (None, no rows), and with no placements anywhere there is no table."""
    statuses = {"http://us.lb": ({"queue_len": 0, "peers": [], "replicas": [{"id": "us-1", "pending": 0}],
                                  "placed_by_rule": {"estimated_ttft": 40, "prefer_peer, push_to_holder": 3,
                                                     "push_to_holder": 12}}, None),
                "http://eu.lb": (None, "timed out")}
    view = system_status(MEMBERSHIP, statuses)
    assert [b["placed_by_rule"] for b in view["balancers"]] == [statuses["http://us.lb"][0]["placed_by_rule"], None]
    lines = status_tables(view).splitlines()
    header = lines.index(next(line for line in lines if line.startswith("REGION") and "RULE" in line))
    rows = [line.split() for line in lines[header + 2:]]
    assert rows == [["us", "estimated_ttft", "40"], ["us", "push_to_holder", "12"],
                    ["us", "prefer_peer,", "push_to_holder", "3"]]
    quiet = {"http://us.lb": ({"queue_len": 0, "peers": [], "replicas": [], "placed_by_rule": {}}, None)}
    assert "RULE" not in status_tables(system_status(MEMBERSHIP, quiet))
