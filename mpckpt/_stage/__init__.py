"""The training thread's side of a save: state -> slabs of shared memory -> write jobs.

The state is flattened by ``_codec.snapshot`` (bad input fails before anything is written),
``layout`` plans
waves and shard files, ``budget`` takes slabs from the ``arena`` (segments: ``_system.shm``) under
the budget policy, ``reuse`` references unchanged frozen shards, ``copier`` and ``overlap``
copy, and ``saving.Snapshotter`` runs all of it for one ``save``.
"""
