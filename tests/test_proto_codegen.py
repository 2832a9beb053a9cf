"""The checked-in generated proto code must equal what scripts/gen_proto.sh produces now."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_in_sync(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env)
    for name in ("gpuagent_pb2.py", "gpuagent_pb2.pyi", "gpuagent_pb2_grpc.py",
                 "podresources_pb2.py", "podresources_pb2.pyi", "podresources_pb2_grpc.py"):
        fresh = (tmp_path / name).read_text()
        checked_in = (ROOT / "proto" / name).read_text()
        assert fresh == checked_in, f"proto/{name} is stale: run `make proto` and commit the result"


def test_generated_code_imports_under_namespace():
    from gpuagent.proto import pb, pb_grpc

    batch = pb.Batch(node_id="n1", seq=3)
    batch.samples.ts_ns.extend([1, 2])
    assert pb.Batch.FromString(batch.SerializeToString()).samples.ts_ns == [1, 2]
    assert hasattr(pb_grpc, "CollectorStub")
