"""Eight public-cloud regions with their cities, UTC offsets and the round trips between them.

Regions are AWS regions (names as AWS spells them), each placed at the city AWS names for it; coordinates are the
city centres (decimal degrees, WGS84) and UTC offsets are standard time (no daylight saving: a simulated day is one
day of the year, and the follow-the-sun load needs only the offsets' order and spacing).

Round trip between two regions, ms (a rule of thumb for fibre, not a measured matrix):

    d   = haversine great-circle distance, Earth radius R = 6371 km:
          d = 2 R asin(sqrt(sin^2((lat2 - lat1) / 2) + cos(lat1) cos(lat2) sin^2((lon2 - lon1) / 2)))
    rtt = 2 x d / (200 km/ms) x 1.5

200 km/ms is light in fibre (about 2/3 of c); the factor 1.5 stands for fibre routes longer than the great circle
and for queueing in routers. Examples it gives: us-east-1 - eu-central-1 (6,549 km) 98 ms, us-east-1 -
ap-northeast-1 (10,872 km) 163 ms, eu-central-1 - ap-southeast-2 (16,483 km) 247 ms; over the 28 pairs from
53 ms (us-west-2 - us-east-1) to 278 ms (sa-east-1 - ap-northeast-1). The SkyLB paper (§2.1) quotes cross-region
latencies up to 200 ms; the longest pairs here, across the Pacific and the southern hemisphere, go beyond.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Region", "REGIONS", "EARTH_RADIUS_KM", "FIBRE_KM_PER_MS", "ROUTE_FACTOR", "haversine_km", "rtt_ms",
           "rtt_matrix"]

EARTH_RADIUS_KM = 6371.0
#: Light in fibre, km per ms (about 2/3 of c).
FIBRE_KM_PER_MS = 200.0
#: Fibre routes are longer than the great circle: the round trip is scaled by this.
ROUTE_FACTOR = 1.5


@dataclass(frozen=True)
class Region:
    """A cloud region: its ``name`` (AWS), ``city``, ``lat`` / ``lon`` (degrees) and ``utc_offset_h`` (hours)."""

    name: str
    city: str
    lat: float
    lon: float
    utc_offset_h: float


#: The eight regions, west to east by UTC offset.
REGIONS: tuple[Region, ...] = (
    Region("us-west-2", "Boardman, Oregon", 45.84, -119.70, -8.0),
    Region("us-east-1", "Ashburn, Virginia", 39.04, -77.49, -5.0),
    Region("sa-east-1", "Sao Paulo", -23.55, -46.63, -3.0),
    Region("eu-central-1", "Frankfurt", 50.11, 8.68, 1.0),
    Region("ap-south-1", "Mumbai", 19.08, 72.88, 5.5),
    Region("ap-southeast-1", "Singapore", 1.35, 103.82, 8.0),
    Region("ap-northeast-1", "Tokyo", 35.68, 139.69, 9.0),
    Region("ap-southeast-2", "Sydney", -33.87, 151.21, 10.0),
)


def haversine_km(a: Region, b: Region) -> float:
    """Great-circle distance between two regions' cities, km (haversine, R = 6371 km)."""
    la1, lo1, la2, lo2 = map(math.radians, (a.lat, a.lon, b.lat, b.lon))
    h = math.sin((la2 - la1) / 2) ** 2 + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def rtt_ms(a: Region, b: Region) -> float:
    """Round trip between two regions, ms: 2 x distance / 200 km/ms x 1.5 (module docstring)."""
    return 2.0 * haversine_km(a, b) / FIBRE_KM_PER_MS * ROUTE_FACTOR


def rtt_matrix(regions: tuple[Region, ...] = REGIONS) -> dict[tuple[str, str], float]:
    """(region, region) -> round trip, ms, one entry per unordered pair (bench.sim.cluster.Network's ``rtt_ms``)."""
    return {(a.name, b.name): rtt_ms(a, b) for i, a in enumerate(regions) for b in regions[i + 1:]}
