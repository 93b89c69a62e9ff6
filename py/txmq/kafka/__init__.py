"""txmq's Kafka protocol front end (docs/KAFKA.md).

``txmq.kafka.serve_kafka(broker, host, port)`` serves an open :class:`txmq.Broker` to
Kafka clients; ``txmq serve DIR --kafka HOST:PORT`` does so from the
command line. Package layout, by role:

- ``schema_data`` / ``schema``: Kafka's request and response definitions
  and their compiled form; ``protocol``: framing, versions served, error
  codes (the body codec is the Cython module ``txmq._kafka``);
- ``records``: record batches v2 to and from txmq batches, compression
  (the batch codec is the Cython module ``txmq._kafka_records``);
- ``server``: the asyncio server and its connections; ``handlers``:
  dispatch and the cluster APIs; ``data``: Produce, Fetch, ListOffsets;
  ``groups``: consumer groups and their offsets; ``txns``: producer ids
  and transactions.
"""

from txmq.kafka.server import DEFAULT_PORT, KafkaServer, serve_kafka

__all__ = ["serve_kafka", "KafkaServer", "DEFAULT_PORT"]
