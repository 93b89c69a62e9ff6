"""The broker (docs/ARCHITECTURE.md): :class:`~txmq.broker.broker.Broker`,
the owner of a data directory; the owner's side of staged commits
(:mod:`.staged_commits`) and of the control socket (:mod:`.control_socket`)."""
