"""Framing of Kafka requests and responses, the API versions txmq serves,
and Kafka's error codes.

A frame on the wire is ``size i32`` then ``size`` bytes. A request is
request header v1 (``api_key i16, api_version i16, correlation_id i32,
client_id`` i16-length nullable string) or, for a flexible version, v2
(v1 then a tagged-field section), then the body. A response is response
header v0 (``correlation_id i32``) or v1 (v0 + tagged fields, flexible
versions except ApiVersions), then the body. The bodies follow
``txmq.kafka.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass

from txmq import _kafka
from txmq.kafka import schema

# The versions served: exact ranges, advertised by ApiVersions.
SUPPORTED = {
    "Produce": (3, 9),
    "Fetch": (4, 12),
    "ListOffsets": (1, 6),
    "Metadata": (0, 12),
    "OffsetCommit": (2, 8),
    "OffsetFetch": (1, 7),
    "FindCoordinator": (0, 4),
    "JoinGroup": (0, 9),
    "Heartbeat": (0, 4),
    "LeaveGroup": (0, 5),
    "SyncGroup": (0, 5),
    "ApiVersions": (0, 4),
    "CreateTopics": (0, 7),
    "DeleteTopics": (0, 6),
    "InitProducerId": (0, 5),
    "AddPartitionsToTxn": (0, 3),
    "AddOffsetsToTxn": (0, 3),
    "EndTxn": (0, 4),
    "TxnOffsetCommit": (0, 3),
    "DescribeConfigs": (0, 4),
    "SaslHandshake": (1, 1),
    "SaslAuthenticate": (0, 2),
}
SUPPORTED_KEYS = {schema.API_KEYS[name]: r for name, r in SUPPORTED.items()}
API_VERSIONS_KEY = schema.API_KEYS["ApiVersions"]
SASL_HANDSHAKE_KEY = schema.API_KEYS["SaslHandshake"]
SASL_AUTHENTICATE_KEY = schema.API_KEYS["SaslAuthenticate"]
# What a connection may send before it has authenticated (with a users file).
BEFORE_AUTHENTICATION = frozenset({API_VERSIONS_KEY, SASL_HANDSHAKE_KEY, SASL_AUTHENTICATE_KEY})
PRODUCE_KEY = schema.API_KEYS["Produce"]

SIZE_BYTES = 4
HEADER_MIN_BYTES = 8          # api key, version, correlation id


class Error:
    """Kafka error codes (the protocol guide's table) that txmq answers."""
    UNKNOWN_SERVER_ERROR = -1
    NONE = 0
    OFFSET_OUT_OF_RANGE = 1
    CORRUPT_MESSAGE = 2
    UNKNOWN_TOPIC_OR_PARTITION = 3
    MESSAGE_TOO_LARGE = 10
    COORDINATOR_NOT_AVAILABLE = 15
    NOT_COORDINATOR = 16
    INVALID_TOPIC_EXCEPTION = 17
    ILLEGAL_GENERATION = 22
    INCONSISTENT_GROUP_PROTOCOL = 23
    INVALID_GROUP_ID = 24
    UNKNOWN_MEMBER_ID = 25
    INVALID_SESSION_TIMEOUT = 26
    REBALANCE_IN_PROGRESS = 27
    TOPIC_AUTHORIZATION_FAILED = 29
    GROUP_AUTHORIZATION_FAILED = 30
    UNSUPPORTED_SASL_MECHANISM = 33
    ILLEGAL_SASL_STATE = 34
    UNSUPPORTED_VERSION = 35
    TOPIC_ALREADY_EXISTS = 36
    INVALID_PARTITIONS = 37
    INVALID_REPLICATION_FACTOR = 38
    INVALID_REQUEST = 42
    INVALID_CONFIG = 40
    OUT_OF_ORDER_SEQUENCE_NUMBER = 45
    DUPLICATE_SEQUENCE_NUMBER = 46
    INVALID_PRODUCER_EPOCH = 47
    INVALID_TXN_STATE = 48
    INVALID_PRODUCER_ID_MAPPING = 49
    INVALID_TRANSACTION_TIMEOUT = 50
    CONCURRENT_TRANSACTIONS = 51
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
    SASL_AUTHENTICATION_FAILED = 58
    UNKNOWN_PRODUCER_ID = 59
    MEMBER_ID_REQUIRED = 79
    UNSTABLE_OFFSET_COMMIT = 88
    PRODUCER_FENCED = 90


@dataclass
class Request:
    """One decoded request."""
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: dict | None              # None: not decoded (an API or version not served)


def decode_request(frame: bytes) -> Request:
    """Decode a request frame (without its size prefix). An API key or
    version txmq does not serve leaves ``body`` None; a malformed frame
    raises :class:`txmq.errors.KafkaProtocolError`."""
    key, version, corr, client_id, pos = _kafka.read_request_header(frame)
    served = SUPPORTED_KEYS.get(key)
    if served is None or not served[0] <= version <= served[1]:
        return Request(key, version, corr, client_id, None)
    r = _kafka.Reader(frame, pos, "request")
    if schema.is_flexible(key, version):
        _kafka.skip_tagged(r)
    body = _kafka.read_struct(r, schema.request(key, version))
    # Bytes after the body are ignored, as Kafka's brokers do: librdkafka's
    # Metadata v12 carries a field the version no longer has.
    return Request(key, version, corr, client_id, body)


def encode_response(api_key: int, version: int, correlation_id: int, body: dict) -> bytes:
    """A whole response frame, size prefix included."""
    w = _kafka.Writer(512)
    _kafka.write_i32(w, 0)                     # the size, filled in below
    _kafka.write_i32(w, correlation_id)
    if api_key != API_VERSIONS_KEY and schema.is_flexible(api_key, version):
        _kafka.write_uvarint(w, 0)             # response header v1: no tagged fields
    _kafka.write_struct(w, body, schema.response(api_key, version))
    return w.framed()


def api_versions_body(error_code: int = Error.NONE) -> dict:
    """The ApiVersions answer: every API served with its exact range."""
    return {"error_code": error_code, "throttle_time_ms": 0,
            "api_keys": [{"api_key": k, "min_version": lo, "max_version": hi}
                         for k, (lo, hi) in sorted(SUPPORTED_KEYS.items())]}


def unsupported_response(req: Request) -> bytes:
    """The answer to an API key or version txmq does not serve.

    ApiVersions at a version above ours: an ApiVersions v0 body with
    UNSUPPORTED_VERSION and our ranges (Kafka's own behaviour; the client
    retries at a version we list). A known API at another version Kafka
    defines: that version's response with every top-level error code
    UNSUPPORTED_VERSION and empty lists. Anything else (an unknown key, a
    version Kafka does not define): the correlation id then an i16
    UNSUPPORTED_VERSION, which a client reports as that error.
    """
    if req.api_key == API_VERSIONS_KEY:
        return encode_response(API_VERSIONS_KEY, 0, req.correlation_id,
                               api_versions_body(Error.UNSUPPORTED_VERSION))
    if req.api_key in schema.APIS:
        lo, hi = schema.valid_versions(req.api_key)
        if lo <= req.api_version <= hi:
            body = {f[0]: Error.UNSUPPORTED_VERSION
                    for f in schema.response(req.api_key, req.api_version)[0] if f[0] == "error_code"}
            return encode_response(req.api_key, req.api_version, req.correlation_id, body)
    raw = req.correlation_id.to_bytes(4, "big", signed=True) + Error.UNSUPPORTED_VERSION.to_bytes(2, "big")
    return len(raw).to_bytes(4, "big") + raw
