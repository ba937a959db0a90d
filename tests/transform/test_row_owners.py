"""Which worker owns which row of a sharded table (tfpar.transform.sharded.RowOwners), and
the tiles of a cyclic tiling put back together (collectives.cyclic_positions) and written
by a row scatter (partial_writes.rows_in with a step): the arithmetic of route "sharded"'s
two row layouts, on one process (the collectives around it run in tests/jobs)."""
import numpy as np
import pytest
import tensorflow as tf

from tfpar.partition.tiling.cuts import Tiling
from tfpar.transform import partial_writes
from tfpar.transform.collectives import cyclic_positions
from tfpar.transform.sharded import RowOwners, _by_owner

tf1 = tf.compat.v1
CASES = [(20, 3), (9, 2), (7, 7), (6, 4), (11, 1)]


def _run(build):
    """The value of what `build()` makes, in a graph of its own (eager is off)."""
    graph = tf.Graph()
    with graph.as_default():
        fetches = build()
    with tf1.Session(graph=graph) as session:
        return session.run(fetches)


@pytest.mark.parametrize("rows,n", CASES)
@pytest.mark.parametrize("way", ["M", "R"])
def test_every_id_finds_its_row_on_its_owner(rows, n, way):
    """owner(id) holds row id of the whole at local(id) of its tile; _by_owner sorts ids
    by owner and counts them."""
    tiling = Tiling.parse(f"{way}{n}")
    whole = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    tiles = [whole[tiling.tile_slices(whole.shape, k)] for k in range(n)]
    owners = RowOwners.of(tiling, whole.shape)
    ids = np.random.RandomState(rows).randint(0, rows, size=50)
    owner = _run(lambda: owners.owner(tf.constant(ids, tf.int64)))
    for k in range(n):
        local = _run(lambda: owners.local(tf.constant(ids[owner == k], tf.int64), k))
        np.testing.assert_array_equal(tiles[k][local], whole[ids[owner == k]])
    sorted_ids, splits, order = _run(lambda: _by_owner(tf.constant(ids), owners))
    np.testing.assert_array_equal(splits, np.bincount(owner, minlength=n))
    np.testing.assert_array_equal(sorted_ids, ids[order])
    assert (np.diff(owner[order]) >= 0).all()


@pytest.mark.parametrize("rows,n", CASES)
def test_cyclic_tiles_in_order_gathered_by_position_are_the_whole(rows, n):
    """collectives.whole of a cyclic tiling: the tiles one after another (what the range
    gather gives), gathered at cyclic_positions, are the whole table again."""
    tiling = Tiling.parse(f"M{n}")
    whole = np.random.RandomState(n).rand(rows, 3).astype(np.float32)
    stacked = np.concatenate([whole[tiling.tile_slices(whole.shape, k)] for k in range(n)])
    got = _run(lambda: tf.gather(stacked, cyclic_positions(rows, n)))
    np.testing.assert_array_equal(got, whole)


def test_a_row_scatter_writes_each_worker_its_own_rows_of_a_cyclic_tiling():
    """rows_in with a step: each worker gets the ids dealt to it, made local (id // n),
    with their rows; every id lands on exactly one worker."""
    rows, n = 10, 3
    graph = tf.Graph()
    with graph.as_default():
        table = tf1.Variable(tf.zeros([rows, 2]), use_resource=True)
        ids = tf.constant([9, 0, 4, 5, 3])
        updates = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2])
        scatter = tf1.scatter_update(table, ids, updates).op
        tiling = Tiling.parse(f"M{n}")
        picked = []
        for k in range(n):
            box = tiling.tile_slices((rows, 2), k)[0]
            picked.append(partial_writes.rows_in(scatter, rows, box.start, box.stop,
                                                 (), box.step))
    with tf1.Session(graph=graph) as session:
        got = session.run(picked)
    whole = np.zeros([rows, 2], np.float32)
    for k, (local, values) in enumerate(got):
        whole[np.asarray(local) * n + k] = values
    expected = np.zeros([rows, 2], np.float32)
    expected[[9, 0, 4, 5, 3]] = np.arange(10).reshape(5, 2)
    np.testing.assert_array_equal(whole, expected)
    assert [len(local) for local, _ in got] == [3, 1, 1]  # 9, 0, 3 | 4 | 5
