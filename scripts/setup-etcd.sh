#!/usr/bin/env bash
# Install what tests/test_etcd*.py need to run a real etcd cluster on this host: Debian's
# etcd-server (the etcd daemon, v3 API) and etcd-client (etcdctl, for checking by hand).
#
# Only installs programs; starts no daemon: the tests start (and stop, by PID) their own
# 3-member cluster on loopback ports in a temporary directory (ftrun.testing.etcd).
# Does nothing when everything is there. Without root or apt-get it says so and exits 0:
# the tests then skip, unless FTRUN_REQUIRE_ETCD=1 (as in CI) makes that a failure.
set -euo pipefail

missing=()
for pkg in etcd-server etcd-client; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup-etcd.sh: ${missing[*]} not installed and no root apt-get here; the" \
        "etcd rendezvous tests will skip" >&2
    exit 0
fi
echo "setup-etcd.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# policy-rc.d: Debian's package would start (and enable) a system etcd on port 2379; the
# tests start their own, and a CI host must not keep a daemon running after the install.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi' EXIT
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
