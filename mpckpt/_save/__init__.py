"""A save's orchestration, above the stages it drives: ``saving.Snapshotter`` runs one ``save``
(the walk through ``_codec``, the layout, the copy into a slab through ``_stage``, the write jobs
to ``_upload``'s pool, the record in the ``_ledger``), and ``budget.Budget`` takes slabs under
the budget policy, cancelling pool jobs and dropping ledger records when a policy coalesces.
The stages below it know nothing of each other.
"""
