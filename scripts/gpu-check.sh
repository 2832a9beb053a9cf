#!/usr/bin/env bash
# GPU check: every gpu/nvml-marked test, then each GPU probe once, with a summary. Under 5 minutes on a
# one-GPU machine (GPU_CHECK_BUDGET_S, default 285 s, bounds every step), offline.
#
# Python: $PYTHON if set (gpuagent must be importable from it); else the system python3 when it has torch
# (CUDA or not): gpuagent is made importable through symlinks in a temporary folder on PYTHONPATH (no
# pip, no venv: a venv made from python3 would not see python3's packages when python3 is itself a venv,
# as on images that ship torch in /opt/.../.venv; gpuagent/__init__.py extends its __path__ so the links
# are found although the checkout's own gpuagent/ comes first on sys.path); else `make install` + .venv
# (needs the network).
# Exit status: 0 only when the tests passed and no probe failed or timed out (skipped is fine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${GPU_CHECK_OUT:-gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET_S:-285}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

# Seconds for the next step: at most $1, and leave $2 seconds for the steps after it.
slot() { local left=$((BUDGET - SECONDS - $2)); [ "$left" -gt "$1" ] && left=$1; [ "$left" -lt 5 ] && left=5; echo "$left"; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif python3 -c 'import torch' 2>/dev/null; then
  PY=python3
  NS=$(mktemp -d)/gpuagent
  trap 'rm -rf "$(dirname "$NS")"' EXIT
  mkdir -p "$NS" && cp gpuagent/__init__.py "$NS/"
  for d in common agent collector probes proto jobs sim; do ln -s "$PWD/$d" "$NS/$d"; done
  export PYTHONPATH="$(dirname "$NS")${PYTHONPATH:+:$PYTHONPATH}"
  echo "(gpuagent importable through links in $NS)"
else
  echo "python3 has no torch: installing the project into .venv (needs the network)"
  make install || { echo "make install failed: set PYTHON to a python with torch (CUDA build) and rerun"; exit 1; }
  PY=.venv/bin/python
fi
echo "== python: $PY ($($PY -c 'import sys; print(sys.executable, sys.version.split()[0])'))"
$PY - <<'PYEOF'
import importlib
import importlib.metadata
import torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} available={torch.cuda.is_available()} "
      f"gpus={torch.cuda.device_count()} " + ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
if not torch.cuda.is_available():
    print("WARNING: this torch does not see CUDA: gpu tests and the pcie/gpu_compute probes will be SKIPPED")
for mod, dist in (("pynvml", "nvidia-ml-py"), ("google.protobuf", "protobuf"), ("grpc", "grpcio"),
                  ("psutil", "psutil"), ("click", "click"), ("pytest", "pytest")):
    try:
        importlib.import_module(mod)
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        print(f"  {mod}: {dist} {version}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {mod}: MISSING ({exc})")
PYEOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max --format=csv

# Only the files that hold gpu/nvml-marked tests: the others may import collector-only packages
# (duckdb, pyarrow) that a GPU box without the collector extra does not have.
FILES=$(grep -lE "mark\.(gpu|nvml)" tests/test_*.py | tr '\n' ' ')
T=$(slot 150 110)
echo "== pytest -m 'gpu or nvml' $FILES (limit ${T}s)"
timeout "$T" $PY -m pytest -q -rs -m "gpu or nvml" -p no:cacheprovider $FILES 2>&1 | tee "$OUT_DIR/pytest-gpu.log" | tail -30
TEST_RC=${PIPESTATUS[0]}

for p in pcie:40:70 gpu_compute:45:25 collective:60:0; do
  IFS=: read -r name cap after <<<"$p"
  T=$(slot "$cap" "$after")
  echo "== probe $name (limit ${T}s)"
  timeout "$T" $PY -m gpuagent.probes "$name" --json > "$OUT_DIR/$name.json" 2> "$OUT_DIR/$name.err"
  echo "  exit $? ($(wc -c < "$OUT_DIR/$name.json") bytes of JSON)"
done

echo "== summary (${SECONDS}s so far)"
$PY - "$OUT_DIR" "$TEST_RC" <<'PYEOF'
import json, os, sys
out, test_rc = sys.argv[1], int(sys.argv[2])
bad = test_rc != 0
import re
try:  # pytest's last line, e.g. "3 passed, 5 skipped in 9.1s": say what ran, not just the exit code
    lines = [ln for ln in open(os.path.join(out, "pytest-gpu.log")).read().splitlines() if ln.strip()]
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", lines[-1]))
except (OSError, IndexError):
    counts = {}
tally = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no pytest summary"
if test_rc != 0:
    verdict = f"FAILED (exit {test_rc}" + (", timed out" if test_rc == 124 else "") + f"; {tally})"
elif not counts.get("passed"):
    verdict = f"NONE RAN ({tally}: no CUDA or no NVIDIA driver here)"
    bad = True  # a GPU check that checked nothing is not a pass (exit 1 with this line)
else:
    verdict = f"passed ({tally})"
print(f"gpu/nvml-marked tests: {verdict}")
for name in ("pcie", "gpu_compute", "collective"):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            d = json.load(f)
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: NO RESULT ({type(exc).__name__}: {exc}; see {name}.err)")
        bad = True
        continue
    bad |= d["status"] not in ("ok", "skipped")
    print(f"{name}: {d['status']}" + (f" ({d['reason']})" if d.get("reason") else ""))
    for g in d.get("per_gpu", []):
        m, e = g.get("metrics", {}), g.get("env", {})
        if g.get("status") != "ok":
            print(f"  gpu{g['gpu']}: {g.get('status')}: {g.get('reason')}")
            continue
        if name == "pcie":
            theo = e.get("theoretical_gbps")
            print(f"  gpu{g['gpu']} {e.get('device', '')}: PCIe gen{e.get('link_gen', '?')} x{e.get('link_width', '?')} "
                  f"(max gen{e.get('link_gen_max', '?')} x{e.get('link_width_max', '?')}), theoretical "
                  + (f"{theo:.2f} GB/s per direction" if theo else "unknown (no NVML link info)"))
            for k in ("h2d", "d2h"):
                eff = m.get(f"{k}_efficiency_percent")
                print(f"    {k.upper()} {m[f'{k}_gbps']:.2f} GB/s (cv {m.get(f'{k}_cv_percent', 0):.1f} %)"
                      + (f" = {eff:.1f} % of theoretical" if eff is not None else ""))
            print(f"    bidirectional {m['bidir_gbps']:.2f} GB/s (both directions' bytes); numa_local="
                  f"{m.get('numa_local', 'unknown')} (GPU node {e.get('numa_node')}, CPU nodes {e.get('cpu_numa_nodes')})")
        elif name == "gpu_compute":
            print(f"  gpu{g['gpu']} {e.get('device', '')}: bf16 {m['bf16_tflops']:.1f} TFLOP/s, "
                  f"fp32 {m['fp32_tflops']:.1f} TFLOP/s (TF32 {'ON' if e.get('matmul_tf32') else 'off'}); "
                  f"launch {m['launch_latency_us']:.2f} us (CPU op {m['torch_cpu_op_us']:.2f} us), "
                  f"launch+sync {m['sync_latency_us']:.1f} us")
    if name == "collective" and d.get("metrics"):
        m, e = d["metrics"], d["env"]
        print(f"  backend={e.get('backend')} world={e.get('world_size')}: busbw {m['busbw_gbps']:.2f} GB/s, "
              f"algbw {m['algbw_gbps']:.2f} GB/s at {e.get('largest_bytes')} B ({e.get('iters_at_largest')} iterations), "
              f"small-message latency {m['small_msg_latency_us']:.1f} us")
sys.exit(1 if bad else 0)
PYEOF
SUMMARY_RC=$?
echo "== done in ${SECONDS}s"
exit $SUMMARY_RC
