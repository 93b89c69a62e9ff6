# cython: boundscheck=False, wraparound=False, cdivision=True
"""Idempotent-producer state of one partition (docs/FORMAT.md, "Idempotent producers", Kafka rules).

Per producer id: its epoch, the last sequence appended, the publish time of
its last batch, and (base sequence, count, base offset) of its last
``CACHED`` batches. Sequences count messages, as Kafka's do: a batch of n
messages at base sequence s covers s .. s+n-1, and the next batch must start
at s+n. They are int32 and wrap from 2**31-1 to 0.

:meth:`ProducerStates.check` decides an append in O(1) (one probe of an
open-addressing table, usually one cache line, and at most ``CACHED``
comparisons), whatever the number of producer ids.
"""
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

from _bytes cimport load_i16, load_i32, load_i64, store_i16, store_i32, store_i64, store_u32
from txmq._reader cimport Reader

cdef enum:
    CACHED = 5

# Results of check() below zero; zero and above is a duplicate's base offset.
APPEND = -1
OUT_OF_ORDER = -2
FENCED = -3
DUPLICATE = -4      # a sequence already appended, but not one of the cached batches

cdef int64_t SEQ_MOD = <int64_t>1 << 31
cdef Py_ssize_t ENTRY = 24 + 16 * CACHED     # bytes of one producer in to_bytes()
cdef int64_t EMPTY = -1                      # pid of a free slot


cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)
    void free(void *ptr)


# One producer: 128 bytes, aligned, so what a check reads (id, epoch, last
# sequence, the cached sequences and counts) is one cache line, and a
# record touches one more (publish time, cached offsets).
ctypedef struct PState:
    int64_t pid
    int32_t last_seq           # -1: nothing appended in this epoch
    int16_t epoch
    uint8_t n                  # cached batches
    uint8_t head               # ring index of the oldest
    int32_t seq[CACHED]
    int32_t cnt[CACHED]
    int32_t _pad0
    int64_t last_ts
    int64_t off[CACHED]
    int64_t _pad1[2]


cdef inline int64_t seq_add(int64_t seq, int64_t n) noexcept nogil:
    return (seq + n) & (SEQ_MOD - 1)     # two's complement: right for n < 0 too


cdef inline uint64_t mix(int64_t pid) noexcept nogil:
    """splitmix64's finaliser: producer ids are dense, slots must not be."""
    cdef uint64_t z = <uint64_t>pid + 0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline void reset(PState *st, int16_t epoch) noexcept nogil:
    st.epoch = epoch
    st.last_seq = -1
    st.n = 0
    st.head = 0


cdef inline void push(PState *st, int32_t seq, int32_t count, int64_t offset) noexcept nogil:
    cdef int i
    if st.n < CACHED:
        i = (st.head + st.n) % CACHED
        st.n += 1
    else:
        i = st.head
        st.head = (st.head + 1) % CACHED
    st.seq[i] = seq
    st.cnt[i] = count
    st.off[i] = offset
    st.last_seq = <int32_t>seq_add(seq, count - 1)


cdef class ProducerStates:
    """The producer table of one partition: an open-addressing hash table of
    inline ``PState`` records (linear probing, at most half full, no
    deletions but by rebuilding). Not thread-safe: the partition calls it
    under its lock."""

    cdef PState *slots
    cdef Py_ssize_t cap, count
    cdef PState *hint            # the record the last lookup found (record() reuses it)

    def __cinit__(self):
        self.slots = NULL
        self.cap = self.count = 0
        self.hint = NULL
        self._alloc(16)

    def __dealloc__(self):
        free(self.slots)

    cdef int _alloc(self, Py_ssize_t cap) except -1:
        cdef void *mem = NULL
        if posix_memalign(&mem, 64, cap * sizeof(PState)) != 0:
            raise MemoryError()
        cdef PState *slots = <PState *>mem
        cdef Py_ssize_t i
        for i in range(cap):
            slots[i].pid = EMPTY
        free(self.slots)
        self.slots, self.cap, self.count, self.hint = slots, cap, 0, NULL
        return 0

    cdef PState *find(self, int64_t pid) noexcept nogil:
        if pid < 0:
            return NULL
        cdef Py_ssize_t mask = self.cap - 1
        cdef Py_ssize_t i = <Py_ssize_t>(mix(pid) & <uint64_t>mask)
        while True:
            if self.slots[i].pid == pid:
                self.hint = &self.slots[i]
                return self.hint
            if self.slots[i].pid == EMPTY:
                return NULL
            i = (i + 1) & mask

    cdef PState *insert(self, int64_t pid) except NULL:
        """A fresh record for ``pid`` (not in the table)."""
        if 2 * (self.count + 1) > self.cap:
            self._rebuild(self.cap * 2, -1)
        cdef Py_ssize_t mask = self.cap - 1
        cdef Py_ssize_t i = <Py_ssize_t>(mix(pid) & <uint64_t>mask)
        while self.slots[i].pid != EMPTY:
            i = (i + 1) & mask
        self.slots[i].pid = pid
        self.slots[i].last_ts = 0
        self.count += 1
        self.hint = &self.slots[i]
        return self.hint

    cdef int _rebuild(self, Py_ssize_t cap, int64_t keep_since) except -1:
        """Move every record with last_ts >= keep_since into a table of
        ``cap`` slots."""
        cdef PState *old = self.slots
        cdef Py_ssize_t old_cap = self.cap, i, j, mask
        self.slots = NULL
        try:
            self._alloc(cap)
        except BaseException:
            self.slots = old
            raise
        mask = cap - 1
        for i in range(old_cap):
            if old[i].pid != EMPTY and old[i].last_ts >= keep_since:
                j = <Py_ssize_t>(mix(old[i].pid) & <uint64_t>mask)
                while self.slots[j].pid != EMPTY:
                    j = (j + 1) & mask
                self.slots[j] = old[i]
                self.count += 1
        free(old)
        return 0

    def __len__(self):
        return self.count

    def __contains__(self, int64_t pid):
        return self.find(pid) != NULL

    cpdef int64_t next_sequence(self, int64_t pid, int epoch):
        """The sequence a new batch of ``pid`` at ``epoch`` gets, or FENCED
        when a newer epoch of ``pid`` has appended here."""
        cdef PState *st = self.find(pid)
        if st == NULL:
            return 0
        if epoch < st.epoch:
            return FENCED
        if epoch > st.epoch or st.last_seq < 0:
            return 0
        return seq_add(st.last_seq, 1)

    cpdef int64_t check(self, int64_t pid, int epoch, int64_t seq, int64_t count):
        """How to take a batch of ``count`` messages at base sequence ``seq``:
        APPEND; the base offset of the identical cached batch (a retry:
        append nothing); FENCED (a lower epoch); OUT_OF_ORDER (a gap, or a
        new epoch not starting at 0); DUPLICATE (already appended, but not
        as one of the cached batches). An unknown producer id may start
        anywhere (its state may have expired)."""
        cdef PState *st = self.find(pid)
        cdef int i, k
        cdef int64_t behind
        if st == NULL:
            return APPEND
        if epoch < st.epoch:
            return FENCED
        if epoch > st.epoch:
            return APPEND if seq == 0 else OUT_OF_ORDER
        if st.last_seq < 0:
            return APPEND
        for k in range(st.n):
            i = (st.head + k) % CACHED
            if st.seq[i] == seq and st.cnt[i] == count:
                return st.off[i]
        if seq == seq_add(st.last_seq, 1):
            return APPEND
        # seq at or below the last one (mod 2**31, within half the ring): a
        # batch appended long ago; anything else is a gap.
        behind = (st.last_seq - seq) & (SEQ_MOD - 1)
        return DUPLICATE if behind < (SEQ_MOD >> 1) else OUT_OF_ORDER

    cpdef void record(self, int64_t pid, int epoch, int64_t seq, int64_t count, int64_t base_offset,
                      int64_t publish_time) except *:
        """A batch of ``pid`` was appended at ``base_offset``."""
        cdef PState *st = self.hint
        if st == NULL or st.pid != pid:
            st = self.find(pid)
            if st == NULL:
                st = self.insert(pid)
                reset(st, <int16_t>epoch)
        if epoch != st.epoch:
            reset(st, <int16_t>epoch)
        push(st, <int32_t>seq, <int32_t>count, base_offset)
        if publish_time > st.last_ts:
            st.last_ts = publish_time

    def last_sequence(self, int64_t pid):
        """The last sequence ``pid`` appended here, or -1."""
        cdef PState *st = self.find(pid)
        return -1 if st == NULL else st.last_seq

    def epoch_of(self, int64_t pid):
        """The epoch of ``pid`` here, or -1 when unknown."""
        cdef PState *st = self.find(pid)
        return -1 if st == NULL else st.epoch

    def max_producer_id(self):
        """The highest producer id in the table, or -1."""
        cdef Py_ssize_t i
        cdef int64_t top = -1
        for i in range(self.cap):
            if self.slots[i].pid > top:
                top = self.slots[i].pid
        return top

    def expire(self, int64_t before_ms):
        """Drop every producer whose last batch was published before
        ``before_ms``; return how many were dropped."""
        cdef Py_ssize_t i, old = 0
        for i in range(self.cap):
            if self.slots[i].pid != EMPTY and self.slots[i].last_ts < before_ms:
                old += 1
        if old:
            before = self.count
            cap = 16
            while 2 * (before - old) > cap:
                cap *= 2
            self._rebuild(cap, before_ms)
        return old

    def entries(self):
        """{pid: (epoch, last sequence, last publish time, [(base seq, count,
        base offset), ...] oldest first)}."""
        cdef PState *st
        cdef Py_ssize_t j
        cdef int k, i
        out = {}
        for j in range(self.cap):
            st = &self.slots[j]
            if st.pid != EMPTY:
                out[st.pid] = (st.epoch, st.last_seq, st.last_ts,
                               [(st.seq[i], st.cnt[i], st.off[i])
                                for i in [(st.head + k) % CACHED for k in range(st.n)]])
        return out

    def to_bytes(self):
        """u32 count, then per producer: i64 id, i64 last publish time, i16
        epoch, u8 cached, u8 0, i32 last sequence, and 5 x (i32 base
        sequence, i32 count, i64 base offset), oldest first."""
        cdef PState *st
        cdef Py_ssize_t j
        cdef int k, i
        out = PyBytes_FromStringAndSize(NULL, 4 + ENTRY * self.count)
        cdef char *p = PyBytes_AS_STRING(out)
        store_u32(p, <uint32_t>self.count)
        p += 4
        for j in range(self.cap):
            st = &self.slots[j]
            if st.pid == EMPTY:
                continue
            store_i64(p, st.pid)
            store_i64(p + 8, st.last_ts)
            store_i16(p + 16, st.epoch)
            p[18] = <char>st.n
            p[19] = 0
            store_i32(p + 20, st.last_seq)
            for k in range(CACHED):
                i = (st.head + k) % CACHED
                if k < st.n:
                    store_i32(p + 24 + 16 * k, st.seq[i])
                    store_i32(p + 28 + 16 * k, st.cnt[i])
                    store_i64(p + 32 + 16 * k, st.off[i])
                else:
                    store_i32(p + 24 + 16 * k, 0)
                    store_i32(p + 28 + 16 * k, 0)
                    store_i64(p + 32 + 16 * k, 0)
            p += ENTRY
        return out

    @staticmethod
    def from_bytes(data, path=None, Py_ssize_t base=0):
        """Inverse of :meth:`to_bytes`; returns (table, bytes consumed).
        ``data`` is byte ``base`` of file ``path`` onwards: a short or
        malformed table raises CorruptLogError at its first bad byte
        (ValueError without a path)."""
        cdef Reader r = Reader(path, "producer table").reset(data, base)
        cdef uint32_t n = r.u32(), j
        cdef Py_ssize_t at = r.pos
        cdef const char *p = r.take_array(n, ENTRY)
        cdef int k, cached
        cdef int64_t pid
        cdef int32_t last_seq
        cdef PState *st
        cdef ProducerStates t = ProducerStates()
        for j in range(n):
            pid = load_i64(p)
            cached = <unsigned char>p[18]
            last_seq = load_i32(p + 20)
            if cached > CACHED or pid < 0 or last_seq < -1 or t.find(pid) != NULL:
                r.fail(at + ENTRY * <Py_ssize_t>j, f"bad producer entry {j} (id {pid})")
            st = t.insert(pid)
            reset(st, load_i16(p + 16))
            st.last_ts = load_i64(p + 8)
            st.last_seq = last_seq
            st.n = cached
            for k in range(cached):
                st.seq[k] = load_i32(p + 24 + 16 * k)
                st.cnt[k] = load_i32(p + 28 + 16 * k)
                st.off[k] = load_i64(p + 32 + 16 * k)
            p += ENTRY
        return t, r.pos
