"""Retention (the broker's background work; Broker docstring): by time and
by size, whole segments only, never at or above any subscription's
mark-delete, never the active segment; readers carry on across deleted
segments."""

from __future__ import annotations

import glob
import os
import time

import txmq

SEG = 4096
OPTS = dict(fsync="never", segment_bytes_max=SEG, max_message_bytes=1024,
            retention_check_interval=3600)


def value(i: int) -> bytes:
    return b"v%05d-" % i + bytes(150)


def fill(broker, topic, n, start=0):
    prod = broker.producer(topic)
    return [prod.send(value(i)) for i in range(start, start + n)]


def seg_files(broker, topic, p=0):
    """{base offset: size} of the segment files on disk."""
    d = os.path.join(broker.path, "topics", topic, str(p))
    return {int(os.path.basename(f)[:-4]): os.path.getsize(f) for f in glob.glob(os.path.join(d, "*.log"))}


def part(broker, topic, p=0):
    return broker.stats()["topics"][topic]["partitions"][p]


def drain(c, timeout=0.0, n=1000):
    out = []
    while ms := c.receive_many(n, timeout=timeout):
        out.extend(ms)
    return out


def test_size_retention_only_below_every_mark_delete(tmp_path):
    with txmq.Broker(tmp_path / "d", **OPTS) as b:
        b.create_topic("t", 1, retention_bytes=3 * SEG)
        a = b.subscribe("t", "a", "exclusive", initial_position="earliest")
        s = b.subscribe("t", "b", "exclusive", initial_position="earliest")
        ids = fill(b, "t", 300)
        before = seg_files(b, "t")
        assert len(before) >= 10
        # Nobody acknowledged anything: all data stays, however big.
        assert b.enforce_retention() == 0
        assert part(b, "t")["start_offset"] == 0 and seg_files(b, "t") == before

        a.ack_cumulative(drain(a)[-1])          # a has everything
        assert b.enforce_retention() == 0, "b has acknowledged nothing and must keep all data"

        got_b = drain(s)
        s.ack_cumulative(got_b[99])             # b: everything below 100
        n = b.enforce_retention()
        after = seg_files(b, "t")
        bases = sorted(after)
        assert n > 0 and n == len(before) - len(after)
        assert part(b, "t")["segments"] == len(after)
        assert part(b, "t")["start_offset"] == bases[0]
        # Exactly the segments that end at or below b's mark-delete went.
        assert bases[0] <= 100 < bases[1]
        assert set(after) == {x for x in before if x >= bases[0]}
        assert all(after[x] == before[x] for x in after)
        assert part(b, "t")["end_offset"] == 300
        # b reads on from its mark-delete (its outstanding 100..299 were
        # delivered already; a new consumer gets them again).
        s.close()
        s = b.subscribe("t", "b", "exclusive")
        again = drain(s)
        assert [m.offset for m in again] == list(range(100, 300))
        assert [m.value for m in again] == [value(i) for i in range(100, 300)]
        # Once b is done too, size decides: delete from the front while over the limit.
        s.ack_cumulative(again[-1])
        sizes = seg_files(b, "t")
        n2 = b.enforce_retention()
        left = seg_files(b, "t")
        assert n2 == len(sizes) - len(left) > 0
        total = sum(left.values())
        assert total <= 3 * SEG or len(left) == 1
        last_deleted = max(x for x in sizes if x not in left)
        assert total + sizes[last_deleted] > 3 * SEG, "deleted more than the size limit asked"
        assert max(left) == max(sizes), "the active segment is never deleted"
        assert b.enforce_retention() == 0
        assert ids[-1].offset == 299


def test_time_retention_and_topic_override(tmp_path):
    with txmq.Broker(tmp_path / "d", retention_ms=300, **OPTS) as b:
        b.create_topic("t", 1)                                  # broker default: 300 ms
        b.create_topic("keep", 1, retention_ms=3_600_000)       # its own: an hour
        subs = {t: b.subscribe(t, "s", "exclusive", initial_position="earliest") for t in ("t", "keep")}
        for t in subs:
            fill(b, t, 120)
            subs[t].ack_cumulative(drain(subs[t])[-1])
        segs = len(seg_files(b, "t"))
        assert segs >= 4
        assert b.enforce_retention() == 0, "segments younger than retention_ms were deleted"
        time.sleep(0.45)
        n = b.enforce_retention()
        assert n == segs - 1, "every sealed, fully acknowledged, old segment goes; the active one stays"
        assert len(seg_files(b, "t")) == 1
        assert part(b, "t")["start_offset"] == min(seg_files(b, "t")) > 0
        assert part(b, "t")["end_offset"] == 120
        assert part(b, "keep")["start_offset"] == 0 and len(seg_files(b, "keep")) >= 4
        # After the deletion the log goes on where it was.
        mid = b.producer("t").send(b"next")
        assert mid.offset == 120
        assert [m.value for m in drain(subs["t"])] == [b"next"]


def test_no_subscription_means_nothing_protects_old_segments(tmp_path):
    with txmq.Broker(tmp_path / "d", retention_bytes=0, **OPTS) as b:
        b.create_topic("t", 2)
        prod = b.producer("t")
        for i in range(200):
            prod.send(value(i), partition=i % 2)
        before = [len(seg_files(b, "t", p)) for p in range(2)]
        assert b.enforce_retention() == sum(before) - 2
        for p in range(2):
            assert len(seg_files(b, "t", p)) == 1
            assert part(b, "t", p)["end_offset"] == 100
        # A subscription created now at earliest starts at the new start.
        c = b.subscribe("t", "late", "exclusive", initial_position="earliest")
        got = drain(c)
        for p in range(2):
            offs = [m.offset for m in got if m.partition == p]
            assert offs == list(range(part(b, "t", p)["start_offset"], 100))


def test_consumer_reads_across_deleted_segments(tmp_path):
    with txmq.Broker(tmp_path / "d", retention_bytes=0, **OPTS) as b:
        b.create_topic("t", 1)
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest", nack_delay=0)
        fill(b, "t", 400)
        got = []
        while len(got) < 150:
            ms = c.receive_many(7, timeout=0)
            got.extend(ms)
        # Acknowledge below 100 only; 100..(len-1) are out at the consumer.
        c.ack_cumulative(got[99])
        assert b.enforce_retention() > 0
        start = part(b, "t")["start_offset"]
        assert 0 < start <= 100
        # Retention deleted the segments the consumer had just read from;
        # it goes on with the rest, in order, without gaps or repeats.
        rest = drain(c, n=13)
        offs = [m.offset for m in got + rest]
        assert offs == list(range(400))
        assert [m.value for m in rest] == [value(i) for i in range(len(got), 400)]
        # Messages still outstanding from before the deletion can be redelivered.
        c.nack(got[100:110])
        back = c.receive_many(20, timeout=1)
        assert [m.offset for m in back] == list(range(100, 110))
        assert [m.value for m in back] == [value(i) for i in range(100, 110)]
        assert all(m.redelivery_count == 1 for m in back)
        # seek below the start lands on the start.
        c.seek("earliest")
        first = c.receive(timeout=0)
        assert first.offset == start and first.value == value(start)
        c.seek(0)
        assert c.receive(timeout=0).offset == start
        c.ack_cumulative(drain(c)[-1])
    # Reopen: the deleted segments stay gone and everything else is intact.
    with txmq.Broker(tmp_path / "d", **OPTS) as b:
        assert part(b, "t")["start_offset"] == start
        assert part(b, "t")["end_offset"] == 400
        assert not part(b, "t")["truncated_on_open"]
        c = b.subscribe("t", "s2", "exclusive", initial_position="earliest")
        again = drain(c)
        assert [m.offset for m in again] == list(range(start, 400))
        assert [m.value for m in again] == [value(i) for i in range(start, 400)]
        assert b.stats()["topics"]["t"]["subscriptions"]["s"]["backlog"] == 0


def test_background_retention_runs_on_its_own(tmp_path):
    opts = dict(OPTS, retention_check_interval=0.05)
    with txmq.Broker(tmp_path / "d", retention_bytes=0, **opts) as b:
        b.create_topic("t", 1)
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest")
        fill(b, "t", 200)
        time.sleep(0.3)
        assert part(b, "t")["start_offset"] == 0, "the scheduler deleted unacknowledged data"
        c.ack_cumulative(drain(c)[-1])
        deadline = time.monotonic() + 5
        while part(b, "t")["segments"] > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert part(b, "t")["segments"] == 1
        assert len(seg_files(b, "t")) == 1
        assert part(b, "t")["end_offset"] == 200


def test_individual_acks_above_a_hole_keep_the_segment(tmp_path):
    """Only mark-delete protects: acks above an unacknowledged message do not
    let retention delete the segment holding that message."""
    with txmq.Broker(tmp_path / "d", retention_bytes=0, **OPTS) as b:
        b.create_topic("t", 1)
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest")
        fill(b, "t", 200)
        ms = drain(c)
        c.ack([m for m in ms if m.offset != 42])
        b.enforce_retention()
        assert part(b, "t")["start_offset"] <= 42
        c.close()
        c = b.subscribe("t", "s", "exclusive")
        back = drain(c)
        assert [m.offset for m in back] == [42] and back[0].value == value(42)
