"""A subscription's cursor log (storage/cursor.py, docs/FORMAT.md): its
compaction keeps the state of the frame that triggered it."""

from txmq.storage.cursor import COMPACT_FRAMES, Cursor


def test_cursor_compaction_keeps_the_frame_that_triggered_it(tmp_path):
    path = str(tmp_path / "cursor.log")
    c = Cursor(path, "never", 0, 0)
    for off in range(COMPACT_FRAMES + 5):
        c.ack([off])
    c.close()
    c = Cursor(path, "never", 0, 0)
    assert c.mark_delete == COMPACT_FRAMES + 5 and c.acked.count() == 0
    for _ in range(COMPACT_FRAMES):
        c.reset(5)
    c.close()
    assert Cursor(path, "never", 0, 0).mark_delete == 5
