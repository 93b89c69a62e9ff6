import os

# O(n) self-checks (full log verification after every open) in every test,
# including the brokers that tests start in subprocesses.
os.environ.setdefault("TXMQ_DEBUG", "1")
