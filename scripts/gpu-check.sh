#!/usr/bin/env bash
# GPU check: every gpu-marked test, then each GPU probe once, with a summary. < 5 min on a one-GPU machine.
#
# Python: $PYTHON if set; else the system python3 when its torch sees CUDA (a venv .venv-gpu with system
# site-packages, gpuagent installed editable without deps: works offline); else `make install` + .venv.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${GPU_CHECK_OUT:-gpu-check-out}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=python3
  if python3 -m venv --system-site-packages .venv-gpu &&
     .venv-gpu/bin/python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    PY=.venv-gpu/bin/python
  else
    # No usable pip/setuptools offline: map the import namespace with links (pyproject's package-dir).
    NS=$(mktemp -d)/gpuagent
    mkdir -p "$NS" && cp gpuagent/__init__.py "$NS/"
    for d in agent collector probes proto jobs; do ln -s "$PWD/$d" "$NS/$d"; done
    export PYTHONPATH="$(dirname "$NS")${PYTHONPATH:+:$PYTHONPATH}"
    echo "(gpuagent importable through links in $NS)"
  fi
else
  make install || exit 1
  PY=.venv/bin/python
fi
echo "== python: $PY"
$PY - <<'PYEOF'
import torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} available={torch.cuda.is_available()} "
      f"gpus={torch.cuda.device_count()} " + ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PYEOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current --format=csv

# Only the files that hold gpu/nvml-marked tests: the others may import collector-only packages
# (duckdb, pyarrow) that a GPU box without the collector extra does not have.
FILES=$(grep -lE "mark\.(gpu|nvml)" tests/test_*.py | tr '\n' ' ')
echo "== pytest -m 'gpu or nvml' $FILES"
timeout 240 $PY -m pytest -q -m "gpu or nvml" -p no:cacheprovider $FILES 2>&1 | tee "$OUT_DIR/pytest-gpu.log" | tail -25
TEST_RC=${PIPESTATUS[0]}

for p in pcie gpu_compute collective; do
  echo "== probe $p"
  timeout 200 $PY -m gpuagent.probes "$p" --json > "$OUT_DIR/$p.json" 2> "$OUT_DIR/$p.err"
  echo "  exit $? ($(wc -c < "$OUT_DIR/$p.json") bytes of JSON)"
done

echo "== summary"
$PY - "$OUT_DIR" "$TEST_RC" <<'PYEOF'
import json, sys, os
out, test_rc = sys.argv[1], int(sys.argv[2])
print(f"gpu-marked tests: {'passed' if test_rc == 0 else f'FAILED (exit {test_rc})'}")
for name in ("pcie", "gpu_compute", "collective"):
    try:
        d = json.load(open(os.path.join(out, name + ".json")))
    except Exception as exc:
        print(f"{name}: no result ({exc})"); continue
    print(f"{name}: {d['status']}" + (f" ({d['reason']})" if d.get("reason") else ""))
    for g in d.get("per_gpu", []):
        m, e = g.get("metrics", {}), g.get("env", {})
        if name == "pcie":
            theo = e.get("theoretical_gbps")
            print(f"  gpu{g['gpu']} {e.get('device','')}: link gen{e.get('link_gen','?')} x{e.get('link_width','?')} "
                  f"(max gen{e.get('link_gen_max','?')} x{e.get('link_width_max','?')}), theoretical {theo} GB/s per direction")
            for k in ("h2d", "d2h"):
                if f"{k}_gbps" in m:
                    eff = m.get(f"{k}_efficiency_percent")
                    print(f"    {k.upper()} {m[f'{k}_gbps']:.2f} GB/s (cv {m.get(f'{k}_cv_percent', 0):.1f} %)"
                          + (f" = {eff:.1f} % of theoretical" if eff is not None else ""))
            if "bidir_gbps" in m:
                print(f"    bidir {m['bidir_gbps']:.2f} GB/s, numa_local={m.get('numa_local','?')}")
        else:
            print("  gpu%d: %s" % (g["gpu"], ", ".join(f"{k}={v:.2f}" for k, v in sorted(m.items()))))
        if g.get("status") != "ok":
            print(f"  gpu{g['gpu']}: {g.get('status')}: {g.get('reason')}")
    if name == "collective" and d.get("metrics"):
        m = d["metrics"]
        print(f"  backend={d['env'].get('backend')} world={d['env'].get('world_size')}: busbw {m['busbw_gbps']:.2f} GB/s "
              f"at {d['env'].get('largest_bytes')} B, small-message latency {m['small_msg_latency_us']:.1f} us")
PYEOF
exit $TEST_RC
