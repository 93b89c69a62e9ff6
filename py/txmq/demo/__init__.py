"""The demo: the two scenarios txmq was built for (a bank with
consume-process-produce transactions, and a windowed aggregation function),
each SIGKILLed part-way and restarted, then checked against a recomputation
from the log; and a Spark read of the output.

- :mod:`txmq.demo.scenarios`: :func:`~txmq.demo.scenarios.run`, the whole
  demo as data (the checks), with no printing;
- :mod:`txmq.demo.bank`, :mod:`txmq.demo.windows`: each scenario's work
  and its verification;
- :mod:`txmq.demo.worker`: the subprocess that runs a scenario and is
  killed, and the driver that kills and restarts it;
- :mod:`txmq.demo.spark`: the Spark read, in its own process.

``txmq demo`` (:mod:`txmq.cli.demo`) prints it.
"""
