"""The operating system's parts both sides of mpckpt use (the training process and the uploader
and validator processes): shared-memory segments (``shm``), how mpckpt's processes start
(``spawn``) and what they share (``processes``). The bottom layer: it imports nothing of
mpckpt's but ``errors``.
"""
