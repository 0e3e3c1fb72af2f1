"""Decoding of the few protobuf request bodies real clients send to the emulator.

kubectl's ``create <generator>`` commands and helm's release storage (Secrets) send built-in objects
as Kubernetes protobuf (``application/vnd.kubernetes.protobuf``) with no JSON fallback. This decodes
those kinds (Namespace, ConfigMap, Secret, ServiceAccount, DeleteOptions) into the JSON form; anything else gets a
415 from the emulator. Responses are always JSON, which these clients accept.

Field numbers are those of k8s.io/api's generated.proto files.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Callable
from typing import Any

MAGIC = b"k8s\x00"

JsonObj = dict[str, Any]


class ProtobufError(ValueError):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of one message; length-delimited values stay bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = _varint(data, pos)
            out.append((number, data[pos : pos + length]))
            pos += length
        elif wire == 1:
            out.append((number, int.from_bytes(data[pos : pos + 8], "little")))
            pos += 8
        elif wire == 5:
            out.append((number, int.from_bytes(data[pos : pos + 4], "little")))
            pos += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _str(v: Any) -> str:
    return bytes(v).decode()


def _map(decode_value: Callable[[Any], Any]) -> Callable[[list[Any]], dict[str, Any]]:
    def decode(entries: list[Any]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for entry in entries:
            kv = dict(fields(entry))
            result[_str(kv.get(1, b""))] = decode_value(kv.get(2, b""))
        return result

    return decode


def _time(v: Any) -> str:
    seconds = dict(fields(v)).get(1, 0)
    assert isinstance(seconds, int)
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# A schema maps field numbers to (json name, decoder, repeated?).
Schema = dict[int, tuple[str, Callable[[Any], Any], bool]]


def _message(schema: Schema) -> Callable[[Any], JsonObj]:
    def decode(data: Any) -> JsonObj:
        result: JsonObj = {}
        grouped: dict[int, list[Any]] = {}
        for number, value in fields(bytes(data)):
            grouped.setdefault(number, []).append(value)
        for number, values in grouped.items():
            if number not in schema:
                continue
            name, decoder, repeated = schema[number]
            if getattr(decoder, "is_map", False):
                result[name] = decoder(values)
            elif repeated:
                result[name] = [decoder(v) for v in values]
            else:
                value = decoder(values[-1])
                # The Go marshaller writes empty strings and zeros; JSON omits them (omitempty).
                if value not in ("", 0, False) or isinstance(value, dict):
                    result[name] = value
        return result

    return decode


def _as_map(decoder: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    decoder.is_map = True  # type: ignore[attr-defined]
    return decoder


def _bool(v: Any) -> bool:
    return bool(v)


def _b64(v: Any) -> str:
    return base64.b64encode(bytes(v)).decode()


_OWNER_REF = _message(
    {
        1: ("kind", _str, False),
        3: ("name", _str, False),
        4: ("uid", _str, False),
        5: ("apiVersion", _str, False),
        6: ("controller", _bool, False),
        7: ("blockOwnerDeletion", _bool, False),
    }
)
_OBJECT_META = _message(
    {
        1: ("name", _str, False),
        2: ("generateName", _str, False),
        3: ("namespace", _str, False),
        5: ("uid", _str, False),
        6: ("resourceVersion", _str, False),
        7: ("generation", int, False),
        8: ("creationTimestamp", _time, False),
        11: ("labels", _as_map(_map(_str)), False),
        12: ("annotations", _as_map(_map(_str)), False),
        13: ("ownerReferences", _OWNER_REF, True),
        14: ("finalizers", _str, True),
    }
)
_LOCAL_REF = _message({1: ("name", _str, False)})
_KINDS: dict[str, Callable[[Any], JsonObj]] = {
    "DeleteOptions": _message(
        {
            1: ("gracePeriodSeconds", int, False),
            2: ("preconditions", _message({1: ("uid", _str, False), 2: ("resourceVersion", _str, False)}), False),
            3: ("orphanDependents", _bool, False),
            4: ("propagationPolicy", _str, False),
            5: ("dryRun", _str, True),
        }
    ),
    "Namespace": _message(
        {1: ("metadata", _OBJECT_META, False), 2: ("spec", _message({1: ("finalizers", _str, True)}), False)}
    ),
    "ConfigMap": _message(
        {
            1: ("metadata", _OBJECT_META, False),
            2: ("data", _as_map(_map(_str)), False),
            3: ("binaryData", _as_map(_map(_b64)), False),
            4: ("immutable", _bool, False),
        }
    ),
    "Secret": _message(
        {
            1: ("metadata", _OBJECT_META, False),
            2: ("data", _as_map(_map(_b64)), False),
            3: ("type", _str, False),
            4: ("stringData", _as_map(_map(_str)), False),
            5: ("immutable", _bool, False),
        }
    ),
    "ServiceAccount": _message(
        {
            1: ("metadata", _OBJECT_META, False),
            3: ("imagePullSecrets", _LOCAL_REF, True),
            4: ("automountServiceAccountToken", _bool, False),
        }
    ),
}


def decode(body: bytes) -> JsonObj:
    """A protobuf-encoded Kubernetes object as JSON; ProtobufError for the kinds not handled here."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf envelope")
    unknown = dict(fields(body[len(MAGIC) :]))
    type_meta = dict(fields(bytes(unknown.get(1, b""))))  # type: ignore[arg-type]
    api_version, kind = _str(type_meta.get(1, b"")), _str(type_meta.get(2, b""))
    if kind not in _KINDS:
        raise ProtobufError(f"protobuf bodies of kind {kind!r} are not decodable here")
    obj = _KINDS[kind](unknown.get(2, b""))
    return {"apiVersion": api_version, "kind": kind, **obj}
