"""The storage layer: a partition's files and what they hold.

``layout`` names every file of a partition directory and parses its
fixed-layout side files; ``index`` is the offset and time indexes;
``loader`` is the one walk over a partition's segments at open (writer,
read-only and check modes); ``delivery`` is what a reader may see at a
position; ``txnbuffer`` is what a transactional batch does to the
transaction buffer; ``partition`` composes them into the writer's
:class:`~txmq.storage.partition.Partition`. Nothing here imports the
broker, subscriptions or clients.
"""
