"""What the tests and the benchmarks share, and neither owns: simulated nodes (``nodes``), the
storage servers they start on 127.0.0.1 (``servers``: moto's S3, Azurite), a proxy that injects
storage faults (``fault_proxy``) and a small torch.distributed job (``job``). Not shipped with
mpckpt (``setup.cfg`` packages only ``mpckpt``); ``tests/`` and ``bench/`` import it, never each
other.
"""
