"""The local requester (docs/ARCHITECTURE.md): what another process of this
machine uses on a data directory that one process owns — the read-only
view (:mod:`.read_only_directory`), staged writes and their commit
(:mod:`.staged_ingest`), and requests through the owner's control socket,
opening the directory itself when no process owns it
(:mod:`.control_client`). Public names: :mod:`txmq.readonly`,
:mod:`txmq.ingest`, :mod:`txmq.control`."""
