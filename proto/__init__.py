"""Generated wire-protocol code (package ``gpuagent.v1``). Regenerate with scripts/gen_proto.sh."""

from gpuagent.proto import gpuagent_pb2 as pb  # noqa: F401
from gpuagent.proto import gpuagent_pb2_grpc as pb_grpc  # noqa: F401
