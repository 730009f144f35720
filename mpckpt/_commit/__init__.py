"""From durable files to committed checkpoints, strictly in save order.

``ledger`` owns every checkpoint record and every change to it, ``committer`` commits them in
order through the ``coordinator`` seam and applies retention, ``deleter`` deletes what
retention let go of, ``deletion`` refuses or carries out the deletions a user asks for
(``Checkpointer.delete``, ``discard_newer``, ``mpckpt rm``, a fallback's set-aside), ``shared`` says who uses which file outside its own folder (shared files,
older references) and removes the shared files no manifest lists, and ``sink`` is the one
place background failures are raised from.
"""
