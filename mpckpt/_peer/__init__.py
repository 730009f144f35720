"""Node loss: copies of each rank's kept snapshot in other nodes' memory, and restoring from them.

``node`` (which node a rank is on, who holds whose copies), ``link`` (mpckpt's own gloo group
and store connections), ``replicate`` (sending and receiving copies in the background),
``inventory`` (what the job holds at a restore, the plan, the ``memory``/``peer`` sources),
``serve`` (reading another node's memory during a restore), ``tier`` (all of it wired for one
rank of a job).
"""
