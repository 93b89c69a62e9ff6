"""Compiled request and response schemas of the Kafka APIs txmq serves.

``schema_data`` holds Kafka's own definitions (generated from its message
JSON; see that module). This module turns one (API, version, direction)
into the compact tuples the Cython codec (``txmq._kafka``) interprets, once
per version, and says which header versions frame it:

- request header v1 (api key i16, version i16, correlation id i32, client
  id as a nullable i16-length string), v2 = v1 + tagged fields, for
  flexible versions;
- response header v0 (correlation id i32), v1 = v0 + tagged fields for
  flexible versions, except ApiVersions, always answered with v0 (a client
  reads it before it knows what the broker speaks).
"""

from __future__ import annotations

from functools import lru_cache

from txmq import _kafka
from txmq.kafka.schema_data import APIS, EXTRA

_K = {k.name: int(k) for k in _kafka.Kind}
_KINDS = {
    "bool": _K["K_BOOL"], "int8": _K["K_INT8"], "int16": _K["K_INT16"], "uint16": _K["K_UINT16"],
    "int32": _K["K_INT32"], "uint32": _K["K_UINT32"], "int64": _K["K_INT64"],
    "float64": _K["K_FLOAT64"], "string": _K["K_STRING"], "bytes": _K["K_BYTES"],
    "records": _K["K_RECORDS"], "uuid": _K["K_UUID"], "struct": _K["K_STRUCT"],
}

API_NAMES = {key: spec[0] for key, spec in APIS.items()}
API_KEYS = {name: key for key, name in API_NAMES.items()}


def in_versions(spec: str, version: int) -> bool:
    """Whether ``version`` is in a version range of the definitions:
    ``"3+"``, ``"0-4"``, ``"5"`` or ``"none"``."""
    if spec in ("none", ""):
        return False
    if spec.endswith("+"):
        return version >= int(spec[:-1])
    lo, _, hi = spec.partition("-")
    return int(lo) <= version <= int(hi or lo)


def version_range(spec: str) -> tuple:
    lo, _, hi = spec.partition("-")
    return int(lo), int(hi or lo)


def _default(typ: str, default: str, nullable: bool):
    if typ.startswith("[]"):
        return None if default == "null" else []
    if default == "null":
        return None
    if typ == "bool":
        return default == "true"
    if typ in ("int8", "int16", "uint16", "int32", "uint32", "int64"):
        return int(default, 0) if default else 0
    if typ == "float64":
        return float(default) if default else 0.0
    if typ == "string":
        return default
    if typ == "uuid":
        return bytes(16)
    if typ in ("bytes", "records"):
        return b""
    return {}


def _compile(fields: tuple, version: int, flexible: bool) -> tuple:
    plain, tagged = [], {}
    for name, typ, versions, nullable_v, tagged_v, tag, flexible_v, default, sub in fields:
        if not in_versions(versions, version):
            continue
        nullable = in_versions(nullable_v, version)
        compact = flexible and flexible_v != "none"
        is_array = typ.startswith("[]")
        base = typ[2:] if is_array else typ
        kind = _K["K_ARRAY"] if is_array else _KINDS[base]
        elem = _KINDS[base] if is_array else 0
        children = _compile(sub, version, flexible) if sub is not None else None
        entry = (name, kind, elem, nullable, compact, tag, _default(typ, default, nullable), children)
        if flexible and in_versions(tagged_v, version):
            tagged[tag] = entry
        else:
            plain.append(entry)
    return tuple(plain), (tagged if flexible else None)


def valid_versions(api_key: int) -> tuple:
    """(min, max) of the versions Kafka defines for an API."""
    return version_range(APIS[api_key][1][0])


def is_flexible(api_key: int, version: int) -> bool:
    return in_versions(APIS[api_key][1][1], version)


@lru_cache(maxsize=None)
def request(api_key: int, version: int) -> tuple:
    """The compiled request body schema of ``api_key`` at ``version``."""
    spec = APIS[api_key][1]
    return _compile(spec[2], version, in_versions(spec[1], version))


@lru_cache(maxsize=None)
def response(api_key: int, version: int) -> tuple:
    """The compiled response body schema of ``api_key`` at ``version``."""
    spec = APIS[api_key][2]
    return _compile(spec[2], version, in_versions(spec[1], version))


@lru_cache(maxsize=None)
def consumer_protocol(name: str, version: int) -> tuple:
    """ConsumerProtocolSubscription / ConsumerProtocolAssignment: what the
    classic group protocol's members put in their metadata and assignment
    bytes (an i16 version, then this struct)."""
    spec = EXTRA[name]
    return _compile(spec[2], version, False)
