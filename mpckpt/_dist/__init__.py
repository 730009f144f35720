"""Multi-rank checkpoints on torch.distributed: the rank group and the collective open, the plan
of who writes what, each rank's skeleton, the two-phase commit over the job's store, and DTensors
by local shard (``dtensor``). Reading back at any world size is the read side's (``_read.regions``,
``_read.ranked``)."""
