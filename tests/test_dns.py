"""DNS as users run it (issue 9, item 6): the real BIND 9 with one view per region, RFC 2136 updates signed with
TSIG through controller/dns.py (settings: skylb/dns_settings.py), and clients that resolve from their region's source address."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
from pathlib import Path

import aiohttp
import dns.message
import dns.query
import dns.rcode
import dns.update
import pytest
from aiohttp import web

from controller.dns import DnsUpdateError, DnsUpdater, address_of, record_for
from skylb.dns_settings import DnsConfig, read_key_file
from bench.dns.bind import BindError, BindServer, balancer_address, client_address
from bench.dns.resolver import SourceResolver, region_connector
from tests.procs import free_port
from tests.system import require_binary

pytestmark = pytest.mark.timeout(60)

REGIONS = ("us", "eu", "asia")
BALANCERS = {r: balancer_address(i) for i, r in enumerate(REGIONS)}  # 127.0.0.11, .12, .13
CLIENTS = {r: client_address(i) for i, r in enumerate(REGIONS)}  # 127.0.11.1, 127.0.12.1, 127.0.13.1
TTL_S = 3


@pytest.fixture
def bind(procs, tmp_path):
    """The real named on 127.0.0.1 (a free port) with a view per region; stopped at teardown, also on failure."""
    server = BindServer(tmp_path / "named", BALANCERS, port=free_port(), ttl_s=TTL_S,
                        named=require_binary("named"))
    try:
        server.start(procs=procs)
        yield server
    finally:
        server.stop()


def _resolve(bind: BindServer, source: str, rdtype: str = "A") -> tuple[list[str], int | None]:
    """What a client asking from ``source`` gets for the service name: (records' data, TTL)."""
    response = dns.query.udp(dns.message.make_query(bind.name, rdtype), bind.host, port=bind.port,
                             source=source, timeout=2)
    assert response.rcode() == dns.rcode.NOERROR
    rrsets = [r for r in response.answer if r.name.to_text() == bind.name]
    return sorted(r.to_text() for rrset in rrsets for r in rrset), (rrsets[0].ttl if rrsets else None)


def _answers(bind: BindServer) -> dict[str, list[str]]:
    return {region: _resolve(bind, source)[0] for region, source in CLIENTS.items()}


def test_each_region_resolves_its_own_balancer(bind):
    """A client from region R's source address gets R's balancer with the configured TTL; any other address gets
    the default view (the first region's answer)."""
    for region, source in CLIENTS.items():
        assert _resolve(bind, source) == ([BALANCERS[region]], TTL_S)
    assert _resolve(bind, "127.0.0.1")[0] == _resolve(bind, "127.0.99.1")[0] == [BALANCERS["us"]]


async def test_point_moves_one_region_and_back(bind):
    """point("us", eu's balancer): us clients (and the default view, which is us's zone) get 127.0.0.12, eu and
    asia clients are unchanged; pointing back restores every answer; current() reads each view."""
    updater = DnsUpdater(bind.dns_config())
    assert {r: await updater.current(r) for r in REGIONS} == BALANCERS
    await updater.point("us", "127.0.0.12")
    assert _answers(bind) == {"us": ["127.0.0.12"], "eu": ["127.0.0.12"], "asia": ["127.0.0.13"]}
    assert _resolve(bind, "127.0.0.1")[0] == ["127.0.0.12"]
    assert _resolve(bind, CLIENTS["us"])[1] == TTL_S
    assert await updater.current("us") == "127.0.0.12"
    await updater.point("us", address_of("http://127.0.0.11:8080"))
    assert _answers(bind) == {r: [a] for r, a in BALANCERS.items()}


async def test_point_writes_the_record_type_of_the_address(bind):
    """An IPv6 literal becomes AAAA and a hostname a CNAME, each replacing whatever the name had; back to A."""
    updater = DnsUpdater(bind.dns_config())
    await updater.point("eu", "::1")
    assert _resolve(bind, CLIENTS["eu"], "AAAA")[0] == ["::1"] and _resolve(bind, CLIENTS["eu"], "A")[0] == []
    assert await updater.current("eu") == "::1"
    await updater.point("eu", "lb.eu.example.com")
    assert _resolve(bind, CLIENTS["eu"], "A")[0] == ["lb.eu.example.com."]  # the CNAME, nothing next to it
    assert _resolve(bind, CLIENTS["eu"], "AAAA")[0] == ["lb.eu.example.com."]
    assert await updater.current("eu") == "lb.eu.example.com"
    await updater.point("eu", "127.0.0.12")
    assert _resolve(bind, CLIENTS["eu"], "A") == (["127.0.0.12"], TTL_S)
    assert _resolve(bind, CLIENTS["eu"], "AAAA")[0] == []


async def test_wrongly_signed_or_unsigned_update_is_refused(bind):
    """A wrong secret (BADSIG) or an unknown key (BADKEY) is refused with DnsUpdateError, rcode NOTAUTH; an
    unsigned update from a region's own clients is REFUSED; no answer changes."""
    config = bind.dns_config()
    wrong_secret = config.model_copy(deep=True)
    wrong_secret.keys["us"].secret = base64.b64encode(b"not the secret".ljust(32)).decode()
    with pytest.raises(DnsUpdateError, match="NOTAUTH, TSIG BADSIG") as err:
        await DnsUpdater(wrong_secret).point("us", "127.0.0.13")
    assert err.value.rcode == "NOTAUTH" and err.value.region == "us"
    unknown = config.model_copy(deep=True)
    unknown.keys["us"].name = "skylb-nobody"
    with pytest.raises(DnsUpdateError, match="NOTAUTH, TSIG BADKEY"):
        await DnsUpdater(unknown).point("us", "127.0.0.13")
    update = dns.update.UpdateMessage(bind.zone)
    update.replace(bind.name, TTL_S, "A", "127.0.0.13")
    response = dns.query.tcp(update, bind.host, port=bind.port, source=CLIENTS["us"], timeout=2)
    assert response.rcode() == dns.rcode.REFUSED
    with pytest.raises(DnsUpdateError, match="no TSIG key for region 'mars'"):
        await DnsUpdater(config).point("mars", "127.0.0.13")
    assert _answers(bind) == {r: [a] for r, a in BALANCERS.items()}


async def test_the_key_not_the_address_selects_the_view(bind):
    """An update signed with eu's key sent from us clients' address lands in eu's view (the ``!key`` entries keep
    it out of us's view, which matches that address): only eu's answer changes."""
    update = dns.update.UpdateMessage(bind.zone, keyring=bind.keys["eu"].tsig())
    update.replace(bind.name, TTL_S, "A", "127.0.0.99")
    response = dns.query.tcp(update, bind.host, port=bind.port, source=CLIENTS["us"], timeout=2)
    assert response.rcode() == dns.rcode.NOERROR
    assert _answers(bind) == {"us": ["127.0.0.11"], "eu": ["127.0.0.99"], "asia": ["127.0.0.13"]}


async def test_keys_by_name_from_the_bind_key_file(bind):
    """A DnsConfig naming its keys only reads their secrets from the BIND key file named also includes."""
    config = bind.dns_config(inline_secrets=False)
    assert all(k.secret is None for k in config.keys.values()) and config.key_file
    updater = DnsUpdater(config)
    await updater.point("asia", "127.0.0.11")
    assert await updater.current("asia") == "127.0.0.11" and _resolve(bind, CLIENTS["asia"])[0] == ["127.0.0.11"]


async def test_region_clients_connect_through_the_name(bind):
    """A region's aiohttp connector resolves the service name in its view and connects from its own address: a
    server on us's balancer address sees the request from 127.0.11.1; after point("us", ...) a new resolver
    follows the change."""
    port = free_port()
    runners = []
    for region, address in BALANCERS.items():
        async def whoami(request: web.Request, region: str = region) -> web.Response:
            return web.json_response({"region": region, "remote": request.remote})

        app = web.Application()
        app.router.add_get("/", whoami)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, address, port).start()
        runners.append(runner)
    try:
        seen = {}
        for region, source in CLIENTS.items():
            async with aiohttp.ClientSession(connector=region_connector(bind.host, bind.port, source)) as session:
                async with session.get(f"http://{bind.name.rstrip('.')}:{port}/",
                                       timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    seen[region] = await resp.json()
        assert seen == {r: {"region": r, "remote": CLIENTS[r]} for r in REGIONS}
        await DnsUpdater(bind.dns_config()).point("us", BALANCERS["asia"])
        resolver = SourceResolver(bind.host, bind.port, source=CLIENTS["us"])
        assert [r["host"] for r in await resolver.resolve(bind.name, port)] == [BALANCERS["asia"]]
        assert [r["host"] for r in await resolver.resolve("127.0.0.5", port)] == ["127.0.0.5"]
        with pytest.raises(OSError, match="no A record"):
            await resolver.resolve(f"nothing.{bind.zone}", port)
    finally:
        for runner in runners:
            await runner.cleanup()


def test_named_that_exits_is_reported_with_its_log(tmp_path):
    """A named that exits at once (here: a config it rejects) fails start() with BindError and its log's tail."""
    named = require_binary("named")
    server = BindServer(tmp_path / "named", BALANCERS, port=free_port(), named=named)
    server.write_config()
    server._conf_text = lambda: "options { this is not bind syntax; };\n"  # what write_config writes next
    try:
        with pytest.raises(BindError, match=r"named exited with \d+(.|\n)*--- named log ---(.|\n)*named.conf"):
            server.start(timeout_s=10)
    finally:
        server.stop()


def test_named_accepts_the_generated_config(tmp_path):
    """named-checkconf and named-checkzone accept the files BindServer writes."""
    server = BindServer(tmp_path / "named", BALANCERS, port=53000)
    server.write_config()
    checkconf, checkzone = require_binary("named-checkconf"), require_binary("named-checkzone")
    assert subprocess.run([checkconf, str(server.conf_path)], capture_output=True).returncode == 0
    for region in REGIONS:
        out = subprocess.run([checkzone, server.zone, str(server.zone_path(region))], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    assert (server.key_file.stat().st_mode & 0o777) == 0o600
    assert set(read_key_file(server.key_file)) == {"skylb-us", "skylb-eu", "skylb-asia"}


def test_read_key_file_keeps_secrets_that_look_like_comments(tmp_path):
    """A base64 secret may hold "//" (about one key in 90 does): only comments outside quotes are dropped, in all three
    named.conf styles. CI once failed when a random secret held "//" and the reader cut it as a comment."""
    path = tmp_path / "keys.conf"
    path.write_text('# hash comment\n/* block\n comment */ key "a" { algorithm hmac-sha256; secret "ab//cd+/=="; };\n'
                    'key "b." { secret "x#y//z"; }; // trailing comment\n')
    keys = read_key_file(path)
    assert {name: k.secret for name, k in keys.items()} == {"a": "ab//cd+/==", "b": "x#y//z"}
    assert keys["b"].algorithm == "hmac-sha256"


def test_address_of_and_record_types():
    """address_of takes the host of a balancer URL; record_for maps IPv4 -> A, IPv6 -> AAAA, a name -> CNAME."""
    assert address_of("http://127.0.0.12:8080") == "127.0.0.12"
    assert address_of("http://[::1]:80/v1") == "::1"
    assert address_of("https://lb.eu.example.com/") == "lb.eu.example.com"
    assert address_of("127.0.0.13:9000") == "127.0.0.13"
    with pytest.raises(ValueError):
        address_of("http://:80")
    assert record_for("127.0.0.12") == ("A", "127.0.0.12")
    assert record_for("2001:db8:0::1") == ("AAAA", "2001:db8::1")
    assert record_for("lb.eu.example.com") == ("CNAME", "lb.eu.example.com.")


def test_dns_config_validation(tmp_path):
    """DnsConfig makes names absolute, wants the name inside the zone, the server as an IP address, and a secret
    for every key unless a key file (tsig-keygen's format) gives it."""
    cfg = DnsConfig(zone="skylb.test", name="llm.skylb.test", keys={"us": {"name": "k", "secret": "c2VjcmV0"}})
    assert (cfg.zone, cfg.name, cfg.ttl_s, cfg.keys["us"].algorithm) == ("skylb.test.", "llm.skylb.test.", 5,
                                                                         "hmac-sha256")
    for bad in ({"name": "llm.other.test."}, {"server": "ns.example.com"}, {"keys": {"us": {"name": "k"}}},
                {"keys": {"us": {"name": "k", "secret": "x", "algorithm": "rot13"}}}, {"ttl": 5}):
        with pytest.raises(ValueError):
            DnsConfig(**bad)
    key_file = tmp_path / "keys.conf"
    key_file.write_text('# made by tsig-keygen\nkey "k" {\n\talgorithm hmac-sha512;\n\tsecret "c2VjcmV0";\n};\n')
    cfg = DnsConfig(keys={"us": {"name": "k"}, "eu": {"name": "missing"}}, key_file=str(key_file))
    with pytest.raises(ValueError, match="key missing of region eu is not in"):
        cfg.resolved_keys()
    cfg.keys.pop("eu")
    assert cfg.resolved_keys()["us"].model_dump() == {"name": "k", "secret": "c2VjcmV0", "algorithm": "hmac-sha512"}


def test_addressing_plan():
    """Region i's balancer is 127.0.0.(11+i) and its clients 127.0.(11+i).1, all on the loopback interface."""
    assert [balancer_address(i) for i in range(3)] == ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
    assert [client_address(i) for i in range(3)] == ["127.0.11.1", "127.0.12.1", "127.0.13.1"]
    for i in range(3):  # bindable without any set-up: Linux routes all of 127.0.0.0/8 to lo
        with socket.socket() as s:
            s.bind((client_address(i), 0))
    with pytest.raises(ValueError):
        balancer_address(244)


def test_route53_change_batch_has_one_latency_record_per_region_with_a_health_check():
    """deploy/route53/change-batch.json parses and has, for one name, one latency record per region (us, eu,
    asia), each with its own set identifier, AWS region and health check; main.tf does the same per balancer."""
    root = Path(__file__).resolve().parents[1] / "deploy" / "route53"
    batch = json.loads((root / "change-batch.json").read_text())
    records = [c["ResourceRecordSet"] for c in batch["Changes"]]
    assert all(c["Action"] == "UPSERT" for c in batch["Changes"])
    assert {r["SetIdentifier"] for r in records} == {f"skylb-{r}" for r in REGIONS}
    assert len({r["Name"] for r in records}) == 1 and all(r["Type"] == "A" and r["TTL"] == 5 for r in records)
    assert len({r["Region"] for r in records}) == len({r["HealthCheckId"] for r in records}) == len(REGIONS)
    assert all(len(r["ResourceRecords"]) == 1 for r in records)
    main_tf = (root / "main.tf").read_text()
    for needed in ('resource "aws_route53_health_check"', 'resource_path     = "/healthz"', "set_identifier",
                   "latency_routing_policy", "health_check_id = aws_route53_health_check.balancer[each.key].id"):
        assert needed in main_tf


async def test_unreachable_server_is_a_dns_update_error():
    """Nothing listening at the server's port: point() and current() raise DnsUpdateError (rcode None) within
    the timeout."""
    config = DnsConfig(port=free_port(), timeout_s=2, keys={"us": {"name": "k", "secret": "c2VjcmV0"}})
    updater = DnsUpdater(config)
    for call in (updater.point("us", "127.0.0.11"), updater.current("us")):
        with pytest.raises(DnsUpdateError, match="failed") as err:
            await call
        assert err.value.rcode is None
