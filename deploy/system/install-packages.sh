#!/usr/bin/env bash
# Install the Debian packages of the real components that the tests start on loopback: BIND 9 (DNS views and
# RFC 2136 updates), etcd (the highly available membership store), HAProxy (a baseline), Redis (shared limits),
# openssl (the TLS test's self-signed certificate), Prometheus with promtool (rules, metrics and the dashboard's
# queries) and Chromium with its WebDriver (the status page in a real headless browser).
# Idempotent and quiet when everything is present; `make test` runs it first. Needs root (or sudo) and apt-get;
# elsewhere it says what is missing and exits 0, so the tests that need a component skip (and fail under CI=true).
#
# Usage: deploy/system/install-packages.sh
set -euo pipefail
# binary -> Debian package
declare -A packages=(
  [named]=bind9 [dig]=bind9-dnsutils [nsupdate]=bind9-dnsutils [etcd]=etcd-server [etcdctl]=etcd-client
  [haproxy]=haproxy [redis-server]=redis-server [openssl]=openssl
  [prometheus]=prometheus [promtool]=prometheus [chromium]=chromium [chromedriver]=chromium-driver
)
missing=()
for bin in "${!packages[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("${packages[$bin]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-packages: no apt-get here; install these yourself: ${missing[*]}" >&2; exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "install-packages: not root and no sudo; install these yourself: ${missing[*]}" >&2; exit 0; fi
fi
echo "install-packages: apt-get install ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >&2
# --no-install-recommends; policy-rc.d keeps the packages' own services from starting: the tests start their own.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null; $sudo chmod +x "$policy"; trap '$sudo rm -f "$policy"' EXIT; fi
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
