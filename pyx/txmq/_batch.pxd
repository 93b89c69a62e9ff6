# Declarations of pyx/_batch.pyx (the batch codec) for the modules that
# cimport it; see pyx/txmq/_mapping.pxd for why this file lives here.
from libc.stdint cimport uint8_t, uint16_t, uint64_t, int16_t, int32_t, int64_t
from posix.uio cimport iovec

from _batch_layout cimport Sections


cdef struct Pieces:
    # One encoded batch as the pieces a sink writes in order: iov[0] is the
    # header and the sections before the key bytes (``meta``, owned here);
    # the other pieces point into the BatchSpec's buffers, which must stay
    # alive until the pieces are written.
    char *meta
    iovec *iov
    Py_ssize_t n
    Py_ssize_t length


cdef class BatchSpec:
    cdef readonly int32_t count
    cdef readonly Py_ssize_t key_bytes, value_bytes, header_bytes
    cdef readonly Py_ssize_t max_message_bytes
    cdef readonly uint16_t content_flags
    cdef readonly int64_t first_event_time, max_event_time
    cdef readonly bint event_time_is_publish_time
    cdef list value_list, key_list
    cdef object value_arrow, key_arrow   # pyarrow arrays (kept alive)
    cdef const uint8_t[::1] v_data, k_data, k_valid
    cdef const char *v_offsets
    cdef const char *k_offsets
    cdef bint v_large, k_large
    cdef Py_ssize_t v_base, k_base, k_bit_offset
    cdef bytes header_blob
    cdef object header_offsets   # int32 buffer (np.int32 array or a memoryview cast to "i")
    cdef object event_deltas     # the same, or None
    cdef object columns          # from_columns: the buffers the pointers above point into

    cdef int encode(self, Pieces *out, uint16_t flags, int64_t base_offset, uint64_t txn_hi,
                    uint64_t txn_lo, int64_t producer_id, int16_t producer_epoch,
                    int32_t base_sequence, int64_t publish_time) except -1

    # Private to pyx/_batch.pyx.
    cdef _check_count(self, Py_ssize_t n)
    cdef Py_ssize_t _from_arrow(self, arr, bint is_value) except -1
    cdef _set_keys(self, keys)
    cdef _set_headers(self, headers)
    cdef _set_event_times(self, event_times, default_event_time)
    cdef Py_ssize_t _largest_message(self) except -1
    cdef object _lengths(self, bint keys)
    cdef int _write_meta(self, char *dst, Sections s, uint16_t flags, int64_t base_offset,
                         uint64_t txn_hi, uint64_t txn_lo, int64_t producer_id,
                         int16_t producer_epoch, int32_t base_sequence,
                         int64_t publish_time) except -1
    cdef void _rebase(self, int32_t *out_off, const char *offsets, bint large,
                      Py_ssize_t base) noexcept


cdef class Message:
    # One delivered message (pyx/_batch.pyx); ``message_id`` is built from
    # (_topic, _partition, offset) when first read, as an ``_id_type``.
    cdef public object value, key, txn_id
    cdef object _headers
    cdef object _mid, _id_type, _topic, _partition
    cdef readonly int64_t offset
    cdef public int64_t event_time, publish_time
    cdef public int redelivery_count


cdef void seal(Pieces *pieces) noexcept nogil
cdef void free_pieces(Pieces *pieces) noexcept

cdef str check_batch(const char *p, Py_ssize_t avail, int64_t expected_offset, bint verify_crc,
                     Sections *out)
cdef object batch_info(const char *p, Py_ssize_t pos)
cdef list decode_batch(const char *p, Sections s, object path, Py_ssize_t pos, int64_t from_offset,
                       Py_ssize_t limit, object id_type, str topic, int partition, object txn_id,
                       bint as_messages)
cdef bint offsets_sound(const char *offsets, int32_t count, Py_ssize_t total) noexcept nogil
