"""What a multi-rank job on torch.distributed adds below the pipeline: the rank group (``group``;
a single process is a group of one) and the plan of who writes what (``plan``). How a DTensor is stored, by its local shard, is the
encoding's (``_codec.dtensor``); the job's other parts live with their layer: its skeleton with
the stages (``_stage.rank_skeleton``), its two-phase commit with the commit (``_commit.ranked``),
its collective open with the open (``_opening.take_root``), reading back at any world size with the
read side (``_read.regions``, ``_read.ranked``)."""
