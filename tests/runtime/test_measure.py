"""What the job's measurement counts of each sharded table's ids (tfpar.runtime.measure):
the rows each owner would be asked a step under either row layout (`owner_counts`), from
which Config.sharded_rows "auto" chooses. The measurement in a job: tests/jobs/
test_density_routing.py."""
import numpy as np

from examples.lm import zipf_text
from tfpar.runtime.measure import owner_counts


def test_owner_counts_follow_the_tilings():
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # 10 rows over 3: ranges 0-3, 4-6, 7-9
    assert owner_counts(ids, 10, 3, "ranges").tolist() == [4, 3, 3]
    assert owner_counts(ids, 10, 3, "modulo").tolist() == [4, 3, 3]
    assert owner_counts([0, 3, 6, 9], 10, 3, "modulo").tolist() == [4, 0, 0]
    assert owner_counts([0, 3, 6, 9], 10, 3, "ranges").tolist() == [2, 1, 1]
    assert owner_counts([], 10, 3, "ranges").tolist() == [0, 0, 0]


def test_a_vocabulary_sorted_by_frequency_loads_the_first_range():
    """The LM example's Zipf text (a word's id is its frequency rank), a batch of 512
    words on 4 workers: ranges ask half the batch's distinct words of worker 0 (the other
    half are the text's words that follow others, spread over the vocabulary); modulo
    asks each worker about a quarter."""
    vocab, n = 100_000, 4
    words = np.unique(zipf_text(vocab, n_tokens=512))
    ranges = owner_counts(words, vocab, n, "ranges")
    modulo = owner_counts(words, vocab, n, "modulo")
    assert ranges.sum() == modulo.sum() == len(words)
    assert ranges[0] > 0.45 * len(words), ranges
    assert modulo.max() < 0.3 * len(words), modulo
    assert ranges.max() > 1.6 * modulo.max()
