# cython: boundscheck=False, wraparound=False, cdivision=True
"""Idempotent-producer state of one partition (DESIGN.md §4, Kafka rules).

Per producer id: its epoch, the last sequence appended, the publish time of
its last batch, and (base sequence, count, base offset) of its last
``CACHED`` batches. Sequences count messages, as Kafka's do: a batch of n
messages at base sequence s covers s .. s+n-1, and the next batch must start
at s+n. They are int32 and wrap from 2**31-1 to 0.

:meth:`ProducerStates.check` decides an append in O(1) (one dict lookup and
at most ``CACHED`` comparisons), whatever the number of producer ids.
"""
from libc.stdint cimport int16_t, int32_t, int64_t, uint32_t
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

from _bytes cimport load_i16, load_i32, load_i64, load_u32, store_i16, store_i32, store_i64, store_u32

cdef enum:
    CACHED = 5

# Results of check() below zero; zero and above is a duplicate's base offset.
APPEND = -1
OUT_OF_ORDER = -2
FENCED = -3
DUPLICATE = -4      # a sequence already appended, but not one of the cached batches

cdef int64_t SEQ_MOD = <int64_t>1 << 31
cdef Py_ssize_t ENTRY = 24 + 16 * CACHED     # bytes of one producer in to_bytes()


cdef inline int64_t seq_add(int64_t seq, int64_t n) noexcept nogil:
    return (seq + n) & (SEQ_MOD - 1)     # two's complement: right for n < 0 too


cdef class _State:
    cdef int64_t pid, last_ts
    cdef int16_t epoch
    cdef int32_t last_seq          # -1: nothing appended in this epoch
    cdef int n, head               # cached batches; ring index of the oldest
    cdef int32_t seq[CACHED]
    cdef int32_t cnt[CACHED]
    cdef int64_t off[CACHED]

    cdef void reset(self, int16_t epoch) noexcept:
        self.epoch = epoch
        self.last_seq = -1
        self.n = self.head = 0

    cdef void push(self, int32_t seq, int32_t count, int64_t offset) noexcept:
        cdef int i
        if self.n < CACHED:
            i = (self.head + self.n) % CACHED
            self.n += 1
        else:
            i = self.head
            self.head = (self.head + 1) % CACHED
        self.seq[i], self.cnt[i], self.off[i] = seq, count, offset
        self.last_seq = <int32_t>seq_add(seq, count - 1)


cdef class ProducerStates:
    """The producer table of one partition. Not thread-safe: the partition
    calls it under its lock."""

    cdef dict table        # producer id -> _State

    def __cinit__(self):
        self.table = {}

    def __len__(self):
        return len(self.table)

    def __contains__(self, int64_t pid):
        return pid in self.table

    cpdef int64_t next_sequence(self, int64_t pid, int epoch):
        """The sequence a new batch of ``pid`` at ``epoch`` gets, or FENCED
        when a newer epoch of ``pid`` has appended here."""
        cdef _State st = self.table.get(pid)
        if st is None:
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
        new epoch not starting at 0); DUPLICATE (already appended, older than
        the cached batches). An unknown producer id may start anywhere (its
        state may have expired)."""
        cdef _State st = self.table.get(pid)
        cdef int i, k
        cdef int64_t behind
        if st is None:
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
                      int64_t publish_time):
        """A batch of ``pid`` was appended at ``base_offset``."""
        cdef _State st = self.table.get(pid)
        if st is None:
            st = _State()
            st.pid = pid
            st.reset(<int16_t>epoch)
            self.table[pid] = st
        elif epoch != st.epoch:
            st.reset(<int16_t>epoch)
        st.push(<int32_t>seq, <int32_t>count, base_offset)
        if publish_time > st.last_ts:
            st.last_ts = publish_time

    def last_sequence(self, int64_t pid):
        """The last sequence ``pid`` appended here, or -1."""
        cdef _State st = self.table.get(pid)
        return -1 if st is None else st.last_seq

    def epoch_of(self, int64_t pid):
        """The epoch of ``pid`` here, or -1 when unknown."""
        cdef _State st = self.table.get(pid)
        return -1 if st is None else st.epoch

    def expire(self, int64_t before_ms):
        """Drop every producer whose last batch was published before
        ``before_ms``; return how many were dropped."""
        old = [pid for pid, st in self.table.items() if (<_State>st).last_ts < before_ms]
        for pid in old:
            del self.table[pid]
        return len(old)

    def entries(self):
        """{pid: (epoch, last sequence, last publish time, [(base seq, count,
        base offset), ...] oldest first)}."""
        cdef _State st
        cdef int k, i
        out = {}
        for pid, st in self.table.items():
            out[pid] = (st.epoch, st.last_seq, st.last_ts,
                        [(st.seq[i], st.cnt[i], st.off[i])
                         for i in [(st.head + k) % CACHED for k in range(st.n)]])
        return out

    def to_bytes(self):
        """u32 count, then per producer: i64 id, i64 last publish time, i16
        epoch, u8 cached, u8 0, i32 last sequence, and 5 x (i32 base
        sequence, i32 count, i64 base offset), oldest first."""
        cdef _State st
        cdef int k, i
        out = PyBytes_FromStringAndSize(NULL, 4 + ENTRY * len(self.table))
        cdef char *p = PyBytes_AS_STRING(out)
        store_u32(p, <uint32_t>len(self.table))
        p += 4
        for st in self.table.values():
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
    def from_bytes(data):
        """Inverse of :meth:`to_bytes`; returns (table, bytes consumed).
        Raises ValueError on a short or malformed table."""
        cdef const unsigned char[::1] v = data
        cdef Py_ssize_t size = v.shape[0]
        if size < 4:
            raise ValueError("producer table shorter than its count")
        cdef const char *p = <const char *>&v[0]
        cdef uint32_t n = load_u32(p), j
        cdef int k
        cdef _State st
        if 4 + ENTRY * <Py_ssize_t>n > size:
            raise ValueError(f"producer table of {n} entries longer than its {size} bytes")
        t = ProducerStates()
        p += 4
        for j in range(n):
            st = _State()
            st.pid = load_i64(p)
            st.last_ts = load_i64(p + 8)
            st.epoch = load_i16(p + 16)
            st.n = <unsigned char>p[18]
            st.head = 0
            st.last_seq = load_i32(p + 20)
            if st.n > CACHED or st.pid < 0 or st.last_seq < -1 or st.pid in t.table:
                raise ValueError(f"bad producer entry {j} (id {st.pid})")
            for k in range(st.n):
                st.seq[k] = load_i32(p + 24 + 16 * k)
                st.cnt[k] = load_i32(p + 28 + 16 * k)
                st.off[k] = load_i64(p + 32 + 16 * k)
            t.table[st.pid] = st
            p += ENTRY
        return t, 4 + ENTRY * <Py_ssize_t>n
