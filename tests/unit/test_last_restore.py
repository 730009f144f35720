"""``ckpt.last_restore`` reads well printed: seconds to the millisecond in its repr, and a line a
person reads in its str."""

from __future__ import annotations

from mpckpt._futures import LastRestore


def test_last_restore_prints_short():
    last = LastRestore(step=41, source="memory", seconds=0.12345678901234567, bytes=3 << 30)
    assert repr(last) == "LastRestore(step=41, source='memory', seconds=0.123, bytes=3221225472)"
    assert str(last) == "step 41 restored from memory in 0.12 s (3.0 GiB)"
    assert str(LastRestore(step=0, source="storage", seconds=2.0, bytes=512)) == \
        "step 0 restored from storage in 2.00 s (512 bytes)"
