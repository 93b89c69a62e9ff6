# cython: language_level=3
# Declarations of txmq._budget (docs/ARCHITECTURE.md): what segments and
# redo logs share to keep their descriptors within a budget.

cdef class Budgeted:
    cdef public Py_ssize_t slot          # in the budget's ring; -1: parked or closed
    cdef public bint recent              # used since the budget's hand last passed
    cdef public int users                # uses in progress: never parked meanwhile
    cdef object __weakref__
    cpdef park(self)


cdef class Budget:
    cdef readonly Py_ssize_t limit
    cdef readonly str what
    cdef list ring                       # weak references to open items; None: a free slot
    cdef list free_slots
    cdef Py_ssize_t hand
    cdef readonly Py_ssize_t open_count  # slots taken (an item freed unclosed counts until swept)
    cdef readonly Py_ssize_t opened      # items opened or reopened through this budget, ever
    cdef readonly Py_ssize_t parked      # ... and parked by it
    cdef object lock
    cpdef admit(self, Budgeted item)
    cpdef leave(self, Budgeted item)
    cdef void _free(self, Py_ssize_t slot)
    cdef int _shrink(self) except -1
