# The framed redo-log layout (pyx/_redolog.pyx; docs/FORMAT.md documents
# the same), for _redolog.pyx and for the decoders of the frames' payloads.
#
#   file:  u32 magic "TXRL", u8 version 1, 3 reserved bytes, then frames
#   frame: u32 length (1 + payload bytes), u32 crc32c of type and payload,
#          u8 type (1 = SNAPSHOT), payload
cdef enum:
    REDO_MAGIC = 0x4C525854
    REDO_VERSION = 1
    FILE_HEADER_SIZE = 8
    FRAME_LENGTH_OFFSET = 0
    FRAME_CRC_OFFSET = FRAME_LENGTH_OFFSET + 4
    FRAME_TYPE_OFFSET = FRAME_CRC_OFFSET + 4
    FRAME_HEADER_SIZE = FRAME_TYPE_OFFSET + 1
    MAX_FRAME_BYTES = 1 << 30


cdef inline Py_ssize_t payload_position(tuple frame) except? -1:
    """The file position of a frame's payload: a frame as ``_redolog.parse``
    gives it, ``(type, payload, position of the frame)``; a ``(type,
    payload)`` pair has none, and its payload's bytes count from 0."""
    if len(frame) > 2:
        return <Py_ssize_t>frame[2] + FRAME_HEADER_SIZE
    return 0
