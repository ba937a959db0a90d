"""The partition-count search against synthetic cost curves (no TensorFlow, no cluster).

For each curve the search runs to the end as it would in a job, with the curve giving the
step time of each trial. The chosen P must cost at most 5% more than the best P in the
bounds, stay inside the bounds, and take at most the trial cap.
"""
import numpy as np
import pytest

import tfpar
from tfpar.partition.counts.search import PartitionSearch, SearchResult


def run(curve, start=2, lower=1, upper=1024, max_trials=5):
    search = PartitionSearch(start, lower, upper, max_trials)
    while (p := search.propose()) is not None:
        search.record(p, curve(p))
    return search.result()


def best_cost(curve, lower, upper):
    return min(curve(p) for p in range(lower, upper + 1) if curve(p) is not None)


rng = np.random.RandomState(0)
NOISE = {p: 1 + rng.uniform(-0.02, 0.02) for p in range(1, 2049)}
CURVES = {
    # Parallax's model with the optimum inside the doubling range (P* = sqrt(800) ~ 28).
    "convex": (lambda p: 1.0 + 8.0 / p + 0.01 * p, 2, 1, 1024),
    "convex_optimum_below_start": (lambda p: 1.0 + 0.5 / p + 0.2 * p, 8, 1, 1024),
    "convex_noisy": (lambda p: (1.0 + 8.0 / p + 0.01 * p) * NOISE[p], 2, 1, 1024),
    "flat": (lambda p: 1.0, 2, 1, 1024),
    "flat_noisy": (lambda p: NOISE[p], 2, 1, 1024),
    "decreasing_to_the_bound": (lambda p: 1.0 + 5.0 / p, 2, 1, 24),
    "increasing": (lambda p: 1.0 + 0.05 * p, 4, 1, 1024),
    "parallax_lm_table2": (lambda p: 7.38e-3 + 9.54e-2 / p + 1.27e-5 * p, 8, 1, 800),
}


@pytest.mark.parametrize("name", sorted(CURVES))
def test_chosen_p_is_within_5_percent_of_the_optimum(name):
    curve, start, lower, upper = CURVES[name]
    result = run(curve, start, lower, upper)
    assert lower <= result.partitions <= upper
    assert len(result.samples) <= 5
    assert curve(result.partitions) <= 1.05 * best_cost(curve, lower, upper), result.describe()


def test_sampling_doubles_then_halves_from_the_smallest():
    result = run(lambda p: 1.0 + 8.0 / p + 0.3 * p, start=4, max_trials=10)  # optimum ~ 5
    assert [s.partitions for s in result.samples] == [4, 8, 2]
    assert result.fit is not None and result.partitions in (4, 5, 6)
    # The fit recovers the curve it sampled.
    assert result.predicted(5) == pytest.approx(1.0 + 8.0 / 5 + 1.5, rel=1e-6)


def test_bounds_and_trial_cap_are_respected():
    for upper in (1, 3, 7, 100):
        for lower in range(1, upper + 1, 2):
            for cap in (1, 2, 5):
                result = run(lambda p: 1.0 + 3.0 / p + 0.1 * p, 4, lower, upper, cap)
                assert lower <= result.partitions <= upper
                assert len(result.samples) <= cap
                assert all(lower <= s.partitions <= upper for s in result.samples)


def test_a_failure_at_a_small_p_raises_the_minimum():
    curve = lambda p: None if p < 8 else 1.0 + 64.0 / p + 0.01 * p  # "out of memory" below 8
    result = run(curve, start=2, max_trials=6)
    assert result.samples[0].step_time is None and result.lower >= 8
    assert result.partitions >= 8
    assert curve(result.partitions) <= 1.05 * best_cost(curve, 8, 1024)


def test_every_trial_failing_is_an_error():
    with pytest.raises(tfpar.TfparError, match="every partition-search trial failed"):
        run(lambda p: None)


def test_bad_bounds():
    with pytest.raises(tfpar.TfparError, match="min <= max"):
        PartitionSearch(2, lower=8, upper=4)
    with pytest.raises(tfpar.TfparError, match="at least one trial"):
        PartitionSearch(2, max_trials=0)


def test_result_round_trips():
    result = run(CURVES["convex"][0])
    assert SearchResult.from_dict(result.to_dict()) == result
    assert "chose P=" in result.describe()
