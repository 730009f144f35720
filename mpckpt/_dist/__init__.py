"""What a multi-rank job on torch.distributed adds below the pipeline: the rank group (``group``),
the plan of who writes what (``plan``) and DTensors by local shard (``dtensor``). The job's
other parts live with their layer: its skeleton with the stages (``_stage.rank_skeleton``), its
two-phase commit with the commit (``_commit.ranked``), its collective open beside the open
(``_opening_job``), reading back at any world size with the read side (``_read.regions``,
``_read.ranked``)."""
