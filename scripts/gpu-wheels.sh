#!/usr/bin/env bash
# Gather, on a machine WITH network, the wheels that scripts/gpu-check.sh installs on the OFFLINE GPU machine
# when its image lacks one of the check's dependencies (docs/PROBES.md, "GPU check").
#
# Why a wheel folder: the lent GPU machine reaches no network, and its Python version is not known in
# advance, so binary wheels for several CPython versions travel with the working tree (the device tool's
# `carry`, 64 MiB in all). torch is NOT gathered: the device image must bring a CUDA build of it.
#
#   scripts/gpu-wheels.sh                 # into gpu-wheels/ (git-ignored), for CPython 3.10 3.11 3.12 3.13
#   GPU_WHEELS_PYTHONS="3.12" GPU_WHEELS=/some/dir scripts/gpu-wheels.sh
#
# What it downloads: the check's own dependencies with the version bounds pyproject.toml gives them (node
# profile: psutil, nvidia-ml-py, grpcio, protobuf, click; test extra: pytest, pytest-timeout), their
# dependencies, and pip itself (a Python without pip runs pip from its wheel: `python pip-*.whl/pip`).
# The folder is replaced as a whole (no stale wheels), with SHA256SUMS (gpu-check.sh verifies it before
# installing), requirements.txt (the specifiers) and MANIFEST.txt ("<python> <wheel>": what each version uses).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${GPU_WHEELS:-gpu-wheels}
PYTHONS=${GPU_WHEELS_PYTHONS:-"3.10 3.11 3.12 3.13"}
PLATFORM=manylinux2014_x86_64   # glibc >= 2.17: any current GPU image; pip also accepts older manylinux tags
# The Python that runs pip here; it needs 3.11+ (tomllib, to read pyproject.toml) and `packaging`.
if [ -n "${PYTHON:-}" ]; then HOST_PY=$PYTHON
elif [ -x .venv/bin/python ]; then HOST_PY=.venv/bin/python
else HOST_PY=python3
fi

# The check's dependencies, with pyproject.toml's bounds (one source of truth for the versions).
requirements() {
  "$HOST_PY" - <<'PYEOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
wanted = ("psutil", "nvidia-ml-py", "grpcio", "protobuf", "click", "pytest", "pytest-timeout")
specs = project["dependencies"] + project["optional-dependencies"]["test"]
by_name = {re.split(r"[<>=!~; \[]", s, maxsplit=1)[0].lower(): s for s in specs}
missing = [w for w in wanted if w not in by_name]
if missing:
    raise SystemExit(f"pyproject.toml no longer lists {', '.join(missing)}: update scripts/gpu-wheels.sh")
print("\n".join(by_name[w] for w in wanted))
print("pip")
PYEOF
}

# closure DIR VERSION REQFILE: walk the requirements as CPython VERSION on x86_64 Linux would, through the
# wheels in DIR. Why: `pip download --python-version` applies the TARGET version to Requires-Python but
# evaluates environment markers against THIS interpreter, so pytest's `tomli; python_version < "3.11"` is
# silently left out for 3.10 when this machine runs 3.11. Prints "MISSING <spec>" for each requirement no
# wheel in DIR satisfies, else one "<version> <wheel>" line per wheel the closure uses (for MANIFEST.txt).
closure() {
  "$HOST_PY" - "$@" <<'PYEOF'
import email.parser
import os
import sys
import zipfile

try:
    from packaging import tags, utils
    from packaging.requirements import Requirement
except ImportError:  # pip always vendors it
    from pip._vendor.packaging import tags, utils
    from pip._vendor.packaging.requirements import Requirement

folder, version, reqfile = sys.argv[1:4]
major, minor = (int(x) for x in version.split(".")[:2])
env = {"python_version": f"{major}.{minor}", "python_full_version": f"{major}.{minor}.0",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "extra": ""}
platforms = [f"manylinux_2_{n}_x86_64" for n in range(17, 4, -1)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
supported = set(tags.cpython_tags((major, minor), platforms=platforms))
supported |= set(tags.compatible_tags((major, minor), f"cp{major}{minor}", platforms=platforms))

wheels = {}  # normalized name -> [(version, file, metadata)]
for f in sorted(os.listdir(folder)):
    if not f.endswith(".whl"):
        continue
    name, ver, _, wtags = utils.parse_wheel_filename(f)
    if wtags & supported:
        with zipfile.ZipFile(os.path.join(folder, f)) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
        wheels.setdefault(name, []).append((ver, f, meta))

todo = [Requirement(line) for line in open(reqfile).read().splitlines() if line.strip()]
seen, used, missing = set(), [], []
while todo:
    req = todo.pop()
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    name = utils.canonicalize_name(req.name)
    ok = [w for w in wheels.get(name, []) if req.specifier.contains(w[0], prereleases=True)]
    if not ok:
        missing.append(f"{req.name}{req.specifier}")   # the marker held: pass it on without it
        continue
    ver, f, meta = max(ok, key=lambda w: w[0])
    if f in seen:
        continue
    seen.add(f)
    used.append(f)
    todo.extend(Requirement(r) for r in meta.get_all("Requires-Dist") or [])
for spec in missing:
    print("MISSING", spec)
if not missing:
    for f in sorted(used):
        print(version, f)
PYEOF
}

# download DEST VERSION ARGS...: pip download for CPython VERSION; quiet unless it fails.
download() {
  local dest=$1 v=$2
  shift 2
  "$HOST_PY" -m pip download --disable-pip-version-check --no-input --only-binary=:all: \
    --platform "$PLATFORM" --python-version "$v" --implementation cp --abi "cp${v/./}" --abi abi3 --abi none \
    --dest "$dest" "$@" > "$dest/pip.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$dest/pip.log"; echo "pip download for CPython $v failed (above)"; exit 1; }
  rm -f "$dest/pip.log"
}

main() {
  local tmp v out
  tmp=$(mktemp -d "${DEST%/}.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  requirements > "$tmp/requirements.txt"
  echo "== requirements (from pyproject.toml): $(tr '\n' ' ' < "$tmp/requirements.txt")"
  : > "$tmp/MANIFEST.txt"
  for v in $PYTHONS; do
    echo "== CPython $v ($PLATFORM)"
    # --only-binary: nothing is ever built on the device; --platform/--python-version: wheels for THAT
    # interpreter, not this one. A pure-python wheel shared by several versions is stored once.
    download "$tmp" "$v" -r "$tmp/requirements.txt"
    for _ in 1 2 3 4 5; do   # fetch what the markers pip misjudged left out, until the closure is whole
      out=$(closure "$tmp" "$v" "$tmp/requirements.txt")
      grep -q '^MISSING ' <<<"$out" || break
      echo "   also for $v (marker-dependent): $(sed -n 's/^MISSING //p' <<<"$out" | tr '\n' ' ')"
      # shellcheck disable=SC2046  # one argument per specifier
      download "$tmp" "$v" --no-deps $(sed -n 's/^MISSING //p' <<<"$out")
    done
    grep -q '^MISSING ' <<<"$out" && { echo "CPython $v: still missing after 5 rounds: $out"; exit 1; }
    printf '%s\n' "$out" >> "$tmp/MANIFEST.txt"
    echo "   $(wc -l <<<"$out") wheels"
  done
  (cd "$tmp" && sha256sum ./*.whl > SHA256SUMS)
  rm -rf "$DEST"
  mv "$tmp" "$DEST"
  trap - EXIT
  echo "== $DEST: $(find "$DEST" -name '*.whl' | wc -l) wheels, $(du -sh "$DEST" | cut -f1) ($(du -sb "$DEST" | cut -f1) bytes)"
  echo "   carry it to the GPU machine with the working tree (device tool: carry [\"$DEST\"])"
}

main "$@"
