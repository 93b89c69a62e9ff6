"""Dispatch (docs/ARCHITECTURE.md): a subscription's lanes and the delivery
of its messages to consumers (:mod:`.subscription`), and its acks held in
open transactions, kept apart from it (:mod:`.pending_acks`)."""
