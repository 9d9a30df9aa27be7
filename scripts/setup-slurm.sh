#!/usr/bin/env bash
# Install what tests/test_slurm_examples.py needs to run a real Slurm on this host: Debian's
# slurm-wlm and munge (and openssl, which the sbatch examples use for the job secret).
#
# Only installs programs; starts no daemon: the test writes its own slurm.conf and munge key
# in a temporary directory and starts (and stops) its own munged, slurmctld and slurmds.
# Does nothing when everything is there. Without root or apt-get it says so and exits 0:
# the test then skips, unless FTRUN_REQUIRE_SLURM=1 (as in CI) makes that a failure.
set -euo pipefail

cd "$(dirname "$0")"
bash apt-install-missing.sh setup-slurm.sh "the single-host Slurm test" slurm-wlm munge openssl
