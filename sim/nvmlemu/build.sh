#!/bin/sh
# Builds the SYNTHETIC NVML emulator (README.md): build.sh PYTHON OUTDIR
#   OUTDIR/libnvidia-ml.so.1         driver profile r550 (every entry point)
#   OUTDIR/old/libnvidia-ml.so.1     profile "old": the newer entry points are not exported
#   OUTDIR/cuda14/libnvidia-ml.so.1  profile "cuda14": the symbols nvml.h 13.x deprecates are not exported
#   OUTDIR/symbols.txt               every exported symbol and its flags (read by the Python controller)
# Compiled with the system cc against NVIDIA's nvml.h from the PyPI package nvidia-nvml-dev, found
# through PYTHON (or given as NVML_INCLUDE=dir). Files are renamed into place, so a process that is
# loading the old library is never handed a half-written one.
set -eu
PY=${1:?usage: build.sh PYTHON OUTDIR}
OUT=${2:?usage: build.sh PYTHON OUTDIR}
CC=${CC:-cc}
SRC=$(cd "$(dirname "$0")" && pwd)

if ! command -v "$CC" >/dev/null 2>&1; then
    echo "make nvmlemu: no C compiler '$CC' on PATH; install one (Debian: apt-get install gcc)." >&2
    exit 1
fi
INC=${NVML_INCLUDE:-}
if [ -z "$INC" ]; then
    INC=$("$PY" -c 'import importlib.metadata as m, os
f = [p for p in (m.files("nvidia-nvml-dev") or []) if p.name == "nvml.h"]
print(os.path.dirname(str(f[0].locate())) if f else "")' 2>/dev/null || true)
fi
if [ -z "$INC" ] || [ ! -f "$INC/nvml.h" ]; then
    echo "make nvmlemu: NVIDIA's nvml.h was not found; install the test extra (make install) or '$PY -m pip install nvidia-nvml-dev'." >&2
    exit 1
fi

mkdir -p "$OUT"
TMP=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
CFLAGS="-std=c11 -O2 -g -fPIC -Wall -Wextra -Werror -Wmissing-prototypes -Wstrict-prototypes -Wno-unused-parameter"
for f in nvmlemu_core nvmlemu_api; do
    "$CC" $CFLAGS -isystem "$INC" -I "$SRC" -c "$SRC/$f.c" -o "$TMP/$f.o"
done
"$CC" -std=c11 -O1 -Wall -Werror -I "$SRC" "$SRC/mapgen.c" -o "$TMP/mapgen"
"$TMP/mapgen" list > "$TMP/symbols.txt"
for profile in r550 old cuda14; do
    "$TMP/mapgen" map "$profile" > "$TMP/$profile.map"
    mkdir -p "$TMP/$profile"
    "$CC" -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -Wl,--version-script="$TMP/$profile.map" -Wl,-z,defs \
        -o "$TMP/$profile/libnvidia-ml.so.1" "$TMP/nvmlemu_core.o" "$TMP/nvmlemu_api.o" -lpthread
done
mkdir -p "$OUT/old" "$OUT/cuda14"
mv -f "$TMP/old/libnvidia-ml.so.1" "$OUT/old/libnvidia-ml.so.1"
mv -f "$TMP/cuda14/libnvidia-ml.so.1" "$OUT/cuda14/libnvidia-ml.so.1"
mv -f "$TMP/symbols.txt" "$OUT/symbols.txt"
mv -f "$TMP/r550/libnvidia-ml.so.1" "$OUT/libnvidia-ml.so.1"
echo "nvmlemu: built $OUT/libnvidia-ml.so.1 (+ old/, cuda14/) against $INC/nvml.h"
