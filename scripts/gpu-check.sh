#!/usr/bin/env bash
# GPU check, for a lent GPU machine (OFFLINE, Python version unknown in advance): every gpu/nvml-marked test,
# each GPU probe once, and their figures against independent references, with one PASS/FAIL line per check.
# docs/PROBES.md ("GPU check") says how to run it and what PASS means.
#
# It cannot pass by accident:
#   - before running anything it makes sure the chosen Python has CUDA torch (a build that sees a GPU),
#     pytest, pytest-timeout, psutil, nvidia-ml-py, grpcio, protobuf and click; whatever is missing comes
#     from the wheel folder that scripts/gpu-wheels.sh gathered beforehand (pip --no-index, into a temporary
#     --target folder, so the image's own torch stays untouched), and only then. What is still missing stops
#     it at once with one sentence (exit 2). It never calls make, never asks a package index, never touches
#     the network;
#   - a gpu/nvml test that SKIPS is a FAIL (its line says when CUDA or nvidia-smi worked meanwhile), and so is
#     a run where no test ran;
#   - every probe figure is compared with a reference (link rate, datasheet peak) and has a PASS range.
#
# Environment: PYTHON (default: the first python3/python on PATH that has torch), GPU_CHECK_OUT (default
# $OUT when set, else gpu-check-out/: logs and gpu-check-summary.json), GPU_CHECK_WHEELS (default
# gpu-wheels), GPU_CHECK_BUDGET_S (default 285: every step is bounded so the whole run fits in it).
# Exit status: 0 every check passed, 1 some check failed, 2 refused (a dependency is missing).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-gpu-check-out}}
WHEELS=${GPU_CHECK_WHEELS:-gpu-wheels}
BUDGET=${GPU_CHECK_BUDGET_S:-285}
HELPER=scripts/gpu_check.py
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# Seconds for the next step: at most $1, leaving $2 seconds for the steps after it.
slot() { local left=$((BUDGET - SECONDS - $2)); [ "$left" -gt "$1" ] && left=$1; [ "$left" -lt 5 ] && left=5; echo "$left"; }

# The test files holding gpu/nvml-marked tests (a module-level pytestmark or a decorator): only these are
# collected, since the others may import collector-only packages (duckdb, pyarrow) a GPU image lacks.
gpu_test_files() { grep -lE '^(pytestmark = |@)pytest\.mark\.(gpu|nvml)\b' tests/test_*.py; }

# What this check runs, one line per check in the summary; printed first, so that a refusal still says it.
plan() {
  local f
  for f in $(gpu_test_files); do
    grep -oE '^def test_[A-Za-z0-9_]+' "$f" | sed "s|^def |test    $f::|"
  done
  echo "probe   pcie: python -m gpuagent.probes pcie --json (H2D/D2H/bidirectional GB/s per GPU)"
  echo "probe   gpu_compute: python -m gpuagent.probes gpu_compute --json (bf16/fp32 TFLOP/s, launch latency)"
  echo "probe   collective: python -m gpuagent.probes collective --json (NCCL; skipped, as it must be, on 1 GPU)"
  echo "compare pcie H2D and D2H GB/s per GPU against the link's rate (gen x width from NVML)"
  echo "compare gpu_compute bf16 TFLOP/s per GPU against the datasheet dense peak (common/gpu_peaks.py)"
}

# PY: $PYTHON, else the first python on PATH whose torch is importable (found without importing it).
choose_python() {
  local c
  if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; return; fi
  for c in python3 python python3.13 python3.12 python3.11 python3.10; do
    command -v "$c" >/dev/null || continue
    if "$c" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
      PY=$(command -v "$c"); return
    fi
  done
  PY=$(command -v python3 || command -v python || true)
}

# A source checkout, not installed: gpuagent.<pkg> becomes importable through links in a temporary folder on
# PYTHONPATH (gpuagent/__init__.py extends its __path__, so these are found although the checkout's own
# gpuagent/ comes first). No pip install of the project, no venv: a venv made from an image's python would
# not see that python's packages when it is itself a venv (torch in /opt/.../.venv).
make_importable() {
  "$PY" -c 'import gpuagent.common.nvml' 2>/dev/null && return
  local ns="$WORK/pkg/gpuagent" d
  mkdir -p "$ns" && cp gpuagent/__init__.py "$ns/"
  for d in common agent collector probes proto jobs sim; do ln -s "$PWD/$d" "$ns/$d"; done
  export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
  echo "(gpuagent importable through links in $ns)"
}

# pip for PY: its own, else pip run from the wheel in the wheel folder (`python pip.whl/pip` is supported).
pip_cmd() {
  if "$PY" -m pip --version >/dev/null 2>&1; then PIP=("$PY" -m pip); return 0; fi
  local whl
  whl=$(find "$WHEELS" -maxdepth 1 -name 'pip-*-py3-none-any.whl' | sort | tail -n 1)
  [ -n "$whl" ] || return 1
  PIP=("$PY" "$whl/pip")
}

# Install MISSING_SPECS from the wheel folder into a temporary --target folder put on PYTHONPATH for this
# run only. Offline by construction: --no-index (no index is asked), --isolated (no pip.conf, no PIP_*
# variables that could add one), --only-binary (nothing is built). Sets INSTALL_ERROR when it fails.
install_from_wheels() {
  INSTALL_ERROR=""
  if command -v sha256sum >/dev/null && ! (cd "$WHEELS" && sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1); then
    INSTALL_ERROR="$WHEELS/SHA256SUMS is missing or does not match its wheels: gather them again"; return 1
  fi
  pip_cmd || { INSTALL_ERROR="$PY has no pip and $WHEELS/ no pip wheel"; return 1; }
  local target="$WORK/site"
  echo "== installing $MISSING_SPECS for $PY from $WHEELS/ into $target (offline: pip --no-index; torch untouched)"
  # shellcheck disable=SC2086  # one argument per specifier
  if ! timeout 120 "${PIP[@]}" install --isolated --no-index --find-links "$WHEELS" --only-binary=:all: \
      --target "$target" --no-compile --no-cache-dir --disable-pip-version-check --no-input --no-warn-script-location -q \
      $MISSING_SPECS > "$WORK/pip.log" 2>&1; then
    cat "$WORK/pip.log"
    INSTALL_ERROR="pip exit status non-zero: $(grep -m1 -E 'ERROR|error' "$WORK/pip.log" || tail -n 1 "$WORK/pip.log")"
    return 1
  fi
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  echo "   installed: $(find "$target" -maxdepth 1 -name '*.dist-info' | wc -l) distributions, on PYTHONPATH for this run only"
}

# The dependency gate: ask, install what the wheels can give (only when something is missing), ask again.
dependencies() {
  local rc
  "$PY" "$HELPER" deps --python "$PY" --wheels "$WHEELS" --state "$WORK/deps.sh" --out "$OUT_DIR" --plan "$WORK/plan.txt"
  rc=$?
  if [ "$rc" -eq 3 ]; then
    # shellcheck disable=SC1091
    . "$WORK/deps.sh"
    install_from_wheels
    "$PY" "$HELPER" deps --python "$PY" --wheels "$WHEELS" --state "$WORK/deps.sh" --out "$OUT_DIR" \
      --plan "$WORK/plan.txt" --after-install --install-error "$INSTALL_ERROR"
    rc=$?
  fi
  # shellcheck disable=SC1091  # written by the helper a moment ago
  case $rc in
    0) . "$WORK/deps.sh" ;;
    2) return 2 ;;            # the helper said why, and wrote the summary
    *) refuse "REFUSED: the dependency check itself failed under $PY (exit $rc, output above): set PYTHON to a Python 3.8 or newer that has a CUDA build of torch."
       return 2 ;;
  esac
}

# A refusal the helper cannot write (no usable Python): the sentence, and a summary JSON saying it.
refuse() {
  echo "$1"
  printf '{"verdict": "REFUSED", "reason": "%s", "checks": []}\n' "${1//\"/\'}" > "$OUT_DIR/gpu-check-summary.json"
}

main() {
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  echo "== GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s, output in $OUT_DIR/)"
  plan > "$WORK/plan.txt"
  echo "== plan: what this check runs (each becomes a PASS/FAIL line in the summary)"
  sed 's/^/  /' "$WORK/plan.txt"

  choose_python
  if [ -z "$PY" ] || ! "$PY" -c 'import sys' 2>/dev/null; then
    refuse "REFUSED: ${PY:-no python3 or python on PATH}${PY:+ does not run}: set PYTHON to a Python that has a CUDA build of torch."
    return 2
  fi
  make_importable
  dependencies || return 2

  local smi_gpus=0
  if command -v nvidia-smi >/dev/null && nvidia-smi -L > "$WORK/smi.txt" 2>&1; then
    smi_gpus=$(grep -c '^GPU ' "$WORK/smi.txt")
    nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.max,pcie.link.width.max,memory.total --format=csv
  else
    echo "  nvidia-smi: not available"
  fi

  local files t test_rc p name cap after
  files=$(gpu_test_files | tr '\n' ' ')
  t=$(slot 150 110)
  echo "== pytest -m 'gpu or nvml' $files(limit ${t}s)"
  # --timeout: one hung test becomes a failure in the report instead of eating the whole slot.
  # shellcheck disable=SC2086
  timeout -k 10 "$t" "$PY" -m pytest -q -rs -m "gpu or nvml" -p no:cacheprovider --timeout=90 \
    -o junit_family=xunit1 --junitxml="$OUT_DIR/pytest-gpu.xml" $files
  test_rc=$?

  for p in pcie:40:70 gpu_compute:45:25 collective:60:0; do
    IFS=: read -r name cap after <<<"$p"
    t=$(slot "$cap" "$after")
    echo "== probe $name (limit ${t}s)"
    timeout -k 5 "$t" "$PY" -m gpuagent.probes "$name" --json > "$OUT_DIR/probe-$name.json"
    echo "  exit $? ($(wc -c < "$OUT_DIR/probe-$name.json") bytes of JSON)"
  done

  "$PY" "$HELPER" summary --out "$OUT_DIR" --test-rc "$test_rc" --cuda-available "${CUDA_AVAILABLE:-0}" \
    --gpu-count "${GPU_COUNT:-0}" --smi-gpus "$smi_gpus" --python "$PY" --plan "$WORK/plan.txt" --elapsed "$SECONDS"
}

mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/gpu-check-summary.json" "$OUT_DIR/pytest-gpu.xml" "$OUT_DIR"/probe-*.json  # no stale verdict
main "$@" 2>&1 | tee "$OUT_DIR/gpu-check.log"
rc=${PIPESTATUS[0]}
echo "== done in ${SECONDS}s, exit $rc (logs and gpu-check-summary.json in $OUT_DIR/)" | tee -a "$OUT_DIR/gpu-check.log"
exit "$rc"
