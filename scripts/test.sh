#!/usr/bin/env bash
# `make test`: the whole suite, in two parts, after collecting it once (so the workers' collection is warm).
#   1. Every test not marked `alone`, on TEST_WORKERS pytest-xdist workers (default 4, twice the cores here).
#      Many tests wait (on daemons starting, timers, faults that last a fixed time), so two workers a core fill
#      the gaps; past that the suite is CPU-bound on 2 cores and more workers only slow each test (at 6 the load
#      reached 24). Each test owns its ports, namespaces, mounts and state dirs (docs/DEVELOPMENT.md).
#      Each file runs on one worker (--dist loadfile; tests/conftest.py SHARED_WORKER puts files that share a
#      costly start-up on one), so its module fixtures are built once; xdist hands out the files with the most
#      tests first (the longest first was slower: tests/conftest.py says why).
#   2. The tests marked `alone`, one at a time, with the machine to themselves: they measure CPU shares or
#      need a quiet machine. The list is ALONE in tests/conftest.py, the one place it is declared.
# SHUFFLE=1 runs both parts in a random order (pytest-randomly; the seed is printed, and
# SHUFFLE=<seed> repeats one). Extra pytest arguments go to both parts: scripts/test.sh -x -k fault.
# The last line is the total of both parts: "total: N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-4}
# pytest caches its rewritten test modules, and Python the package's bytecode, only when allowed to write
# them; without that every worker and every agent or collector subprocess compiles them again (minutes of CPU).
unset PYTHONDONTWRITEBYTECODE
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

order=(-p no:randomly)
case "${SHUFFLE:-}" in
  "" | 0) ;;
  1) order=(--randomly-seed="$RANDOM$RANDOM") ;;
  *) order=(--randomly-seed="$SHUFFLE") ;;
esac
# pytest -q leaves out pytest-randomly's header line, so say the seed here (SHUFFLE=<seed> repeats the order)
[ "${#order[@]}" -eq 1 ] && [ "${order[0]}" != "-p" ] && echo "shuffled order: ${order[0]} (repeat with SHUFFLE=${order[0]#--randomly-seed=})"

start=$SECONDS
# Collect once first, in two processes that split the files: pytest rewrites each test module's asserts and
# caches the result in tests/__pycache__ (collecting the suite took 7.7 CPU-s cold and about 2 warm). Without
# it, a clean clone's workers would all rewrite every module at once. Errors here are the real run's to report.
# Skipped when pytest arguments are given (-k, a path): a few tests do not need the whole suite rewritten first.
if [ "$#" -eq 0 ]; then
  mapfile -t files < <(ls tests/test_*.py)
  half=$(( ${#files[@]} / 2 ))
  "$PY" -m pytest --collect-only -q -p no:randomly "${files[@]:0:half}" > /dev/null 2>&1 &
  "$PY" -m pytest --collect-only -q -p no:randomly "${files[@]:half}" > /dev/null 2>&1
  wait
fi
"$PY" -m pytest -q -n "$WORKERS" --dist loadfile -m "not alone" "${order[@]}" --junitxml="$OUT/parallel.xml" "$@"
rc1=$?
mid=$SECONDS
"$PY" -m pytest -q -m alone "${order[@]}" --junitxml="$OUT/alone.xml" "$@"
rc2=$?
[ "$rc2" -eq 5 ] && rc2=0    # no test selected in the second part (e.g. with -k): not a failure
end=$SECONDS

"$PY" - "$OUT" "$((mid - start))" "$((end - mid))" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, t1, t2 = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in ("parallel.xml", "alone.xml"):
    p = out / f
    if not p.exists():
        continue
    for suite in ET.parse(p).getroot().iter("testsuite"):
        for k in tot:
            tot[k] += int(suite.get(k, 0))
failed = tot["failures"] + tot["errors"]
passed = tot["tests"] - failed - tot["skipped"]
print(f"make test: parallel part {t1} s, alone part {t2} s")
print(f"total: {passed} passed, {failed} failed, {tot['skipped']} skipped")
EOF
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
