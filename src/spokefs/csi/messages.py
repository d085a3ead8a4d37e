"""The CSI messages and services the node driver speaks (csi.v1), built at runtime.

``csi.proto`` beside this file is the readable form: the subset of the CSI spec's csi.proto
that spokefs serves, with the spec's names and field numbers, so a kubelet talks to it
unchanged. The same declarations are made here as a ``FileDescriptorProto`` and turned into
message classes by protobuf itself (``message_factory``), in a pool of their own.

Why not committed ``*_pb2.py`` from grpcio-tools: generated code refuses to load on a protobuf
runtime older than the compiler that made it (7.35 today), which would tie the driver to the
newest protobuf, while descriptors built here load on any protobuf from 4.21 on; no generated
blob to review, and a pool of their own cannot clash with another library's ``csi.proto`` in
protobuf's default pool. tests/test_csi.py compiles csi.proto with grpcio-tools (where
installed) and checks that it declares exactly what this module builds.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

PACKAGE = "csi.v1"
FILE_NAME = "csi.proto"

_F = descriptor_pb2.FieldDescriptorProto
_STRING, _BOOL, _INT64 = _F.TYPE_STRING, _F.TYPE_BOOL, _F.TYPE_INT64
_MESSAGE, _ENUM = _F.TYPE_MESSAGE, _F.TYPE_ENUM


def _camel(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


class _Msg:
    """One message declaration: fields, nested messages and enums, oneofs."""

    def __init__(self, name: str) -> None:
        self.proto = descriptor_pb2.DescriptorProto(name=name)

    def field(self, name: str, number: int, kind: int, type_name: str = "", *,
              repeated: bool = False, oneof: str | None = None) -> _Msg:
        f = self.proto.field.add(name=name, number=number, type=kind,
                                 label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
        if type_name:
            f.type_name = type_name if type_name.startswith(".") else f".{PACKAGE}.{type_name}"
        if oneof is not None:
            names = [o.name for o in self.proto.oneof_decl]
            if oneof not in names:
                self.proto.oneof_decl.add(name=oneof)
                names.append(oneof)
            f.oneof_index = names.index(oneof)
        return self

    def string_map(self, name: str, number: int) -> _Msg:
        """``map<string, string> name = number``: a repeated field of a nested entry type."""
        entry = self.proto.nested_type.add(name=f"{_camel(name)}Entry")
        entry.field.add(name="key", number=1, type=_STRING, label=_F.LABEL_OPTIONAL)
        entry.field.add(name="value", number=2, type=_STRING, label=_F.LABEL_OPTIONAL)
        entry.options.map_entry = True
        return self.field(name, number, _MESSAGE, f"{self.proto.name}.{entry.name}",
                          repeated=True)

    def nested(self, *messages: _Msg) -> _Msg:
        for m in messages:
            self.proto.nested_type.add().CopyFrom(m.proto)
        return self

    def enum(self, name: str, *values: str) -> _Msg:
        e = self.proto.enum_type.add(name=name)
        for number, value in enumerate(values):
            e.value.add(name=value, number=number)
        return self


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3",
                                           dependency=["google/protobuf/wrappers.proto"])
    svc = "PluginCapability.Service"
    rpc = "NodeServiceCapability.RPC"
    cap = "VolumeCapability"
    messages = [
        _Msg("GetPluginInfoRequest"),
        _Msg("GetPluginInfoResponse").field("name", 1, _STRING)
        .field("vendor_version", 2, _STRING).string_map("manifest", 3),
        _Msg("GetPluginCapabilitiesRequest"),
        _Msg("GetPluginCapabilitiesResponse")
        .field("capabilities", 1, _MESSAGE, "PluginCapability", repeated=True),
        _Msg("PluginCapability").nested(
            _Msg("Service").enum("Type", "UNKNOWN", "CONTROLLER_SERVICE",
                                 "VOLUME_ACCESSIBILITY_CONSTRAINTS", "GROUP_CONTROLLER_SERVICE")
            .field("type", 1, _ENUM, f"{svc}.Type"))
        .field("service", 1, _MESSAGE, svc, oneof="type"),
        _Msg("ProbeRequest"),
        _Msg("ProbeResponse").field("ready", 1, _MESSAGE, ".google.protobuf.BoolValue"),
        _Msg(cap).nested(
            _Msg("BlockVolume"),
            _Msg("MountVolume").field("fs_type", 1, _STRING)
            .field("mount_flags", 2, _STRING, repeated=True)
            .field("volume_mount_group", 3, _STRING),
            _Msg("AccessMode").enum("Mode", "UNKNOWN", "SINGLE_NODE_WRITER",
                                    "SINGLE_NODE_READER_ONLY", "MULTI_NODE_READER_ONLY",
                                    "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER",
                                    "SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER")
            .field("mode", 1, _ENUM, f"{cap}.AccessMode.Mode"))
        .field("block", 1, _MESSAGE, f"{cap}.BlockVolume", oneof="access_type")
        .field("mount", 2, _MESSAGE, f"{cap}.MountVolume", oneof="access_type")
        .field("access_mode", 3, _MESSAGE, f"{cap}.AccessMode"),
        _Msg("Topology").string_map("segments", 1),
        _Msg("NodePublishVolumeRequest").field("volume_id", 1, _STRING)
        .string_map("publish_context", 2).field("staging_target_path", 3, _STRING)
        .field("target_path", 4, _STRING).field("volume_capability", 5, _MESSAGE, cap)
        .field("readonly", 6, _BOOL).string_map("secrets", 7).string_map("volume_context", 8),
        _Msg("NodePublishVolumeResponse"),
        _Msg("NodeUnpublishVolumeRequest").field("volume_id", 1, _STRING)
        .field("target_path", 2, _STRING),
        _Msg("NodeUnpublishVolumeResponse"),
        _Msg("NodeGetCapabilitiesRequest"),
        _Msg("NodeGetCapabilitiesResponse")
        .field("capabilities", 1, _MESSAGE, "NodeServiceCapability", repeated=True),
        _Msg("NodeServiceCapability").nested(
            _Msg("RPC").enum("Type", "UNKNOWN", "STAGE_UNSTAGE_VOLUME", "GET_VOLUME_STATS",
                             "EXPAND_VOLUME", "VOLUME_CONDITION", "SINGLE_NODE_MULTI_WRITER",
                             "VOLUME_MOUNT_GROUP")
            .field("type", 1, _ENUM, f"{rpc}.Type"))
        .field("rpc", 1, _MESSAGE, rpc, oneof="type"),
        _Msg("NodeGetInfoRequest"),
        _Msg("NodeGetInfoResponse").field("node_id", 1, _STRING)
        .field("max_volumes_per_node", 2, _INT64)
        .field("accessible_topology", 3, _MESSAGE, "Topology"),
    ]
    for m in messages:
        f.message_type.add().CopyFrom(m.proto)
    for service, methods in SERVICES.items():
        s = f.service.add(name=service)
        for method in methods:
            s.method.add(name=method, input_type=f".{PACKAGE}.{method}Request",
                         output_type=f".{PACKAGE}.{method}Response")
    return f


# The calls served, by service; each takes METHODRequest and answers METHODResponse.
SERVICES: dict[str, tuple[str, ...]] = {
    "Identity": ("GetPluginInfo", "GetPluginCapabilities", "Probe"),
    "Node": ("NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities", "NodeGetInfo"),
}

FILE = _file()
_pool = descriptor_pool.DescriptorPool()
_pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
_classes: dict[str, Any] = message_factory.GetMessages([FILE], pool=_pool)


def message(name: str) -> Any:
    """The message class of ``csi.v1.NAME`` (nested: ``PluginCapability.Service``)."""
    top, *inner = name.split(".")
    cls = _classes[f"{PACKAGE}.{top}"]
    for part in inner:
        cls = getattr(cls, part)
    return cls


GetPluginInfoRequest = message("GetPluginInfoRequest")
GetPluginInfoResponse = message("GetPluginInfoResponse")
GetPluginCapabilitiesRequest = message("GetPluginCapabilitiesRequest")
GetPluginCapabilitiesResponse = message("GetPluginCapabilitiesResponse")
PluginCapability = message("PluginCapability")
ProbeRequest = message("ProbeRequest")
ProbeResponse = message("ProbeResponse")
VolumeCapability = message("VolumeCapability")
NodePublishVolumeRequest = message("NodePublishVolumeRequest")
NodePublishVolumeResponse = message("NodePublishVolumeResponse")
NodeUnpublishVolumeRequest = message("NodeUnpublishVolumeRequest")
NodeUnpublishVolumeResponse = message("NodeUnpublishVolumeResponse")
NodeGetCapabilitiesRequest = message("NodeGetCapabilitiesRequest")
NodeGetCapabilitiesResponse = message("NodeGetCapabilitiesResponse")
NodeServiceCapability = message("NodeServiceCapability")
NodeGetInfoRequest = message("NodeGetInfoRequest")
NodeGetInfoResponse = message("NodeGetInfoResponse")
