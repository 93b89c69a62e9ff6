# Declarations of pyx/_arrow_batch.pyx (a stored batch handed to Arrow) for
# the modules that cimport it; see pyx/txmq/_mapping.pxd for why this file
# lives here.
from _batch_layout cimport Sections


cdef dict arrow_views(object buffer, const char *p, Sections s, object path, Py_ssize_t pos)
cdef object arrow_record_batch(object buffer, const char *p, Sections s, object path, Py_ssize_t pos,
                               Py_ssize_t first, Py_ssize_t n, str topic, int partition)
