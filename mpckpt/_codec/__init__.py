"""A state's encoding, both ways: the encoder beside its decoder.

Encoding: ``snapshot.flatten`` walks a state into a skeleton tree and a table of tensors (bad
input fails here, before anything is written); ``recall`` takes the last walk over while nothing
changed, ``optim_state`` numbers an optimizer's parameters once, ``signatures`` checks the table's
tensors are the last walk's, ``dtensor`` stores a DTensor (or a placed chunk) by its local shard.
``values`` encodes the value kinds beyond tensors and JSON, both ways. Decoding: ``tree`` turns a
skeleton back into tensors and values; both read paths (``_read``) use it. Nothing here stages,
uploads, commits or reads storage.
"""
