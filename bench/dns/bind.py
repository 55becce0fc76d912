"""BIND 9 for a SkyLB deployment: one zone, one view per region, each answering with that region's balancer.

:class:`BindServer` writes a named.conf, one zone file per view and a TSIG key file into a directory it is given,
and runs ``named -g`` (foreground, as the current user; pid file, session key, managed keys and journals all in
that directory) on a loopback address and port.

Views. The service name (``llm.skylb.test.`` in zone ``skylb.test.`` by default) has, in each view, an A record per
balancer of that region (one, unless the region runs several), with a short TTL (5 s). View R matches::

    match-clients { key "skylb-R"; !key "skylb-<other>"; ...; <R's client prefix>; };

so a query or RFC 2136 update signed with R's TSIG key lands in view R from any address (this is how the
controller, controller/dns.py, updates one view), a request signed with another region's key never does, and an
unsigned query lands in view R when it comes from R's clients. Each view's zone is its own file with ``allow-update
{ key "skylb-R"; }``. A last view, ``default``, answers every other client with the first region's zone
(``in-view``: the same zone, not a copy, so it follows the first region's updates).

Addressing on one machine (all inside 127.0.0.0/8, which Linux routes to the loopback interface without any
set-up): the i-th region (0-based, in config order) has

- its balancer on 127.0.0.(11+i), all regions on one port (:func:`balancer_address`),
- its clients on source address 127.0.(11+i).1, the view matching 127.0.(11+i).0/24 (:func:`client_address`,
  :func:`client_prefix`),

and named listens on 127.0.0.1 (a source address in no region's prefix, so it sees the default view unless a
request is signed). So us/eu/asia clients come from 127.0.11.1/127.0.12.1/127.0.13.1 and reach the balancers on
127.0.0.11/.12/.13.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.exception
import dns.message
import dns.name
import dns.query
import dns.rcode

from bench.launch.procs import Proc, ProcGroup
from skylb.dns_settings import DnsConfig, TsigKey

__all__ = ["BindServer", "BindError", "balancer_address", "client_address", "client_prefix", "new_tsig_key",
           "START_TIMEOUT_S", "MAX_REGIONS"]

#: How long :meth:`BindServer.start` waits for named to answer in every view (s).
START_TIMEOUT_S = 10.0
#: Regions the loopback addressing has room for (127.0.0.11 .. 127.0.0.254).
MAX_REGIONS = 244


def balancer_address(index: int, sibling: int = 0) -> str:
    """The loopback address of the ``index``-th region's balancer (0-based): 127.0.0.(11+index); its ``sibling``-th
    (0-based) when the region runs several: 127.0.(sibling).(11+index)."""
    _check_index(index)
    if not 0 <= sibling < 11:  # 127.0.11.0/24 and up are the clients' prefixes
        raise ValueError(f"sibling index {sibling} outside 0..10")
    return f"127.0.{sibling}.{11 + index}"


def client_prefix(index: int) -> str:
    """The source prefix of the ``index``-th region's clients, which its view matches: 127.0.(11+index).0/24."""
    _check_index(index)
    return f"127.0.{11 + index}.0/24"


def client_address(index: int) -> str:
    """The source address the ``index``-th region's clients bind: 127.0.(11+index).1."""
    _check_index(index)
    return f"127.0.{11 + index}.1"


def _check_index(index: int) -> None:
    if not 0 <= index < MAX_REGIONS:
        raise ValueError(f"region index {index} outside 0..{MAX_REGIONS - 1}")


def new_tsig_key(name: str) -> TsigKey:
    """A fresh hmac-sha256 TSIG key (256 random bits, base64), as ``tsig-keygen`` makes."""
    return TsigKey(name=name, secret=base64.b64encode(secrets.token_bytes(32)).decode(), algorithm="hmac-sha256")


class BindError(RuntimeError):
    """named could not be started or did not answer in time; the message ends with named's log tail."""


class BindServer:
    """named serving one zone with a view per region, its files in ``directory``.

    Args:
        directory: where named.conf, keys.conf, the zone files, journals, pid file and session key go (created).
        balancers: region -> the address its view answers for the service name, or several (a region served by
            several balancers: one A record each); config order is view order; the first region also answers the
            default view.
        host, port: where named listens (UDP and TCP); port 0 is an error, pick a free one.
        zone, name, ttl_s: the zone, the service name inside it, the service record's TTL (s).
        keys: region -> TSIG key of its view; default: a new hmac-sha256 key ``skylb-<region>`` per region.
        client_prefixes: region -> the source prefix its view matches; default :func:`client_prefix` by position.
        named: the named binary; default ``named`` on PATH or /usr/sbin/named.
    """

    def __init__(self, directory: str | Path, balancers: Mapping[str, str | Sequence[str]], *, host: str = "127.0.0.1",
                 port: int, zone: str = "skylb.test.", name: str = "llm.skylb.test.", ttl_s: int = 5,
                 keys: Mapping[str, TsigKey] | None = None, client_prefixes: Mapping[str, str] | None = None,
                 named: str | None = None):
        if not balancers:
            raise ValueError("at least one region is needed")
        if not 0 < port < 65536:
            raise ValueError(f"port {port} must be 1..65535")
        self.directory = Path(directory).resolve()
        self.balancers = {r: [a] if isinstance(a, str) else list(a) for r, a in balancers.items()}
        if not all(self.balancers.values()):
            raise ValueError("every region needs at least one address")
        self.regions: Sequence[str] = list(balancers)
        self.host, self.port, self.ttl_s = host, port, ttl_s
        self.zone = zone if zone.endswith(".") else zone + "."
        self.name = name if name.endswith(".") else name + "."
        if not dns.name.from_text(self.name).is_subdomain(dns.name.from_text(self.zone)):
            raise ValueError(f"name {self.name} is not inside zone {self.zone}")
        keys = dict(keys or {})
        self.keys = {r: keys.get(r) or new_tsig_key(f"skylb-{r}") for r in self.regions}
        if any(k.secret is None for k in self.keys.values()):
            raise ValueError("every given key needs its secret")
        prefixes = dict(client_prefixes or {})
        self.client_prefixes = {r: str(ipaddress.ip_network(prefixes.get(r) or client_prefix(i)))
                                for i, r in enumerate(self.regions)}
        self.named = named or shutil.which("named") or "/usr/sbin/named"
        self.proc: Proc | None = None

    # ----------------------------------------------------------------------------------------------- files

    @property
    def conf_path(self) -> Path:
        """named's configuration file (options, keys include, one view per region)."""
        return self.directory / "named.conf"

    @property
    def key_file(self) -> Path:
        """The BIND key file with every region's key (usable as :attr:`DnsConfig.key_file`)."""
        return self.directory / "keys.conf"

    def zone_path(self, region: str) -> Path:
        """The zone file of ``region``'s view (its journal sits beside it once updated)."""
        return self.directory / f"zone-{region}.db"

    def write_config(self) -> Path:
        """Write named.conf, keys.conf (mode 0600) and a fresh zone file per view (old journals removed, so a
        restart starts from the configured answers); returns named.conf's path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        keys_text = "".join(f'key "{k.name}" {{ algorithm {k.algorithm}; secret "{k.secret}"; }};\n'
                            for k in self.keys.values())
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(keys_text)
        for region in self.regions:
            self.zone_path(region).with_suffix(".db.jnl").unlink(missing_ok=True)
            self.zone_path(region).write_text(self._zone_text(region))
        self.conf_path.write_text(self._conf_text())
        return self.conf_path

    def _zone_text(self, region: str) -> str:
        zone, ns = self.zone, f"ns.{self.zone}"
        ns_type = "A" if ipaddress.ip_address(self.host).version == 4 else "AAAA"
        records = "".join(f"{self.name} {self.ttl_s} IN {'A' if ipaddress.ip_address(a).version == 4 else 'AAAA'} "
                          f"{a}\n" for a in self.balancers[region])
        # SOA minimum (negative-caching TTL) = ttl_s too: a resolver must not remember "no such record" longer
        return (f"$ORIGIN {zone}\n$TTL {self.ttl_s}\n"
                f"@ IN SOA {ns} hostmaster.{zone} 1 3600 600 86400 {self.ttl_s}\n"
                f"@ IN NS {ns}\n"
                f"{ns} IN {ns_type} {self.host}\n"
                + records)

    def _conf_text(self) -> str:
        d = self.directory
        key_names = {r: k.name.rstrip(".") for r, k in self.keys.items()}
        lines = [
            f'include "{self.key_file}";',
            "options {",
            f'    directory "{d}";',
            f'    pid-file "{d}/named.pid";',
            f'    session-keyfile "{d}/session.key";',
            f'    managed-keys-directory "{d}";',
            f'    dump-file "{d}/named_dump.db";',
            f'    statistics-file "{d}/named.stats";',
            f"    listen-on port {self.port} {{ {self.host}; }};" if ":" not in self.host else
            f"    listen-on-v6 port {self.port} {{ {self.host}; }};",
            "    listen-on-v6 { none; };" if ":" not in self.host else "    listen-on { none; };",
            "    recursion no;",  # authoritative only: nothing leaves the machine
            "    dnssec-validation no;",
            "    notify no;",
            "    allow-transfer { none; };",
            "};",
            "controls { };",  # no rndc channel: stop() kills the process
        ]
        zone = self.zone.rstrip(".")
        for region in self.regions:
            # Own key first; then every other region's key excluded, so a request signed for another view never
            # lands here by its source address; then this region's clients.
            others = "".join(f' !key "{key_names[o]}";' for o in self.regions if o != region)
            lines += [
                f'view "{region}" {{',
                f'    match-clients {{ key "{key_names[region]}";{others} {self.client_prefixes[region]}; }};',
                f'    zone "{zone}" {{',
                "        type primary;",
                f'        file "{self.zone_path(region).name}";',
                f'        allow-update {{ key "{key_names[region]}"; }};',
                "    };",
                "};",
            ]
        lines += ['view "default" {', "    match-clients { any; };",
                  f'    zone "{zone}" {{ in-view "{self.regions[0]}"; }};', "};"]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------------------------------- process

    def command(self) -> list[str]:
        """named's command line: foreground with logs on stderr (-g), IPv4 or IPv6 only as ``host`` is, one
        worker thread (the zone is tiny)."""
        family = "-6" if ":" in self.host else "-4"
        return [self.named, "-g", family, "-n", "1", "-c", str(self.conf_path)]

    def start(self, *, procs: ProcGroup | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
        """Write the files, start named (through ``procs`` when given, so the group stops it too) and wait until
        every view answers the service name. Raises BindError with named's log tail when named exits or does not
        answer within ``timeout_s``; named is stopped then."""
        self.write_config()
        if procs is not None:
            self.proc = procs.start(self.command(), name="named")
        else:
            self.proc = Proc(self.command(), name="named", log_dir=self.directory)
        try:
            self._wait_answering(timeout_s)
        except BindError:
            self.stop()
            raise

    def _wait_answering(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(self.regions)
        while waiting:  # bounded by the deadline; each try by its own 0.5 s timeout
            assert self.proc is not None
            if self.proc.popen.poll() is not None:
                raise BindError(f"named exited with {self.proc.popen.returncode}\n--- named log ---\n"
                                f"{self.log_tail()}")
            if self._answers(waiting[0]):
                waiting.pop(0)
                continue
            if time.monotonic() > deadline:
                raise BindError(f"named on {self.host}:{self.port} did not answer in view {waiting[0]} within "
                                f"{timeout_s:g} s\n--- named log ---\n{self.log_tail()}")
            time.sleep(0.05)

    def _answers(self, region: str) -> bool:
        """Whether named answers the service name in region's view (asked with region's key)."""
        query = dns.message.make_query(self.name, "A")
        query.use_tsig(self.keys[region].tsig())
        try:
            response = dns.query.udp(query, self.host, port=self.port, timeout=0.5)
        except (dns.exception.DNSException, OSError):
            return False
        return response.rcode() == dns.rcode.NOERROR and bool(response.answer)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of named's output (stderr and stdout)."""
        if self.proc is None or not self.proc.log_path.exists():
            return ""
        return self.proc.log_path.read_text(errors="replace")[-chars:]  # readable after stop() too

    def stop(self) -> None:
        """Stop named (SIGTERM, then SIGKILL); safe to call twice or before start."""
        if self.proc is not None:
            self.proc.stop()

    def __enter__(self) -> "BindServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------- clients

    def dns_config(self, *, inline_secrets: bool = True) -> DnsConfig:
        """The controller's :class:`DnsConfig` for this server: its address, zone, name, TTL and every region's
        key (with the secrets inline, or by name from :attr:`key_file`)."""
        keys = (self.keys if inline_secrets else
                {r: TsigKey(name=k.name, algorithm=k.algorithm) for r, k in self.keys.items()})
        return DnsConfig(server=self.host, port=self.port, zone=self.zone, name=self.name, ttl_s=self.ttl_s,
                         keys=keys, key_file=None if inline_secrets else str(self.key_file))
