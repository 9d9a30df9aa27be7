#!/usr/bin/env bash
# Install the headless browser tests/test_report.py renders `ftrun report --html` pages in:
# Debian's chromium. Does nothing when it is there. Without root or apt-get it says so and
# exits 0: the test then skips, unless FTRUN_REQUIRE_CHROMIUM=1 (as in CI) makes that a failure.
set -euo pipefail

cd "$(dirname "$0")"
bash apt-install-missing.sh setup-chromium.sh "the report page's browser check" chromium
