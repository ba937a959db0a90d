"""The language model of examples/lm.py, small and fed by placeholders, for search tests."""
import numpy as np

from examples import lm

VOCAB, CONTEXT, BATCH, STEPS = 40, 2, 6, 3


def build():
    """(graph, loss, train_op): embedding in tfpar.partitioner(1, 4), full softmax."""
    return lm.build_graph(vocab=VOCAB, context=CONTEXT, emb_dim=4, hidden=8, feed=True,
                          sampled=False, min_partitions=1, max_partitions=4)


def batches(steps, workers, seed=0):
    """Per step (previous [workers*BATCH, CONTEXT], target [workers*BATCH, 1]); ids repeat."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        previous = rng.randint(0, VOCAB, size=(workers * BATCH, CONTEXT)).astype(np.int64)
        previous[::4, 0] = 7
        target = rng.randint(0, VOCAB, size=(workers * BATCH, 1)).astype(np.int64)
        out.append((previous, target))
    return out
