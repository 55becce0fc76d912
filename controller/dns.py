"""Point a region's DNS answer at a balancer: RFC 2136 dynamic updates signed with TSIG, through dnspython.

Clients reach their region's balancer by one service name (``llm.skylb.test.`` by default). The authoritative
server answers that name per region: BIND 9 with one view per region (bench/dns/bind.py runs one on this machine),
where a view matches its region's clients by source address and its region's TSIG key, so an update signed with
region R's key changes only what R's clients get. The controller calls ``await updater.point(region,
address_of(balancer_url))`` when a region's balancer fails over to another region's balancer, and again when it
recovers; :meth:`DnsUpdater.current` reads the answer back (status, tests).

Configuration is ``controller.dns`` of the deployment YAML (:class:`DnsConfig`)::

    controller:
      dns:
        server: 127.0.0.1          # the primary that takes updates (an IP address)
        port: 53
        zone: skylb.test.
        name: llm.skylb.test.
        ttl_s: 5
        keys:                      # one TSIG key per region: the key of that region's view
          us: {name: skylb-us, secret: <base64>, algorithm: hmac-sha256}
          eu: {name: skylb-eu}     # no secret: read from key_file (BIND syntax, as tsig-keygen writes it)
        key_file: /etc/bind/skylb-keys.conf
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import dns.asyncquery
import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.tsig
import dns.update
import structlog
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["TsigKey", "DnsConfig", "DnsUpdateError", "DnsUpdater", "address_of", "read_key_file",
           "record_for"]

log = structlog.get_logger("skylb.controller.dns")

#: TSIG algorithms (BIND's names); hmac-sha256 is what ``tsig-keygen`` makes by default.
Algorithm = Literal["hmac-sha256", "hmac-sha384", "hmac-sha512", "hmac-sha224", "hmac-sha1", "hmac-md5"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TsigKey(_Strict):
    """One TSIG key: its name, base64 secret and algorithm, as in a BIND ``key`` statement.

    ``secret`` may be left out when :attr:`DnsConfig.key_file` holds a key of this name.
    """

    name: str
    secret: str | None = None
    algorithm: Algorithm = "hmac-sha256"

    def tsig(self) -> dns.tsig.Key:
        """dnspython's key, for ``keyring=`` or ``Message.use_tsig``; ValueError when the secret is missing."""
        if self.secret is None:
            raise ValueError(f"TSIG key {self.name} has no secret")
        return dns.tsig.Key(self.name, self.secret, self.algorithm)


class DnsConfig(_Strict):
    """Where and how the controller updates the per-region DNS answer (``controller.dns``)."""

    #: IP address of the authoritative primary that takes RFC 2136 updates.
    server: str = "127.0.0.1"
    port: int = Field(53, ge=1, le=65535)
    zone: str = "skylb.test."
    #: The service name clients resolve, inside ``zone``.
    name: str = "llm.skylb.test."
    #: TTL of the service record (s): how long a resolver may keep a region on a balancer that failed.
    ttl_s: int = Field(5, ge=0)
    #: Bound on one update or query, connect to answer (s).
    timeout_s: float = Field(5.0, gt=0)
    #: Region -> the TSIG key of that region's view.
    keys: dict[str, TsigKey] = Field(default_factory=dict)
    #: A BIND key file (``key "NAME" { algorithm A; secret "S"; };``) with the secrets of keys given by name only.
    key_file: str | None = None

    @field_validator("zone", "name")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return value if value.endswith(".") else value + "."

    @field_validator("server")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        ipaddress.ip_address(value)  # ValueError: dnspython sends to an address, not a hostname
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "DnsConfig":
        if not dns.name.from_text(self.name).is_subdomain(dns.name.from_text(self.zone)):
            raise ValueError(f"name {self.name} is not inside zone {self.zone}")
        unresolved = [region for region, key in self.keys.items() if key.secret is None]
        if unresolved and self.key_file is None:
            raise ValueError(f"keys of {', '.join(unresolved)} have no secret and there is no key_file")
        return self

    def resolved_keys(self) -> dict[str, TsigKey]:
        """Region -> key with its secret, those given by name only read from ``key_file``.

        Raises ValueError naming the key when the file lacks it, OSError when the file cannot be read.
        """
        from_file = read_key_file(self.key_file) if self.key_file else {}
        out = {}
        for region, key in self.keys.items():
            if key.secret is None:
                if key.name.rstrip(".") not in from_file:
                    raise ValueError(f"key {key.name} of region {region} is not in {self.key_file}")
                key = from_file[key.name.rstrip(".")]
            out[region] = key
        return out


# A BIND key statement; named's own parser is the reference, this reads what tsig-keygen and BindServer write.
_KEY_STATEMENT = re.compile(
    r'key\s+"?(?P<name>[^"\s{]+)"?\s*\{(?P<body>[^}]*)\}\s*;', re.DOTALL)
_KEY_FIELD = re.compile(r'(?P<field>algorithm|secret)\s+"?(?P<value>[^";\s]+)"?\s*;')
# A quoted string (kept: a base64 secret may hold "//") or a comment in any of named.conf's three styles (dropped).
_STRING_OR_COMMENT = re.compile(r'(?P<string>"[^"]*")|#[^\n]*|//[^\n]*|/\*.*?\*/', re.DOTALL)


def read_key_file(path: str | Path) -> dict[str, TsigKey]:
    """The TSIG keys of a BIND key file (``key "NAME" { algorithm A; secret "S"; };``, comments allowed), by name
    without a trailing dot. Raises OSError when unreadable, ValueError for a key without a secret."""
    text = _STRING_OR_COMMENT.sub(lambda m: m["string"] or "", Path(path).read_text())
    keys = {}
    for match in _KEY_STATEMENT.finditer(text):
        fields = {m["field"]: m["value"] for m in _KEY_FIELD.finditer(match["body"])}
        if "secret" not in fields:
            raise ValueError(f"{path}: key {match['name']} has no secret")
        name = match["name"].rstrip(".")
        keys[name] = TsigKey(name=name, secret=fields["secret"], algorithm=fields.get("algorithm", "hmac-sha256"))
    return keys


def address_of(url: str) -> str:
    """The host of a balancer URL: ``http://127.0.0.12:8080`` -> ``127.0.0.12``, ``http://[::1]:80`` -> ``::1``,
    ``https://lb.eu.example.com/`` -> ``lb.eu.example.com``. ValueError when the URL has no host."""
    host = urlsplit(url if "://" in url else f"//{url}").hostname
    if not host:
        raise ValueError(f"no host in URL {url!r}")
    return host


def record_for(address: str) -> tuple[str, str]:
    """(record type, record data) that points a name at ``address``: an IPv4 literal -> A, an IPv6 literal ->
    AAAA, a hostname -> CNAME to it (made absolute)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        dns.name.from_text(address)  # raises a dns.exception.DNSException subclass for a malformed name
        return "CNAME", address if address.endswith(".") else address + "."
    return ("A" if ip.version == 4 else "AAAA"), ip.compressed


#: dnspython's exception for a TSIG error the server answered -> the error's RFC 8945 name.
_TSIG_ERRORS = {dns.tsig.PeerBadKey: "BADKEY", dns.tsig.PeerBadSignature: "BADSIG", dns.tsig.PeerBadTime: "BADTIME",
                dns.tsig.PeerBadTruncation: "BADTRUNC"}


class DnsUpdateError(RuntimeError):
    """An update or query failed: the server refused it (``rcode``: "NOTAUTH", "REFUSED", ...), TSIG failed, or
    it timed out (``rcode`` None)."""

    def __init__(self, message: str, *, region: str, rcode: str | None = None):
        super().__init__(message)
        self.region = region
        self.rcode = rcode


class DnsUpdater:
    """Replaces and reads the service record in each region's view (RFC 2136 over TCP, TSIG-signed).

    Args:
        config: server, zone, name, TTL and the per-region keys. Raises ValueError or OSError when a key given by
            name is not in the key file.
    """

    #: Every type :meth:`point` may write; one update deletes the others, so the name has exactly one.
    RECORD_TYPES = ("A", "AAAA", "CNAME")

    def __init__(self, config: DnsConfig):
        self.config = config
        self._keys = {region: key.tsig() for region, key in config.resolved_keys().items()}

    def _key(self, region: str) -> dns.tsig.Key:
        try:
            return self._keys[region]
        except KeyError:
            raise DnsUpdateError(f"no TSIG key for region {region!r} (keys: {', '.join(self._keys)})",
                                 region=region) from None

    async def _send(self, region: str, message: dns.message.Message, what: str,
                    ok: tuple[int, ...] = (dns.rcode.NOERROR,)) -> dns.message.Message:
        """Send over TCP (updates and signed queries alike; no truncation), bounded by ``timeout_s``; an answer
        whose rcode is not in ``ok`` raises DnsUpdateError naming it."""
        cfg = self.config
        try:
            response = await dns.asyncquery.tcp(message, cfg.server, port=cfg.port, timeout=cfg.timeout_s)
        except dns.tsig.PeerError as exc:  # the server could not verify our signature: it answered NOTAUTH
            raise DnsUpdateError(f"{what} for region {region} refused by {cfg.server}:{cfg.port}: NOTAUTH, TSIG "
                                 f"{_TSIG_ERRORS.get(type(exc), type(exc).__name__)} (key "
                                 f"{self._keys[region].name})", region=region, rcode="NOTAUTH") from exc
        except (dns.exception.DNSException, OSError) as exc:
            raise DnsUpdateError(f"{what} for region {region} at {cfg.server}:{cfg.port} failed: "
                                 f"{type(exc).__name__}: {exc}", region=region) from exc
        rcode = response.rcode()
        if rcode not in ok:
            name = dns.rcode.to_text(rcode)
            raise DnsUpdateError(f"{what} for region {region} refused by {cfg.server}:{cfg.port}: {name}",
                                 region=region, rcode=name)
        return response

    async def point(self, region: str, address: str) -> None:
        """Make region's view answer the service name with ``address`` (IPv4 -> A, IPv6 -> AAAA, hostname ->
        CNAME), deleting the other types in the same update, with TTL ``ttl_s``.

        Raises DnsUpdateError (``rcode`` set when the server refused: NOTAUTH for a bad or unknown key, REFUSED
        when the key may not update the zone), or ValueError / DNSException for a malformed address.
        """
        cfg = self.config
        rdtype, data = record_for(address)
        update = dns.update.UpdateMessage(cfg.zone, keyring=self._key(region))
        for other in self.RECORD_TYPES:  # deletes first: BIND applies an update's records in order, and a CNAME
            update.delete(cfg.name, other)  # cannot be added next to other data
        update.add(cfg.name, cfg.ttl_s, rdtype, data)
        await self._send(region, update, "DNS update")
        log.info("dns_pointed", region=region, name=cfg.name, type=rdtype, data=data, ttl_s=cfg.ttl_s)

    async def current(self, region: str) -> str | None:
        """What region's view answers for the service name: an address, or a CNAME target without the trailing
        dot; None when it has no A, AAAA or CNAME. The query is signed with the region's key, which selects its
        view. Raises DnsUpdateError when the server cannot be asked or refuses."""
        cfg = self.config
        name = dns.name.from_text(cfg.name)
        for rdtype in ("A", "AAAA"):
            query = dns.message.make_query(name, rdtype)
            query.use_tsig(self._key(region))
            response = await self._send(region, query, "DNS query", ok=(dns.rcode.NOERROR, dns.rcode.NXDOMAIN))
            for rrset in response.answer:  # an authoritative server puts the name's CNAME first
                if rrset.name == name and rrset.rdtype == dns.rdatatype.CNAME:
                    return rrset[0].target.to_text().rstrip(".")
                if rrset.name == name and rrset.rdtype == dns.rdatatype.from_text(rdtype):
                    return sorted(r.address for r in rrset)[0]
        return None
