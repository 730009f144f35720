"""The skeleton's encoding of values: ``values`` (the extra value kinds, both ways) and
``tree`` (the way back, from a skeleton to tensors and values). The save side's walk that
writes a skeleton is ``_stage.snapshot``; both read paths (``_read``) decode with ``tree``."""
