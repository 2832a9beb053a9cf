"""Registering the Collector service with request decoding that never raises.

The generated ``add_CollectorServicer_to_server`` decodes requests inside grpc, where a message that is
not valid protobuf becomes status UNKNOWN and a logged traceback. Here a request that does not decode
reaches the servicer as ``Undecodable``, which it answers with INVALID_ARGUMENT and one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from gpuagent.common.errors import first_line
from gpuagent.proto import pb

SERVICE = "gpuagent.v1.Collector"


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are not a valid message of the method's type."""
    type_name: str
    reason: str

    def sentence(self) -> str:
        return f"the request is not a valid {self.type_name} message ({self.reason})"


def _decoder(cls):
    def decode(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Undecodable(cls.DESCRIPTOR.full_name,
                               first_line(exc) if str(exc).strip() else "wire format is corrupt")
    return decode


def add_collector_servicer(servicer, server) -> None:
    """Register every method of the service as the .proto declares it, with never-raising decoders."""
    service = pb.DESCRIPTOR.services_by_name["Collector"]
    handlers = {}
    for method in service.methods:
        req_cls = getattr(pb, method.input_type.name)
        resp_cls = getattr(pb, method.output_type.name)
        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming,
                                                                       method.server_streaming)]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=_decoder(req_cls),
                                     response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
