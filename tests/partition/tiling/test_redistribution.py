"""Redistributing tiles: the bytes each conversion between tilings moves, against the
planner's cost model (the collectives themselves, with real processes:
tests/jobs/test_collectives.py).
"""
import itertools

import numpy as np
import pytest

from tests.support.launch import run_worker
from tfpar.partition.tiling import redistribution
from tfpar.partition.tiling.cuts import RED, Cut, Tiling, convert_cost


@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("src,dst", [(s, d) for s in (0, 1, None, RED) for d in (0, 1, None)])
def test_one_cut_conversions_move_what_the_cost_model_counts(m, src, dst):
    shape = (12, 24)
    moved = redistribution.moved(Tiling((Cut(src, m),)), Tiling((Cut(dst, m),)), shape)
    assert moved == pytest.approx(convert_cost(src, dst, shape[0] * shape[1], m))


def test_hierarchical_conversion_moves_within_groups_only():
    """'rR' -> 'rr' is an all-gather inside each group of 2: nothing crosses the first cut."""
    ex = redistribution.exchange(Tiling.parse("rR"), Tiling.parse("rr"), (8, 4))
    assert ex.moved == 4 * 16
    assert all(t.src // 2 == t.dst // 2 for t in ex.transfers)


def test_the_adjoint_exchange_is_the_transpose():
    ex = redistribution.exchange(Tiling.parse("R3"), Tiling.parse("C3"), (7, 5))
    back = ex.adjoint()
    assert back.adjoint().transfers == ex.transfers
    assert back.in_shapes == ex.out_shapes and back.moved == ex.moved


def test_bad_conversions_say_why():
    from tfpar.errors import TfparError
    with pytest.raises(TfparError, match="for 4 devices, not 2"):
        redistribution.exchange(Tiling.parse("R"), Tiling.parse("RC"), (4, 4))
    with pytest.raises(TfparError, match="partial sums"):
        redistribution.exchange(Tiling.parse("R"), Tiling.parse("+"), (4, 4))
