"""gRPC server reflection under both of its names: grpc.reflection.v1 and v1alpha.

grpcio-reflection ships only v1alpha, while current clients (grpcurl, Postman, grpcui)
ask v1 first. v1 is v1alpha under another package name: the same messages, field for
field, so one servicer answers both and the bytes on the wire are alike. v1's
descriptor is v1alpha's with the package renamed, added once to the default descriptor
pool, so reflection describes itself under both names too.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import ServiceDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

_ALPHA = reflection_pb2.DESCRIPTOR
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1_PACKAGE = "grpc.reflection.v1"


def _v1_descriptor() -> ServiceDescriptor:
    """grpc.reflection.v1.ServerReflection, added to the default pool if not there."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.Add(_renamed(_ALPHA))
    return pool.FindServiceByName(f"{_V1_PACKAGE}.ServerReflection")


def _renamed(alpha) -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file as v1's: its name, package and type references renamed."""
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, _V1_PACKAGE
    proto.ClearField("options")
    old, new = f".{alpha.package}.", f".{_V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new, 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    return proto


V1 = _v1_descriptor()
V1ALPHA = _ALPHA.services_by_name["ServerReflection"]


def enable(service_names: list[str], server: grpc.aio.Server) -> None:
    """Serve reflection of `service_names` (which should name both reflection
    services) on `server`, as v1 and as v1alpha."""
    servicer = reflection.aio.ReflectionServicer(service_names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    handlers = {"ServerReflectionInfo": info}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1.full_name, handlers),))
    server.add_registered_method_handlers(V1.full_name, handlers)
