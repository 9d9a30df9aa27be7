#!/usr/bin/env bash
# Install what tests/test_etcd*.py need to run a real etcd cluster on this host: Debian's
# etcd-server (the etcd daemon, v3 API) and etcd-client (etcdctl, for checking by hand).
#
# Only installs programs; starts no daemon: the tests start (and stop, by PID) their own
# 3-member cluster on loopback ports in a temporary directory (ftrun.testing.etcd).
# Does nothing when everything is there. Without root or apt-get it says so and exits 0:
# the tests then skip, unless FTRUN_REQUIRE_ETCD=1 (as in CI) makes that a failure.
set -euo pipefail
cd "$(dirname "$0")"

# policy-rc.d: Debian's package would start (and enable) a system etcd on port 2379 as it
# installs; the tests start their own, and a CI host must keep no daemon running.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ "$(id -u)" -eq 0 ] && [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi' EXIT
bash apt-install-missing.sh setup-etcd.sh "the etcd rendezvous tests" etcd-server etcd-client
