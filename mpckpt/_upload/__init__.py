"""Write jobs -> files on storage, in uploader processes outside the training process's GIL.

``pool`` dispatches jobs to the uploaders and brings results and failures back (they start
without the user's main module: ``_system.spawn``), ``worker`` is the uploader itself (it never
imports torch), and ``directory`` turns ``report(checkpoint=...)`` into upload jobs.
"""
