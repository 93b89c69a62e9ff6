"""txmq: an embedded, high-throughput transactional message broker.

>>> import txmq
>>> with txmq.Broker("data") as broker:                # doctest: +SKIP
...     broker.create_topic("orders", partitions=4)
...     broker.producer("orders").send(b"hello", key=b"k")
"""

from txmq import errors
from txmq.broker import Broker
from txmq.consumer import Consumer
from txmq.half import HalfProducer, HalfSendResult, LocalTransactionState
from txmq.message import AbortedTransaction, Message, MessageId, MessageIds
from txmq.producer import Producer
from txmq.transaction import Transaction
from txmq.transactional import TransactionalProducer
from txmq.txn import TxnID, TxnState
from txmq import functions  # noqa: F401  (exactly-once functions: txmq.functions.Function)

__all__ = ["AbortedTransaction", "Broker", "Consumer", "HalfProducer", "HalfSendResult", "LocalTransactionState",
           "Message", "MessageId", "MessageIds", "Producer",
           "Transaction", "TransactionalProducer", "TxnID", "TxnState", "errors"]
__version__ = "0.1.0"
