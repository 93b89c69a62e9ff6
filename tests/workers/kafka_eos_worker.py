"""One member of an exactly-once consume-transform-produce group, written
the way a Kafka application is (confluent-kafka, KIP-447): a
read_committed consumer in a group, a transactional producer, and per
batch of input one transaction holding the outputs and, through
``send_offsets_to_transaction``, the consumed offsets.

    python kafka_eos_worker.py BOOTSTRAP TRANSACTIONAL_ID GROUP IN OUT DIR

It writes ``b"out:" + value`` to OUT (same key) for every input value. In
DIR (shared with the test driving it) it watches two files:

- ``hold-<TRANSACTIONAL_ID>``: while it exists, the worker stops inside
  its next transaction, after producing the outputs and before
  committing, having printed ``holding`` — a stalled instance that another
  one may fence;
- ``stop``: once it exists and no input came for a second, the worker
  exits 0.

Stdout gets one line per event (``ready``, ``committed N``, ``aborted``,
``holding``, ``fenced``). A fenced instance (PRODUCER_FENCED or another
fatal transactional error) exits with FENCED_EXIT.
"""

import os
import sys
import time

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException, TopicPartition

FENCED_EXIT = 3
BATCH = 20
PAUSE_S = 0.02          # work per transaction, so a stream of input takes a while


def say(*words) -> None:
    print(*words, flush=True)


def rewind(consumer) -> None:
    """After an abort: back to the committed offsets, so the aborted input
    is consumed again."""
    assignment = consumer.assignment()
    if not assignment:
        return
    for tp in consumer.committed(assignment, timeout=30):
        consumer.seek(TopicPartition(tp.topic, tp.partition,
                                     tp.offset if tp.offset >= 0 else confluent_kafka.OFFSET_BEGINNING))


def main(bootstrap, tid, group, topic_in, topic_out, folder) -> int:
    hold, stop = os.path.join(folder, f"hold-{tid}"), os.path.join(folder, "stop")
    consumer = confluent_kafka.Consumer({
        "bootstrap.servers": bootstrap, "group.id": group, "isolation.level": "read_committed",
        "enable.auto.commit": False, "auto.offset.reset": "earliest", "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500, "max.poll.interval.ms": 30000, "client.id": tid})
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                                         "transaction.timeout.ms": 60000, "linger.ms": 2})
    producer.init_transactions(30)
    consumer.subscribe([topic_in])
    say("ready")
    idle_since = time.monotonic()
    try:
        while True:
            msgs = [m for m in consumer.consume(BATCH, 0.2) if m.error() is None]
            if not msgs:
                if os.path.exists(stop) and time.monotonic() - idle_since > 1.0:
                    return 0
                continue
            idle_since = time.monotonic()
            try:
                producer.begin_transaction()
                for m in msgs:
                    producer.produce(topic_out, key=m.key(), value=b"out:" + m.value())
                producer.flush(30)
                if os.path.exists(hold):
                    say("holding")
                    while os.path.exists(hold):
                        time.sleep(0.05)
                time.sleep(PAUSE_S)
                producer.send_offsets_to_transaction(consumer.position(consumer.assignment()),
                                                     consumer.consumer_group_metadata(), 30)
                producer.commit_transaction(30)
                say("committed", len(msgs))
            except KafkaException as e:
                err = e.args[0]
                if err.fatal() or err.code() == KafkaError._FENCED or \
                        err.code() == KafkaError.PRODUCER_FENCED:
                    say("fenced", err.name())
                    return FENCED_EXIT
                if not err.txn_requires_abort():
                    raise
                producer.abort_transaction(30)
                say("aborted", err.name())
                rewind(consumer)
    finally:
        consumer.close()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:7]))
