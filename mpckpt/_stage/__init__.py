"""The training thread's side of a save: state -> slabs of shared memory -> write jobs.

``snapshot`` flattens a state (bad input fails before anything is written; the values it
stores beyond tensors and JSON are ``_codec.values``), ``layout`` plans
waves and shard files, ``budget`` takes slabs from the ``arena`` (segments: ``_system.shm``) under
the budget policy, ``reuse`` references unchanged frozen shards, ``copier`` and ``overlap``
copy, and ``saving.Snapshotter`` runs all of it for one ``save``.
"""
