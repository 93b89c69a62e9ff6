"""txmq: an embedded, high-throughput transactional message broker.

>>> import txmq
>>> with txmq.Broker("data") as broker:                # doctest: +SKIP
...     broker.create_topic("orders", partitions=4)
...     broker.producer("orders").send(b"hello", key=b"k")
"""

from txmq import errors
from txmq.broker.broker import Broker
from txmq.client.consumer import Consumer
from txmq.client.half_producer import HalfProducer, HalfSendResult
from txmq.storage.half_messages import LocalTransactionState
from txmq.message import AbortedTransaction, Message, MessageId, MessageIds
from txmq.client.producer import Producer
from txmq.client.transaction import Transaction
from txmq.client.transactional_producer import TransactionalProducer
from txmq.transactions.records import TxnID, TxnState
from txmq import functions  # noqa: F401  (exactly-once functions: txmq.functions.Function)

__all__ = ["AbortedTransaction", "Broker", "Consumer", "HalfProducer", "HalfSendResult", "LocalTransactionState",
           "Message", "MessageId", "MessageIds", "Producer",
           "Transaction", "TransactionalProducer", "TxnID", "TxnState", "errors"]
__version__ = "0.1.0"
