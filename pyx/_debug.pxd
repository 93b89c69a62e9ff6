# How often the Cython tables re-check their invariants under TXMQ_DEBUG:
# after every change of a table of up to DEBUG_SMALL entries, and after
# every n/64-th change of a larger table of n entries, so that a check's
# O(n) costs O(64) amortised per change.

cdef enum:
    DEBUG_SMALL = 1024


cdef inline bint check_due(Py_ssize_t *changes, Py_ssize_t *next_check, Py_ssize_t n) noexcept:
    """Count one change; True when the full check is due now."""
    changes[0] += 1
    if changes[0] < next_check[0]:
        return False
    next_check[0] = changes[0] + 1 + (0 if n <= DEBUG_SMALL else n // 64)
    return True
