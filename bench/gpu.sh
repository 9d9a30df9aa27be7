#!/usr/bin/env bash
# Everything ftrun checks on a GPU, from a fresh copy of the tree, in one run (under 8 minutes
# on one H100): the CUDA/NCCL tests, the torch seam tests against that machine's torch, the
# snapshot benchmark on a ~3 GB model (save every step vs none vs the pinned-copy limit, and
# restore), in-process restart of a job whose NCCL rank raises (fault -> next step against a
# process restart and torchrun), NCCL group re-formation in place vs a new worker, and the
# collective monitor's overhead on NCCL. It ends with one table, one row per part. The parts'
# limits add up to 560 s, so one device call of 595 s always gets the table back (measured
# on an H100, 2026-11-27: tests 139 s, the three snapshot jobs ~150 s, one round of the
# in-place bench's five jobs ~120 s, re-formation ~40 s, monitor ~40 s).
#
#   bash bench/gpu.sh              # results under $OUT (or /tmp/ftrun-gpu): gpu.md, logs
#   PARTS="tests-cuda reform-nccl" bash bench/gpu.sh    # only those parts
#   FTRUN_TREE=$(git rev-parse --short HEAD) ...         # the tree's name in the table (a
#                                                        # copied tree's .git may be stale)
#
# The machine may lack packages and have no index to fetch them from: put their wheels in
# .whl/ (pyzmq, msgspec: see bench/README.md) and they are installed first. ftrun itself is
# installed from this tree into the same interpreter (so `ftrun` sits beside `torchrun`).
# Each part has its own time limit; a part that fails or runs out is reported and the
# others still run. Exit status: the number of parts that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ftrun-gpu}
mkdir -p "$OUT"
PY=$(command -v "${PYTHON:-python3}")
export PYTHONUNBUFFERED=1 FTRUN_REQUIRE_CUDA=1
REPORT="$OUT/gpu.md"
: > "$REPORT"
declare -a ROWS=()
FAILED=0
T0=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...: run one part, log it, note a row
    local name=$1 limit=$2
    shift 2
    if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then
        return 0
    fi
    local t=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - t ))
    tail -n 25 "$OUT/$name.log"
    local what
    if [ $rc -eq 0 ]; then what=ok; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        what="timed out"; else what="failed (exit $rc)"; fi
    [ $rc -eq 0 ] || FAILED=$((FAILED + 1))
    local summary
    summary=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-160)
    ROWS+=("| $name | $what | ${took} s | ${summary//|/\\|} |")
}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu.sh: torch sees no GPU here ($("$PY" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl || exit 2
fi
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
    # No build backend there: run from the tree, with the console script written by hand.
    echo "pip could not install ftrun; running it from the tree (PYTHONPATH)" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    printf '#!%s\nimport sys\nfrom ftrun.cli.main import main\nsys.exit(main())\n' "$PY" \
        > "$(dirname "$PY")/ftrun" && chmod +x "$(dirname "$PY")/ftrun" || exit 2
fi
"$PY" - <<'EOF' | tee "$OUT/machine.txt"
import platform, torch
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch "
      f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL "
      f"{'.'.join(map(str, torch.cuda.nccl.version()))}, Python {platform.python_version()}")
EOF

part tests-cuda 160 "$PY" -m pytest -q -p no:cacheprovider --durations=6 tests/test_cuda.py \
    tests/test_torch_seams.py
part snapshot-3gb 170 "$PY" bench/snapshot.py --device cuda --size-gib 3 --steps 8 \
    --base-steps 4 --pair-steps 3 --auto-steps 16 --quiet-wait 5 --job-timeout 120 \
    --output "$REPORT"
part inplace-nccl 150 "$PY" bench/inprocess.py --device cuda --nproc 1 --fail-rank 0 \
    --fail-at-step 10 --fail-mode raise --samples 192 --repeats 1 --job-timeout 60 \
    --output "$REPORT"
part reform-nccl 40 "$PY" bench/reform.py --device cuda --rounds 3 --output "$REPORT"
part monitor-nccl 40 "$PY" bench/detect.py overhead --device cuda --ranks 1 --pairs 3 \
    --steps 1500 --output "$REPORT"

{
    echo
    echo "### bench/gpu.sh: $(date -u '+%Y-%m-%d %H:%M UTC'), $(cat "$OUT/machine.txt"), tree ${FTRUN_TREE:-as copied (git there: $(git rev-parse --short HEAD 2>/dev/null || echo none))}"
    echo
    echo "| part | result | time | summary |"
    echo "| --- | --- | --- | --- |"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "Total $(( $(date +%s) - T0 )) s."
} | tee -a "$REPORT"
exit $FAILED
