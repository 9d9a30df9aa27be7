#!/usr/bin/env bash
# Install what tests/test_slurm_examples.py needs to run a real Slurm on this host: Debian's
# slurm-wlm and munge (and openssl, which the sbatch examples use for the job secret).
#
# Only installs programs; starts no daemon: the test writes its own slurm.conf and munge key
# in a temporary directory and starts (and stops) its own munged, slurmctld and slurmds.
# Does nothing when everything is there. Without root or apt-get it says so and exits 0:
# the test then skips, unless FTRUN_REQUIRE_SLURM=1 (as in CI) makes that a failure.
set -euo pipefail

missing=()
for pkg in slurm-wlm munge openssl; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup-slurm.sh: ${missing[*]} not installed and no root apt-get here; the" \
        "single-host Slurm test will skip" >&2
    exit 0
fi
echo "setup-slurm.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
