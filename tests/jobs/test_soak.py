"""A short soak: a HYBRID job (clipping, EMA, two PS variables, Adam) runs 2,400 steps on
2 workers with real parameter servers, and no process grows.

Margin: the resident memory of each worker and of the PS, measured after 600 steps (when
TensorFlow's allocators and gRPC buffers have reached their working size) and at 2,400,
grows by less than 25 MB. A leak of one small tensor or one op per step would exceed it
(1,800 steps). `scripts/` is the place for hour-long soaks; this one takes about a minute.
"""
import json
import os

import pytest

from tests.support.launch import WORKERS, horovodrun


STEPS = 2400
MARGIN = 25 * 2**20


def test_memory_stays_flat_over_thousands_of_steps(tmp_path):
    proc = horovodrun(2, os.path.join(WORKERS, "soak.py"), str(tmp_path), str(STEPS),
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, info in enumerate(infos):
        early, late = info["marks"][str(STEPS // 4)], info["marks"][str(STEPS)]
        assert info["communication"]["steps"] == STEPS
        for role in ("worker", "ps"):
            if early[role]:
                growth = late[role] - early[role]
                assert growth < MARGIN, (f"{role} of rank {r} grew by {growth / 2**20:.1f} MB "
                                         f"from step {STEPS // 4} to {STEPS}: {info}")
    assert infos[0]["marks"][str(STEPS)]["ps"] > 0  # worker 0 spawned the PS and measured it
