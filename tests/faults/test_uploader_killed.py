"""SIGKILL an uploader process at a random instant while saves are in flight (3 trials).

The short CI version of ``scripts/soak.py``'s uploader campaign: every save either commits or
fails with an ``UploadError`` naming its step, no wait runs past its bound, the dead
uploader is replaced, and every committed checkpoint loads back bit for bit.
"""

from __future__ import annotations

import random

import pytest

from scripts.soak import Tally, uploader_trial


@pytest.mark.parametrize("trial", range(3))
def test_uploader_sigkilled_mid_save(tmp_path, trial):
    tally = Tally("uploader")
    uploader_trial(trial, random.Random(trial), tally, bound_s=60.0, workdir=str(tmp_path))
    assert tally.faults_injected == 1
    assert tally.hangs == 0, tally.notes
    assert tally.unclear_errors == 0, tally.notes
    assert tally.committed_lost == 0, tally.notes
    assert tally.wrong_returned == 0, tally.notes
    assert tally.saves_committed + tally.saves_failed_cleanly == 6, tally
