"""What the job's measurement counts of each sharded table's ids (tfpar.runtime.measure):
the rows each owner would be asked a step under either row layout (`owner_counts`), from
which Config.sharded_rows "auto" chooses. The measurement in a job: tests/jobs/
test_density_routing.py."""
import numpy as np
import pytest

from examples.lm import zipf_text
from tfpar.runtime.measure import link_balance, owner_counts


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


def test_link_balance_is_the_busiest_hosts_load_over_its_share():
    # 4 owners on 2 hosts (0, 0, 1, 1); two steps
    asked = [[3, 3, 1, 1], [2, 2, 2, 2]]
    assert link_balance(asked, [0, 0, 1, 1], 2) == pytest.approx((6 / 4 + 1) / 2)
    # hosts of 2 and 1 workers: the lone worker's host's share is a third
    assert link_balance([[1, 1, 1]], [0, 0, 1], 2) == pytest.approx(1.0)
    assert link_balance([[0, 0, 3]], [0, 0, 1], 2) == pytest.approx(3.0)
    # the servers: one part, on the first of two hosts, serves everything (twice its half)
    assert link_balance([[5]], [0], 2, even=True) == pytest.approx(2.0)
    assert link_balance([[0, 0, 0, 0]], [0, 0, 1, 1], 2) == 1.0  # nothing asked


def test_ranges_of_a_vocabulary_sorted_by_frequency_load_one_host():
    """The LM's Zipf text on 2 hosts x 2 workers, 2,048 words a worker: in ranges (the
    sharded rows R4, or the servers' two parts) the first host serves about 1.4x its
    half of the rows asked; modulo (4 workers, or 2 parts), within a few percent of it."""
    vocab, n, words = 200_000, 4, 2048
    text = zipf_text(vocab, n_tokens=words * n * 2)
    asked = {"ranges": [], "modulo": [], "servers": [], "servers_modulo": []}
    for step in range(2):
        batches = [np.unique(text[(step * n + r) * words:(step * n + r + 1) * words])
                   for r in range(n)]
        for way in ("ranges", "modulo"):
            asked[way].append(sum(owner_counts(b, vocab, n, way) for b in batches))
        asked["servers"].append(sum(owner_counts(b, vocab, 2, "ranges") for b in batches))
        asked["servers_modulo"].append(sum(owner_counts(b, vocab, 2, "modulo")
                                           for b in batches))
    hosts = [0, 0, 1, 1]
    assert link_balance(asked["ranges"], hosts, 2) > 1.3
    assert link_balance(asked["servers"], [0, 1], 2, even=True) > 1.3
    assert link_balance(asked["modulo"], hosts, 2) < 1.05
    assert link_balance(asked["servers_modulo"], [0, 1], 2, even=True) < 1.05
