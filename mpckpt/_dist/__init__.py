"""Multi-rank checkpoints on torch.distributed: the rank group, the plan of who writes what,
the two-phase commit over the job's store, and reading back at any world size."""
