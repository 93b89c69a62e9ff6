# cython: boundscheck=False, wraparound=False, cdivision=True
"""Kafka wire-protocol codec: request and response bodies.

Everything on Kafka's side is big-endian, as its protocol is (the
primitives are ``_bytes.pxd``'s ``be*`` / ``put*``).

**Bodies** are read and written by a schema interpreter. A compiled struct
(built by ``txmq.kafka.schema`` from the generated ``schema_data``) is a
pair ``(fields, tagged)``; each field is the tuple
``(name, kind, elem_kind, nullable, compact, tag, default, children)``
where ``children`` is the compiled struct of a struct or array-of-struct
field. ``compact`` selects the flexible encodings (unsigned-varint
lengths + 1, 0 meaning null); a flexible struct ends with its tagged
fields: ``uvarint count, count x (uvarint tag, uvarint size, value)``.

:class:`Writer` (declared in ``pyx/txmq/_kafka.pxd``) is also what
``txmq._kafka_records`` encodes record batches into. Record batches
themselves are that module's.

Every read goes through ``Reader._need``, which raises
:class:`txmq.errors.KafkaProtocolError`; so Cython's bounds checks are off
here.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Malloc, PyMem_Realloc, PyMem_Free
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int8_t, int16_t, int32_t, int64_t
from libc.string cimport memcpy

from txmq.errors import KafkaProtocolError

from _bytes cimport be16, be32, be64, put16, put32, put64


# Field kinds of a compiled schema (txmq.kafka.schema builds them).
cpdef enum Kind:
    K_BOOL = 1
    K_INT8 = 2
    K_INT16 = 3
    K_UINT16 = 4
    K_INT32 = 5
    K_UINT32 = 6
    K_INT64 = 7
    K_FLOAT64 = 8
    K_STRING = 9
    K_BYTES = 10
    K_RECORDS = 11
    K_UUID = 12
    K_STRUCT = 13
    K_ARRAY = 14

_MISSING = object()


# -- reading ------------------------------------------------------------------------------------

cdef class Reader:
    """A bounds-checked cursor over a bytes-like object (bytes, or the
    bytearray a large request was received into)."""
    cdef object buf
    cdef const unsigned char[::1] _view
    cdef const char *p
    cdef readonly Py_ssize_t size, pos
    cdef str what

    def __cinit__(self, buf, Py_ssize_t pos=0, str what="request"):
        self.buf = buf
        self._view = buf
        self.size = self._view.shape[0]
        self.p = <const char *>&self._view[0] if self.size else <const char *>b""
        self.pos = pos
        self.what = what

    cdef int _need(self, Py_ssize_t n) except -1:
        if n < 0 or self.pos + n > self.size:
            raise KafkaProtocolError(self.what, self.pos, f"needs {n} bytes, {self.size - self.pos} left")
        return 0

    cdef int8_t i8(self) except? -1:
        self._need(1)
        self.pos += 1
        return <int8_t>self.p[self.pos - 1]

    cdef int16_t i16(self) except? -1:
        self._need(2)
        self.pos += 2
        return <int16_t>be16(self.p + self.pos - 2)

    cdef int32_t i32(self) except? -1:
        self._need(4)
        self.pos += 4
        return <int32_t>be32(self.p + self.pos - 4)

    cdef int64_t i64(self) except? -1:
        self._need(8)
        self.pos += 8
        return <int64_t>be64(self.p + self.pos - 8)

    cdef uint64_t uvarint(self, int max_bytes) except? 0xFFFFFFFFFFFFFFFF:
        cdef uint64_t v = 0
        cdef int shift = 0, i
        cdef uint8_t b
        for i in range(max_bytes):
            self._need(1)
            b = <uint8_t>self.p[self.pos]
            self.pos += 1
            v |= <uint64_t>(b & 0x7F) << shift
            if not (b & 0x80):
                return v
            shift += 7
        raise KafkaProtocolError(self.what, self.pos, "varint longer than its type")

    cdef bytes take(self, Py_ssize_t n):
        self._need(n)
        self.pos += n
        return PyBytes_FromStringAndSize(self.p + self.pos - n, n)

    cdef object view(self, Py_ssize_t n):
        """The next ``n`` bytes as a memoryview of the buffer: record
        batches, megabytes each, are not copied out of their request."""
        self._need(n)
        self.pos += n
        return memoryview(self.buf)[self.pos - n:self.pos]

    cdef Py_ssize_t length(self, bint compact, bint wide) except -2:
        """A length prefix; -1 means null."""
        cdef Py_ssize_t n
        if compact:
            n = <Py_ssize_t>self.uvarint(5) - 1
        elif wide:
            n = self.i32()
        else:
            n = self.i16()
        if n < -1:
            raise KafkaProtocolError(self.what, self.pos, f"negative length {n}")
        return n

    def remaining(self) -> int:
        return self.size - self.pos


cdef object _read_value(Reader r, int kind, bint nullable, bint compact, tuple children, int elem_kind):
    cdef Py_ssize_t n, i
    cdef list out
    cdef bytes raw
    if kind == K_INT32:
        return r.i32()
    if kind == K_INT16:
        return r.i16()
    if kind == K_INT64:
        return r.i64()
    if kind == K_STRING:
        n = r.length(compact, False)
        if n < 0:
            if not nullable:
                raise KafkaProtocolError(r.what, r.pos, "null in a non-nullable string")
            return None
        raw = r.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise KafkaProtocolError(r.what, r.pos - n, "string is not UTF-8") from None
    if kind == K_ARRAY:
        n = r.length(compact, True)
        if n < 0:
            if not nullable:
                raise KafkaProtocolError(r.what, r.pos, "null in a non-nullable array")
            return None
        if n > r.size - r.pos:                 # every element takes at least a byte
            raise KafkaProtocolError(r.what, r.pos, f"array of {n} elements in {r.size - r.pos} bytes")
        out = []
        for i in range(n):
            if elem_kind == K_STRUCT:
                out.append(_read_struct(r, children))
            else:
                out.append(_read_value(r, elem_kind, False, compact, None, 0))
        return out
    if kind == K_STRUCT:
        return _read_struct(r, children)
    if kind == K_BYTES or kind == K_RECORDS:
        n = r.length(compact, True)
        if n < 0:
            if not nullable:
                raise KafkaProtocolError(r.what, r.pos, "null in non-nullable bytes")
            return None
        if kind == K_RECORDS:
            return r.view(n)
        return r.take(n)
    if kind == K_BOOL:
        return r.i8() != 0
    if kind == K_INT8:
        return r.i8()
    if kind == K_UINT16:
        return <uint16_t>r.i16()
    if kind == K_UINT32:
        return <uint32_t>r.i32()
    if kind == K_UUID:
        return r.take(16)
    if kind == K_FLOAT64:
        import struct
        return struct.unpack(">d", r.take(8))[0]
    raise KeyError(kind)


cdef dict _read_struct(Reader r, tuple compiled):
    cdef tuple fields = <tuple>compiled[0]
    cdef object tagged = compiled[1]
    cdef dict out = {}
    cdef tuple f
    cdef Py_ssize_t ntags, i, size, end
    cdef uint64_t tag
    for f in fields:
        out[f[0]] = _read_value(r, f[1], f[3], f[4], f[7], f[2])
    if tagged is not None:
        ntags = <Py_ssize_t>r.uvarint(5)
        for i in range(ntags):
            tag = r.uvarint(5)
            size = <Py_ssize_t>r.uvarint(5)
            r._need(size)
            end = r.pos + size
            f = (<dict>tagged).get(tag)
            if f is None:
                r.pos = end                    # an unknown tagged field: skipped, as the spec says
                continue
            out[f[0]] = _read_value(r, f[1], f[3], f[4], f[7], f[2])
            if r.pos != end:
                raise KafkaProtocolError(r.what, r.pos, f"tagged field {tag} is not {size} bytes")
        for f in (<dict>tagged).values():
            if f[0] not in out:                # its default: a list or struct is the body's own
                d = f[6]
                out[f[0]] = d.copy() if type(d) is list or type(d) is dict else d
    return out


def read_struct(Reader r, tuple compiled):
    """Decode one struct of the compiled schema at the reader's position."""
    return _read_struct(r, compiled)


def read_request_header(frame, bint flexible_known=False):
    """(api_key, api_version, correlation_id, client_id, position after the
    common part) of a request frame (the size prefix removed). The header's
    tagged fields (request header v2) are read by :func:`skip_tagged`."""
    cdef Reader r = Reader(frame, 0, "request header")
    cdef int16_t key = r.i16()
    cdef int16_t version = r.i16()
    cdef int32_t corr = r.i32()
    cdef Py_ssize_t n = r.length(False, False)
    client_id = None
    if n >= 0:
        client_id = r.take(n).decode("utf-8", "replace")
    return key, version, corr, client_id, r.pos


def skip_tagged(Reader r):
    """Skip a tagged-field section (request header v2 carries one)."""
    cdef Py_ssize_t ntags = <Py_ssize_t>r.uvarint(5), i, size
    for i in range(ntags):
        r.uvarint(5)
        size = <Py_ssize_t>r.uvarint(5)
        r._need(size)
        r.pos += size


# -- writing ------------------------------------------------------------------------------------

cdef class Writer:
    """A growing output buffer (its fields and C methods are declared in
    pyx/txmq/_kafka.pxd)."""

    def __cinit__(self, Py_ssize_t cap=256):
        self.cap = cap if cap > 16 else 16
        self.buf = <char *>PyMem_Malloc(self.cap)
        if self.buf == NULL:
            raise MemoryError()
        self.size = 0

    def __dealloc__(self):
        PyMem_Free(self.buf)

    cdef int reserve(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap = self.cap
        cdef char *nb
        if self.size + n <= cap:
            return 0
        while cap < self.size + n:
            cap *= 2
        nb = <char *>PyMem_Realloc(self.buf, cap)
        if nb == NULL:
            raise MemoryError()
        self.buf = nb
        self.cap = cap
        return 0

    cdef int i8(self, int8_t v) except -1:
        self.reserve(1)
        self.buf[self.size] = <char>v
        self.size += 1
        return 0

    cdef int i16(self, int16_t v) except -1:
        self.reserve(2)
        put16(self.buf + self.size, <uint16_t>v)
        self.size += 2
        return 0

    cdef int i32(self, int32_t v) except -1:
        self.reserve(4)
        put32(self.buf + self.size, <uint32_t>v)
        self.size += 4
        return 0

    cdef int i64(self, int64_t v) except -1:
        self.reserve(8)
        put64(self.buf + self.size, <uint64_t>v)
        self.size += 8
        return 0

    cdef int uvarint(self, uint64_t v) except -1:
        self.reserve(10)
        while v >= 0x80:
            self.buf[self.size] = <char>((v & 0x7F) | 0x80)
            self.size += 1
            v >>= 7
        self.buf[self.size] = <char>v
        self.size += 1
        return 0

    cdef int varlong(self, int64_t v) except -1:
        return self.uvarint((<uint64_t>v << 1) ^ <uint64_t>(v >> 63))

    cdef int raw(self, const char *p, Py_ssize_t n) except -1:
        self.reserve(n)
        memcpy(self.buf + self.size, p, n)
        self.size += n
        return 0

    cdef int data(self, object b) except -1:
        cdef const unsigned char[::1] view
        if type(b) is bytes:
            return self.raw(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
        view = b
        if view.shape[0]:
            self.raw(<const char *>&view[0], view.shape[0])
        return 0

    cdef int length(self, Py_ssize_t n, bint compact, bint wide) except -1:
        if compact:
            return self.uvarint(<uint64_t>(n + 1))
        if wide:
            return self.i32(<int32_t>n)
        return self.i16(<int16_t>n)

    def getvalue(self) -> bytes:
        return PyBytes_FromStringAndSize(self.buf, self.size)

    def framed(self) -> bytes:
        """The contents as one frame: the first 4 bytes, reserved by the
        caller, become the big-endian size of the rest."""
        if self.size < 4:
            raise ValueError("a frame starts with 4 reserved bytes")
        put32(self.buf, <uint32_t>(self.size - 4))
        return PyBytes_FromStringAndSize(self.buf, self.size)

    def __len__(self):
        return self.size

    def truncate(self, Py_ssize_t size):
        """Drop everything past ``size`` bytes (an encoded batch that did not fit)."""
        if not 0 <= size <= self.size:
            raise ValueError(f"truncate to {size} of {self.size} bytes")
        self.size = size


cdef int _write_value(Writer w, object v, tuple f) except -1:
    cdef int kind = f[1]
    cdef bint compact = f[4]
    cdef bytes raw
    cdef object item
    if kind == K_INT32:
        return w.i32(v)
    if kind == K_INT16:
        return w.i16(v)
    if kind == K_INT64:
        return w.i64(v)
    if kind == K_STRING:
        if v is None:
            if not f[3]:
                raise ValueError(f"field {f[0]!r} is not nullable")
            return w.length(-1, compact, False)
        raw = (<str>v).encode("utf-8")
        w.length(len(raw), compact, False)
        return w.raw(PyBytes_AS_STRING(raw), len(raw))
    if kind == K_ARRAY:
        if v is None:
            if not f[3]:
                raise ValueError(f"field {f[0]!r} is not nullable")
            return w.length(-1, compact, True)
        w.length(len(v), compact, True)
        for item in v:
            if f[2] == K_STRUCT:
                _write_struct(w, item, f[7])
            else:
                _write_value(w, item, (f[0], f[2], 0, False, compact, -1, None, None))
        return 0
    if kind == K_STRUCT:
        return _write_struct(w, v, f[7])
    if kind == K_BYTES or kind == K_RECORDS:
        if v is None:
            if not f[3]:
                raise ValueError(f"field {f[0]!r} is not nullable")
            return w.length(-1, compact, True)
        w.length(len(v), compact, True)
        return w.data(v)
    if kind == K_BOOL:
        return w.i8(1 if v else 0)
    if kind == K_INT8:
        return w.i8(v)
    if kind == K_UINT16:
        return w.i16(<int16_t><uint16_t>v)
    if kind == K_UINT32:
        return w.i32(<int32_t><uint32_t>v)
    if kind == K_UUID:
        if len(v) != 16:
            raise ValueError(f"field {f[0]!r}: a uuid is 16 bytes")
        return w.data(v)
    if kind == K_FLOAT64:
        import struct
        return w.data(struct.pack(">d", v))
    raise KeyError(kind)


cdef int _write_struct(Writer w, dict d, tuple compiled) except -1:
    cdef tuple f
    cdef object v
    cdef list present
    cdef Writer inner
    for f in <tuple>compiled[0]:
        v = d.get(f[0], _MISSING)
        if v is _MISSING:
            v = f[6]
            if type(v) is list:
                v = []
        _write_value(w, v, f)
    if compiled[1] is not None:
        present = []
        for f in sorted((<dict>compiled[1]).values(), key=lambda t: t[5]):
            v = d.get(f[0], _MISSING)
            if v is not _MISSING and v != f[6]:
                present.append((f, v))
        w.uvarint(len(present))
        for f, v in present:
            inner = Writer()
            _write_value(inner, v, f)
            w.uvarint(f[5])
            w.uvarint(inner.size)
            w.raw(inner.buf, inner.size)
    return 0


def write_struct(Writer w, dict d, tuple compiled):
    """Encode ``d`` by the compiled schema onto ``w``; fields left out take
    their schema default."""
    _write_struct(w, d, compiled)


def write_i32(Writer w, int32_t v):
    w.i32(v)


def write_i16(Writer w, int16_t v):
    w.i16(v)


def write_uvarint(Writer w, uint64_t v):
    w.uvarint(v)


def write_bytes(Writer w, b):
    """Append bytes-like ``b`` to ``w`` as they are."""
    w.data(b)
