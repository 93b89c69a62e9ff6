# cython: boundscheck=False, wraparound=False
"""CRC-32C for the Python layers: the checksum every txmq format uses
(csrc/crc32c.c, through ``_bytes.pxd``), over any bytes-like object.

The Cython modules call ``crc32c`` from ``_bytes.pxd`` directly; this module
is for the coordinators, the command-line checks and the tests.
"""
from libc.stdint cimport uint8_t, uint32_t

from _bytes cimport txmq_crc32c_update, txmq_crc32c_software, txmq_crc32c_hardware, NOGIL_THRESHOLD


def crc32c_of(data, uint32_t crc=0, bint software=False):
    """CRC-32C of a bytes-like object, continuing ``crc`` (0 to start).

    ``software=True`` forces the table path, so tests can check it on a CPU
    that has the instruction.
    """
    cdef const uint8_t[::1] view = data
    cdef Py_ssize_t n = view.shape[0]
    if n == 0:
        return crc
    if software:
        return txmq_crc32c_software(crc, &view[0], n)
    if n >= NOGIL_THRESHOLD:
        with nogil:
            crc = txmq_crc32c_update(crc, &view[0], n)
        return crc
    return txmq_crc32c_update(crc, &view[0], n)


def crc32c_hardware():
    """True when CRC-32C runs on the CPU's instruction."""
    return bool(txmq_crc32c_hardware())
