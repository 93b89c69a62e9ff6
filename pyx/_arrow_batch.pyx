# cython: boundscheck=False, wraparound=False, cdivision=True
"""A stored batch handed to Arrow without copying its key and value bytes
(docs/FORMAT.md: the sections are laid out as Arrow's binary arrays are):

- :func:`arrow_views`: memoryviews of the sections, for readers that build
  their own arrays (staged ingest, the tests);
- :func:`arrow_record_batch`: a run of the batch as a ``pyarrow.RecordBatch``
  (``receive_batch``), laid out through Arrow's C data interface and
  imported in one call.

Both check the key and value offsets first: Arrow trusts offsets, and the
mapped bytes may have changed since the batch's CRC was checked.
"""
from libc.stdint cimport uint16_t, int32_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, free
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF

from txmq.errors import CorruptLogError

from _bytes cimport load_u16, load_i32, load_i64
from _batch_layout cimport *
from txmq._batch cimport offsets_sound


cdef int32_t binary_sections(const char *p, Sections s, object path, Py_ssize_t pos, Py_ssize_t *key_bytes,
                             Py_ssize_t *value_bytes) except -1:
    """The message count of the batch at ``p`` (byte ``pos`` of ``path``),
    with the sizes of its key and value bytes, once their offsets are
    checked: CorruptLogError when they do not run from 0 to those sizes."""
    cdef int32_t count = load_i32(p + COUNT_OFFSET)
    key_bytes[0] = load_i32(p + s.key_offsets + 4 * count)
    value_bytes[0] = load_i32(p + s.value_offsets + 4 * count)
    if not (offsets_sound(p + s.key_offsets, count, key_bytes[0])
            and offsets_sound(p + s.value_offsets, count, value_bytes[0])):
        raise CorruptLogError(path, pos, "offsets out of order")
    return count


cdef dict arrow_views(object buffer, const char *p, Sections s, object path, Py_ssize_t pos):
    """Zero-copy views of the batch at ``p`` for Arrow: a dict of
    memoryviews over ``buffer`` (the whole mapping, the batch at byte
    ``pos``): ``key_offsets``, ``keys``, ``validity`` or None,
    ``value_offsets``, ``values``, ``event_deltas``, plus ``count``."""
    cdef Py_ssize_t kb, vb
    cdef int32_t count = binary_sections(p, s, path, pos, &kb, &vb)
    cdef uint16_t flags = load_u16(p + FLAGS_OFFSET)
    view = memoryview(buffer)
    return {
        "count": count,
        "key_offsets": view[pos + s.key_offsets: pos + s.key_offsets + 4 * (count + 1)],
        "keys": view[pos + s.keys: pos + s.keys + kb],
        "validity": view[pos + s.validity: pos + s.validity + (count + 7) // 8] if flags & FLAG_NULL_KEYS else None,
        "value_offsets": view[pos + s.value_offsets: pos + s.value_offsets + 4 * (count + 1)],
        "values": view[pos + s.values: pos + s.values + vb],
        "event_deltas": view[pos + s.event_deltas: pos + s.event_deltas + 4 * count],
    }


# -- a RecordBatch through Arrow's C data interface ----------------------------------
#
# receive_batch's columns, built here and handed to pyarrow in one call
# (``RecordBatch._import_from_c``) instead of five ``Array.from_buffers``,
# three numpy arrays and ``RecordBatch.from_arrays``. The key and value
# columns point into the mapping; the three int64 columns are computed
# into the same allocation as the structs. The memoryview that keeps the
# mapping exported is released, with the allocation, by the root array's
# release callback (pyarrow calls it when the last column is dropped).

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

cdef extern from *:
    """
    #ifndef ARROW_C_DATA_INTERFACE
    #define ARROW_C_DATA_INTERFACE
    #define ARROW_FLAG_DICTIONARY_ORDERED 1
    #define ARROW_FLAG_NULLABLE 2
    #define ARROW_FLAG_MAP_KEYS_SORTED 4
    struct ArrowSchema {
      const char* format; const char* name; const char* metadata; int64_t flags; int64_t n_children;
      struct ArrowSchema** children; struct ArrowSchema* dictionary;
      void (*release)(struct ArrowSchema*); void* private_data;
    };
    struct ArrowArray {
      int64_t length; int64_t null_count; int64_t offset; int64_t n_buffers; int64_t n_children;
      const void** buffers; struct ArrowArray** children; struct ArrowArray* dictionary;
      void (*release)(struct ArrowArray*); void* private_data;
    };
    #endif
    """
    struct ArrowArray:
        int64_t length
        int64_t null_count
        int64_t offset
        int64_t n_buffers
        int64_t n_children
        const void **buffers
        ArrowArray **children
        ArrowArray *dictionary
        void (*release)(ArrowArray *) noexcept nogil
        void *private_data

cdef enum:
    RB_COLUMNS = 5          # key, value, offset, event_time, publish_time

cdef struct RecordBlock:
    ArrowArray root
    ArrowArray cols[RB_COLUMNS]
    ArrowArray *children[RB_COLUMNS]
    const void *root_buffers[1]
    const void *buffers[RB_COLUMNS * 3]
    PyObject *keep                      # the memoryview exporting the mapping
    # followed by the three int64 columns, n values each

cdef void _release_column(ArrowArray *a) noexcept nogil:
    a.release = NULL                    # (its memory is the root's, freed with it)

cdef void _drop_ref(PyObject *o) noexcept with gil:
    Py_XDECREF(o)

cdef void _release_record(ArrowArray *a) noexcept nogil:
    cdef RecordBlock *blk = <RecordBlock *>a.private_data
    cdef int i
    for i in range(RB_COLUMNS):
        if blk.cols[i].release != NULL:
            blk.cols[i].release(&blk.cols[i])
    a.release = NULL
    if blk.keep != NULL and Py_IsInitialized():
        _drop_ref(blk.keep)
    free(blk)

cdef object _record_batch_type = None
cdef dict _schemas = {}              # (topic, partition) -> the pyarrow schema of its record batches
cdef enum:
    SCHEMAS_MAX = 4096

def record_batch_schema(str topic, int partition):
    """The ``pyarrow.Schema`` of a partition's record batches: key, value
    (binary), offset (int64), event_time, publish_time (timestamp[ms]),
    with ``topic`` and ``partition`` in its metadata. Built once per
    partition (the last 4096 kept)."""
    key = (topic, partition)
    schema = _schemas.get(key)
    if schema is None:
        import pyarrow as pa
        if len(_schemas) >= SCHEMAS_MAX:
            _schemas.clear()
        schema = _schemas[key] = pa.schema(
            [("key", pa.binary()), ("value", pa.binary()), ("offset", pa.int64()),
             ("event_time", pa.timestamp("ms")), ("publish_time", pa.timestamp("ms"))],
            metadata={"topic": topic, "partition": str(partition)})
    return schema

cdef object arrow_record_batch(object buffer, const char *p, Sections s, object path, Py_ssize_t pos,
                               Py_ssize_t first, Py_ssize_t n, str topic, int partition):
    """Messages ``first`` .. ``first + n - 1`` of the batch at ``p`` (byte
    ``pos`` of ``path``; ``buffer`` the whole mapping) as a
    ``pyarrow.RecordBatch`` of :func:`record_batch_schema`: the key and
    value columns are views of ``buffer``."""
    global _record_batch_type
    schema = record_batch_schema(topic, partition)
    cdef Py_ssize_t kb, vb
    cdef int32_t count = binary_sections(p, s, path, pos, &kb, &vb)
    cdef uint16_t flags = load_u16(p + FLAGS_OFFSET)
    if first < 0 or n < 1 or first + n > count:
        raise ValueError(f"rows {first}..{first + n} of a batch of {count}")
    if _record_batch_type is None:
        import pyarrow
        _record_batch_type = pyarrow.RecordBatch
    keep = memoryview(buffer)
    cdef RecordBlock *blk = <RecordBlock *>malloc(sizeof(RecordBlock) + 3 * n * sizeof(int64_t))
    if blk == NULL:
        raise MemoryError()
    cdef int64_t *offsets = <int64_t *>(<char *>blk + sizeof(RecordBlock))
    cdef int64_t *event_times = offsets + n
    cdef int64_t *publish_times = event_times + n
    cdef int64_t base = load_i64(p + BASE_OFFSET_OFFSET) + first
    cdef int64_t t0 = load_i64(p + FIRST_EVENT_TIME_OFFSET)
    cdef int64_t published = load_i64(p + PUBLISH_TIME_OFFSET)
    cdef const char *deltas = p + s.event_deltas + 4 * first
    cdef Py_ssize_t i
    for i in range(n):
        offsets[i] = base + i
        event_times[i] = t0 + load_i32(deltas + 4 * i)
        publish_times[i] = published
    cdef ArrowArray *c
    for i in range(RB_COLUMNS):
        c = &blk.cols[i]
        c.null_count = 0
        c.n_children = 0
        c.children = NULL
        c.dictionary = NULL
        c.release = _release_column
        c.private_data = NULL
        c.buffers = &blk.buffers[3 * i]
        blk.children[i] = c
        blk.buffers[3 * i] = NULL              # no validity bitmap
    for i in range(2):                         # key, value: binary, sliced by ``offset``
        c = &blk.cols[i]
        c.length = n
        c.offset = first
        c.n_buffers = 3
    blk.buffers[1] = p + s.key_offsets
    blk.buffers[2] = p + s.keys
    if flags & FLAG_NULL_KEYS:
        blk.buffers[0] = p + s.validity
        blk.cols[0].null_count = -1            # (Arrow counts them)
    blk.buffers[4] = p + s.value_offsets
    blk.buffers[5] = p + s.values
    for i in range(2, RB_COLUMNS):             # offset, event_time, publish_time: int64
        c = &blk.cols[i]
        c.length = n
        c.offset = 0
        c.n_buffers = 2
    blk.buffers[7] = offsets
    blk.buffers[10] = event_times
    blk.buffers[13] = publish_times
    blk.root_buffers[0] = NULL
    blk.root.length = n
    blk.root.null_count = 0
    blk.root.offset = 0
    blk.root.n_buffers = 1
    blk.root.n_children = RB_COLUMNS
    blk.root.buffers = blk.root_buffers
    blk.root.children = blk.children
    blk.root.dictionary = NULL
    blk.root.private_data = blk
    Py_INCREF(keep)
    blk.keep = <PyObject *>keep
    blk.root.release = _release_record
    try:
        return _record_batch_type._import_from_c(<uintptr_t>&blk.root, schema)
    except BaseException:
        # (Arrow's import releases what it was handed, even when it fails;
        # an error before it, never)
        if blk.root.release != NULL:
            _release_record(&blk.root)
        raise
