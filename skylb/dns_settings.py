"""The DNS settings of a deployment (``controller.dns`` of the YAML): the authoritative server, the service name
and one TSIG key per region, validated with pydantic; and the reader of BIND key files that holds their secrets.

The controller acts on them (controller/dns.py: RFC 2136 updates signed with TSIG); the configuration schema
(skylb/config.py) and the test harness's BIND launcher (bench/dns/bind.py) build them. Kept here, beside the
schema, so the schema does not import the controller. Sources: RFC 2136 "Dynamic Updates in the Domain Name
System" and RFC 8945 "Secret Key Transaction Authentication for DNS (TSIG)"; BIND 9's ``key`` statement.

Example::

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
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    import dns.tsig

__all__ = ["Algorithm", "TsigKey", "DnsConfig", "read_key_file"]

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
        import dns.tsig  # here, not at the top: every balancer imports this schema, few configure DNS
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
        import dns.name  # only a configured DNS section needs dnspython (``tsig`` above)
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
