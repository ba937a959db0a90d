"""The parts of a variable on the parameter servers: each part's rows cut from the whole
value and the whole put back from the parts, for row ranges and rows dealt out modulo."""
import numpy as np
import pytest
import tensorflow as tf

from tfpar.plan import PartPlan
from tfpar.transform.parameter_server import piece_of, whole_of

ROWS = 11


@pytest.mark.parametrize("parts", [
    [PartPlan(0, 0, 6), PartPlan(1, 6, 11)],  # ranges, the first one larger
    [PartPlan(0, 0, ROWS, 3), PartPlan(1, 1, ROWS, 3), PartPlan(0, 2, ROWS, 3)],  # modulo 3
    [PartPlan(0)],  # whole
], ids=["ranges", "modulo", "whole"])
def test_pieces_and_the_whole(parts):
    value = np.arange(ROWS * 2, dtype=np.float32).reshape(ROWS, 2)
    graph = tf.Graph()
    with graph.as_default():
        whole = tf.constant(value)
        pieces = [piece_of(whole, p) for p in parts]
        back = whole_of(pieces, parts)
        with tf.compat.v1.Session() as sess:
            got_pieces, got = sess.run([pieces, back])
    for p, piece in zip(parts, got_pieces):
        rows = list(range(ROWS)) if p.stop is None else list(range(p.start, p.stop, p.step))
        np.testing.assert_array_equal(piece, value[rows])
        assert len(rows) == (ROWS if p.num_rows() is None else p.num_rows())
    np.testing.assert_array_equal(got, value)
