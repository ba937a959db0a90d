"""Choosing a partition count from a few timed trials (Parallax, section 3.2).

Sampling: start at P0 (the number of parameter servers); double P while the step time
falls; then halve from the smallest P tried while it falls. The optimum is then bracketed
by the sampled P's, and the cost model

    t(P) = theta0 + theta1 / P + theta2 * P

(fixed cost; work that partitioning spreads; per-part overhead) fitted to the samples by
least squares picks the integer P with the least predicted time inside the sampled range,
so the fit never extrapolates. A failed trial (e.g. out of memory at a small P) raises
the lower bound. The trial count is capped.

This module is pure: no TensorFlow, so it is tested against synthetic cost curves.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import numpy as np

from tfpar.errors import TfparError


@dataclasses.dataclass(frozen=True)
class Sample:
    """One trial: a partition count and its step time in seconds (each worker's median, averaged; None: it failed)."""

    partitions: int
    step_time: Optional[float]


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What a search chose and why."""

    partitions: int
    samples: Tuple[Sample, ...]
    fit: Optional[Tuple[float, float, float]]  # (theta0, theta1, theta2), None: too few samples
    lower: int
    upper: int

    def predicted(self, p: int) -> Optional[float]:
        if self.fit is None:
            return None
        t0, t1, t2 = self.fit
        return t0 + t1 / p + t2 * p

    def to_dict(self) -> dict:
        return {"partitions": self.partitions, "lower": self.lower, "upper": self.upper,
                "samples": [[s.partitions, s.step_time] for s in self.samples],
                "fit": list(self.fit) if self.fit else None}

    @classmethod
    def from_dict(cls, d: dict) -> "SearchResult":
        return cls(d["partitions"], tuple(Sample(p, t) for p, t in d["samples"]),
                   tuple(d["fit"]) if d.get("fit") else None, d["lower"], d["upper"])

    def describe(self) -> str:
        tried = ", ".join(f"P={s.partitions}: " + ("failed" if s.step_time is None else
                                                   f"{s.step_time * 1e3:.2f} ms")
                          for s in self.samples)
        fit = ("" if self.fit is None else
               " fit t(P) = {:.3g} + {:.3g}/P + {:.3g}*P s;".format(*self.fit))
        return f"chose P={self.partitions} in [{self.lower}, {self.upper}];{fit} trials: {tried}"


class PartitionSearch:
    """The sampling state machine: `propose()` the next P, `record()` its time, repeat until
    `propose()` returns None; then `result()`."""

    def __init__(self, start: int, lower: int = 1, upper: Optional[int] = None,
                 max_trials: int = 5):
        upper = upper if upper is not None else max(start, lower)
        if lower < 1 or upper < lower:
            raise TfparError(f"partition bounds must satisfy 1 <= min <= max, got min={lower}, "
                             f"max={upper}")
        if max_trials < 1:
            raise TfparError(f"the partition search needs at least one trial, got {max_trials}")
        self.lower, self.upper, self.max_trials = lower, upper, max_trials
        self.samples: List[Sample] = []
        self._phase = "up"
        self._next: Optional[int] = min(max(start, lower), upper)

    def propose(self) -> Optional[int]:
        if len(self.samples) >= self.max_trials:
            return None
        return self._next

    def record(self, partitions: int, step_time: Optional[float]) -> None:
        self.samples.append(Sample(partitions, step_time))
        if step_time is None:
            # Too small a P failed (Parallax: out of memory): never go below twice it.
            self.lower = min(max(self.lower, partitions * 2), self.upper)
            self._next = self._up_from(partitions) if self._phase == "up" else None
            if self._next is None and self._phase == "up":
                self._start_down()
            return
        if self._phase == "up":
            previous = self._time_at(self._prev_up(partitions))
            if (previous is not None and step_time >= previous) or partitions >= self.upper:
                self._start_down()
            else:
                self._next = self._up_from(partitions)
                if self._next is None:
                    self._start_down()
        else:
            above = self._time_at(self._above(partitions))
            if above is not None and step_time >= above:
                self._next = None
            else:
                self._next = self._down_from(partitions)

    def result(self) -> SearchResult:
        ok = [s for s in self.samples if s.step_time is not None]
        if not ok:
            raise TfparError("every partition-search trial failed; set the count yourself "
                             "with tfpar.Config(partitions=...)")
        best = min(ok, key=lambda s: (s.step_time, s.partitions))
        fit = _fit(ok) if len({s.partitions for s in ok}) >= 3 else None
        chosen = best.partitions
        if fit is not None:
            lo = max(min(s.partitions for s in ok), self.lower)
            hi = min(max(s.partitions for s in ok), self.upper)
            ps = np.arange(lo, hi + 1, dtype=np.float64)
            t0, t1, t2 = fit
            chosen = int(ps[np.argmin(t0 + t1 / ps + t2 * ps)])
        return SearchResult(chosen, tuple(self.samples), fit, self.lower, self.upper)

    # -- helpers ------------------------------------------------------------------------------
    def _tried(self, p: int) -> bool:
        return any(s.partitions == p for s in self.samples)

    def _time_at(self, p: Optional[int]) -> Optional[float]:
        for s in self.samples:
            if p is not None and s.partitions == p and s.step_time is not None:
                return s.step_time
        return None

    def _prev_up(self, p: int) -> Optional[int]:
        """The successful sample just below p in the doubling phase."""
        below = [s.partitions for s in self.samples if s.partitions < p and s.step_time]
        return max(below) if below else None

    def _above(self, p: int) -> Optional[int]:
        above = [s.partitions for s in self.samples if s.partitions > p and s.step_time]
        return min(above) if above else None

    def _up_from(self, p: int) -> Optional[int]:
        nxt = min(p * 2, self.upper)
        return nxt if nxt > p and not self._tried(nxt) else None

    def _down_from(self, p: int) -> Optional[int]:
        nxt = max(p // 2, self.lower)
        return nxt if nxt < p and not self._tried(nxt) else None

    def _start_down(self):
        self._phase = "down"
        ok = [s.partitions for s in self.samples if s.step_time is not None]
        self._next = self._down_from(min(ok)) if ok else None


def _fit(samples) -> Tuple[float, float, float]:
    p = np.array([s.partitions for s in samples], np.float64)
    t = np.array([s.step_time for s in samples], np.float64)
    a = np.stack([np.ones_like(p), 1.0 / p, p], axis=1)
    theta, *_ = np.linalg.lstsq(a, t, rcond=None)
    return tuple(float(x) for x in theta)


@dataclasses.dataclass(frozen=True)
class GroupDecision:
    """How one `tfpar.partitioner` group's count was decided: "searched", "remembered" or
    "config"."""

    variables: Tuple[str, ...]
    partitions: int
    source: str
    search: Optional[SearchResult] = None

    def to_dict(self) -> dict:
        return {"variables": list(self.variables), "partitions": self.partitions,
                "source": self.source, "search": self.search.to_dict() if self.search else None}

    @classmethod
    def from_dict(cls, d: dict) -> "GroupDecision":
        return cls(tuple(d["variables"]), d["partitions"], d["source"],
                   SearchResult.from_dict(d["search"]) if d.get("search") else None)
