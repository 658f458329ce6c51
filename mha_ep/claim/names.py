"""Node names as text, also when they are not UTF-8: stock ORT runs such nodes, protobuf hands their name over as
bytes or raises, and then the bytes are read from the node's wire format."""

from __future__ import annotations

import onnx


def node_name(node: onnx.NodeProto) -> str:
    """``node.name`` as text, odd bytes as backslash escapes. Stock ORT runs nodes whose names are not UTF-8;
    protobuf hands such a name over as bytes, or raises (then the bytes are read from the wire format)."""
    raw = _raw_name(node)
    return raw if isinstance(raw, str) else raw.decode("utf-8", "backslashreplace")

def _raw_name(node: onnx.NodeProto):
    """``node.name``: a str, or bytes when they are not UTF-8 (protobuf returns the bytes, or raises)."""
    try:
        return node.name
    except UnicodeDecodeError:
        return _name_bytes(node.SerializeToString())

def _name_bytes(wire: bytes) -> bytes:
    """Field 3 (``name``) of a serialised NodeProto."""
    position = 0

    def varint() -> int:
        nonlocal position
        value = shift = 0
        while True:
            byte = wire[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while position < len(wire):
        key = varint()
        field_number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            varint()
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length = varint()
            if field_number == 3:
                return wire[position : position + length]
            position += length
        else:
            break
    return b""
