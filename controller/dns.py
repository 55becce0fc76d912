"""Point a region's DNS answer at a balancer: RFC 2136 dynamic updates signed with TSIG, through dnspython.

Clients reach their region's balancer by one service name (``llm.skylb.test.`` by default). The authoritative
server answers that name per region: BIND 9 with one view per region (bench/dns/bind.py runs one on this machine),
where a view matches its region's clients by source address and its region's TSIG key, so an update signed with
region R's key changes only what R's clients get. The controller calls ``await updater.point(region,
address_of(balancer_url))`` when a region's balancer fails over to another region's balancer, and again when it
recovers; :meth:`DnsUpdater.current` reads the answer back (status, tests).

Configuration is ``controller.dns`` of the deployment YAML: :class:`skylb.dns_settings.DnsConfig`, with an
example there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
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

from skylb.dns_settings import DnsConfig

__all__ = ["DnsUpdateError", "DnsUpdater", "address_of", "record_for"]

log = structlog.get_logger("skylb.controller.dns")


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

    async def point(self, region: str, address: str | Sequence[str]) -> None:
        """Make region's view answer the service name with ``address``, or with every address of a list (IPv4 ->
        A, IPv6 -> AAAA records; a hostname -> one CNAME, which admits nothing beside it, so a list holding one
        answers with the first hostname alone), deleting the other types in the same update, with TTL ``ttl_s``.

        Raises DnsUpdateError (``rcode`` set when the server refused: NOTAUTH for a bad or unknown key, REFUSED
        when the key may not update the zone), or ValueError / DNSException for a malformed or empty address list.
        """
        cfg = self.config
        records = sorted({record_for(a) for a in ([address] if isinstance(address, str) else address)})
        if not records:
            raise ValueError(f"no address to point region {region}'s name at")
        cname = next((r for r in records if r[0] == "CNAME"), None)
        records = [cname] if cname else records
        update = dns.update.UpdateMessage(cfg.zone, keyring=self._key(region))
        for other in self.RECORD_TYPES:  # deletes first: BIND applies an update's records in order, and a CNAME
            update.delete(cfg.name, other)  # cannot be added next to other data
        for rdtype, data in records:
            update.add(cfg.name, cfg.ttl_s, rdtype, data)
        await self._send(region, update, "DNS update")
        log.info("dns_pointed", region=region, name=cfg.name, records=[f"{t} {d}" for t, d in records],
                 ttl_s=cfg.ttl_s)

    async def current(self, region: str) -> str | None:
        """What region's view answers for the service name: an address (the lowest when several), or a CNAME
        target without the trailing dot; None when it has no A, AAAA or CNAME. The query is signed with the
        region's key, which selects its view. Raises DnsUpdateError when the server cannot be asked or refuses."""
        answers = await self.current_all(region)
        return answers[0] if answers else None

    async def current_all(self, region: str) -> list[str]:
        """Every answer of region's view for the service name: its A addresses (sorted), else its AAAA ones, else
        its CNAME target (without the trailing dot); [] when none. Raises DnsUpdateError as :meth:`current`."""
        cfg = self.config
        name = dns.name.from_text(cfg.name)
        for rdtype in ("A", "AAAA"):
            query = dns.message.make_query(name, rdtype)
            query.use_tsig(self._key(region))
            response = await self._send(region, query, "DNS query", ok=(dns.rcode.NOERROR, dns.rcode.NXDOMAIN))
            for rrset in response.answer:  # an authoritative server puts the name's CNAME first
                if rrset.name == name and rrset.rdtype == dns.rdatatype.CNAME:
                    return [rrset[0].target.to_text().rstrip(".")]
                if rrset.name == name and rrset.rdtype == dns.rdatatype.from_text(rdtype):
                    return sorted(r.address for r in rrset)
        return []
