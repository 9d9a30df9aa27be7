#!/usr/bin/env bash
# apt-install-missing.sh WHO WHAT-SKIPS PACKAGE...: install those of the Debian PACKAGEs that
# are not installed yet (the setup-*.sh scripts' shared step). Does nothing when all are
# there. Without root or apt-get it says so and exits 0: the tests named by WHAT-SKIPS then
# skip (unless their FTRUN_REQUIRE_* variable makes that a failure).
set -euo pipefail

who=$1 skips=$2
shift 2
missing=()
for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "$who: ${missing[*]} not installed and no root apt-get here; $skips will skip" >&2
    exit 0
fi
echo "$who: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
