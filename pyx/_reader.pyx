# cython: boundscheck=False, wraparound=False, cdivision=True
"""The one bounds-checked reader of txmq's framed and table decoders.

Every decoder of bytes read back from a file (redo-log frames of the
coordinator, the producer registry, pending acks, cursors and half
messages; the snapshot tables of the transaction buffer, producer state
and ack sets; a batch's message headers) reads through a :class:`Reader`.
Each read checks that its bytes lie inside what may be read, so no byte
pattern can make a decoder read past its data, and a read that does not
fit, stray bytes after the last field, or a value the decoder refuses
(:meth:`Reader.fail`) raise one error that says where the bad bytes are:

- :class:`txmq.errors.CorruptLogError` with the reader's ``path`` and the
  file position of the first bad byte (``base`` is the file position of
  the bytes' first byte: a frame's payload, a table in a snapshot), when
  the bytes came from a file;
- ``ValueError`` naming the same byte, when ``path`` is None (bytes that
  came from no file, such as a test's).

All numbers are little-endian, as in every txmq format; a text is a u16
byte length and that many bytes of UTF-8.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint8_t, uint16_t, int16_t, uint32_t, int32_t, int64_t, uint64_t

from txmq.errors import CorruptLogError

from _bytes cimport load_u16, load_i16, load_u32, load_i32, load_u64, load_i64

cdef const char *NOTHING = b""


cdef class Reader:
    """Bounds-checked little-endian reads over bytes of a file.

    ``path`` is the file (None for bytes of no file); ``what`` names what is
    read in every error, followed by ``number`` when that is 0 or more
    (``Reader(path, "coordinator frame of type")``, then ``reset(payload,
    position, frame_type)`` for each frame). The reader keeps the bytes
    alive until the next reset.
    """

    def __init__(self, path=None, str what="bytes"):
        self.path = path
        self.what = what
        self.number = -1
        self.reset(b"")

    cpdef reset(self, data, Py_ssize_t base=0, int64_t number=-1):
        """Read ``data`` (any bytes-like object) from its first byte, which
        is byte ``base`` of the file; return the reader."""
        cdef const uint8_t[::1] view
        if PyBytes_CheckExact(data):
            self.owner = data
            self.p = PyBytes_AS_STRING(data)
            self.end = PyBytes_GET_SIZE(data)
        else:
            view = data
            self.owner = view
            self.end = view.shape[0]
            self.p = <const char *>&view[0] if self.end else NOTHING
        self.pos = 0
        self.base = base
        self.number = number
        return self

    cdef int reset_ptr(self, const char *p, Py_ssize_t n, Py_ssize_t base, int64_t number,
                       object owner) except -1:
        """Read ``n`` bytes at ``p`` (byte ``base`` of the file), which
        ``owner`` keeps alive (None: the caller keeps them alive and mapped
        for as long as it reads)."""
        self.owner = owner
        self.p = p
        self.end = n
        self.pos = 0
        self.base = base
        self.number = number
        return 0

    @property
    def position(self):
        """The file position of the next byte to read."""
        return self.base + self.pos

    def remaining(self):
        """Bytes left to read."""
        return self.end - self.pos

    # -- errors ----------------------------------------------------------------------

    cpdef fail(self, Py_ssize_t at, str reason):
        """Raise the reader's error for the bad bytes at ``at`` (counted as
        ``pos`` is; negative for bytes before the data, such as the type
        byte in front of a frame's payload)."""
        what = self.what if self.number < 0 else f"{self.what} {self.number}"
        if self.path is None:
            raise ValueError(f"{what}: {reason} (at byte {self.base + at})")
        raise CorruptLogError(self.path, self.base + at, f"{what}: {reason}")

    cdef int _short(self, Py_ssize_t k) except -1:
        self.fail(self.pos, f"ends at byte {self.base + self.end} ({k} bytes needed from byte "
                            f"{self.base + self.pos})")
        return -1

    # -- reads -----------------------------------------------------------------------

    cdef const char *take_array(self, Py_ssize_t count, Py_ssize_t size) except NULL:
        """The next ``count`` items of ``size`` bytes, checked without
        overflow (a count read from a file may be anything)."""
        if count < 0 or size <= 0 or count > (self.end - self.pos) // size:
            self.fail(self.pos, f"{count} items of {size} bytes do not fit in the "
                                f"{self.end - self.pos} bytes left")
            return NULL
        return self.take(count * size)

    cdef Py_ssize_t enter(self, Py_ssize_t k) except -1:
        """Read only the next ``k`` bytes until :meth:`leave` (a nested
        length-prefixed part); return the end to give back to leave."""
        cdef Py_ssize_t outer = self.end
        if k < 0 or k > self.end - self.pos:
            self._short(k)
        self.end = self.pos + k
        return outer

    cdef int leave(self, Py_ssize_t outer_end) except -1:
        """End the part :meth:`enter` began: it must be read to its end."""
        self.done()
        self.end = outer_end
        return 0

    cpdef uint8_t u8(self) except? 0:
        """The next byte, unsigned."""
        return <uint8_t>self.take(1)[0]

    cpdef uint16_t u16(self) except? 0:
        """The next 2 bytes, unsigned."""
        return load_u16(self.take(2))

    cpdef int16_t i16(self) except? -1:
        """The next 2 bytes, signed."""
        return load_i16(self.take(2))

    cpdef uint32_t u32(self) except? 0:
        """The next 4 bytes, unsigned."""
        return load_u32(self.take(4))

    cpdef int32_t i32(self) except? -1:
        """The next 4 bytes, signed."""
        return load_i32(self.take(4))

    cpdef uint64_t u64(self) except? 0:
        """The next 8 bytes, unsigned."""
        return load_u64(self.take(8))

    cpdef int64_t i64(self) except? -1:
        """The next 8 bytes, signed."""
        return load_i64(self.take(8))

    cpdef bytes read(self, Py_ssize_t count, Py_ssize_t size=1):
        """The next ``count`` items of ``size`` bytes, as bytes."""
        cdef const char *at = self.take_array(count, size)
        return PyBytes_FromStringAndSize(at, count * size)

    cpdef str text(self):
        """A u16 byte length, then that many bytes of UTF-8."""
        cdef Py_ssize_t start = self.pos, k
        cdef const char *at
        if self.end - self.pos < 2:
            self._short(2)
        k = load_u16(self.p + self.pos)
        if k > self.end - self.pos - 2:
            self.fail(start, f"text of {k} bytes runs past byte {self.base + self.end}")
        at = self.take(2 + k) + 2
        try:
            return PyUnicode_DecodeUTF8(at, k, NULL)
        except UnicodeDecodeError as e:
            self.fail(start + 2 + e.start, f"text is not UTF-8 ({e.reason})")

    cpdef done(self):
        """Check that every byte was read."""
        if self.pos != self.end:
            self.fail(self.pos, f"{self.end - self.pos} stray bytes after the last field")

    def __repr__(self):
        return (f"Reader({self.path!r}, {self.what!r}, at byte {self.base + self.pos} "
                f"of [{self.base}, {self.base + self.end}))")
