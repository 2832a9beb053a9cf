#!/usr/bin/env bash
# Regenerate the Python code for proto/gpuagent.proto and proto/podresources.proto (the kubelet's API, as
# gpuagent reads it) into OUT_DIR (default: proto/).
# The generated modules live in the gpuagent.proto package, so the grpc module's import is
# rewritten from the flat `import gpuagent_pb2` that protoc emits.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$here/proto}"
py="${PYTHON:-python3}"
mkdir -p "$out"
"$py" -m grpc_tools.protoc -I "$here/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$here/proto/gpuagent.proto" "$here/proto/podresources.proto"
sed -i 's/^import gpuagent_pb2 as gpuagent__pb2$/from gpuagent.proto import gpuagent_pb2 as gpuagent__pb2/' \
  "$out/gpuagent_pb2_grpc.py"
sed -i 's/^import podresources_pb2 as podresources__pb2$/from gpuagent.proto import podresources_pb2 as podresources__pb2/' \
  "$out/podresources_pb2_grpc.py"
