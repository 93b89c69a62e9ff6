"""Transactions (docs/ARCHITECTURE.md): transaction ids and records
(:mod:`.records`), the transaction coordinator and its log
(:mod:`.coordinator`), and the producer-id / transactional-id registry
(:mod:`.producer_ids`). Storage imports only the ids and records from
here."""
