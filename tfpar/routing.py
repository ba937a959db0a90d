"""Routing by measurement: sparse variables to parameter servers or dense allreduce, and
whether each host aggregates its pushes.

Parallax sends every sparse variable to the parameter servers. That pays when a step
touches few of its rows (alpha << 1), but when most rows are touched (a small vocabulary,
a large batch) the parameter servers move as many bytes as an allreduce of the whole
variable, plus indices, and add their protocol (pull, push, the chief's update, the token)
to every step. So tfpar measures each sparse variable's alpha (the mean fraction of its
rows one worker's step touches) and the job's links (an alpha-beta fit of Horovod
allreduces), predicts each route's time per step with the cost model and picks per
variable; the parameter-server protocol's fixed cost is paid once if any variable uses it.

Pure: no TensorFlow here (measurement is in `tfpar.density`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from tfpar import cost

SPARSE_ROUTES = ("ps", "allreduce")
# Sequential exchanges the synchronous parameter-server protocol adds to a step that an
# allreduce-only step does not have: the pull before the forward pass, the push after the
# backward pass, and the chief's token that ends the step (the chief's update waits for
# the pushes it sums, so it is not overlapped either).
PS_ROUND_TRIPS = 3
INDEX_BYTES = 8  # an int64 row id, sent with every pulled and pushed row


@dataclasses.dataclass(frozen=True)
class Links:
    """The job's links as a Horovod allreduce sees them: t(bytes) = latency + bytes * per_byte.

    latency_s: time of a tiny allreduce (one round of the ring plus Horovod's negotiation),
    used as the cost of one sequential exchange. per_byte_s: seconds per byte one worker
    sends plus receives (the allreduce's bytes by `cost.allreduce_bytes`).
    """

    latency_s: float
    per_byte_s: float
    # The dense route per byte of its [rows, row + 1] tensor, local passes included (None:
    # per_byte_s times the allreduce's bytes).
    dense_per_byte_s: Optional[float] = None
    source: str = "measured"  # "measured" (in this job) | "given"

    def allreduce_s(self, c: "Candidate", n: int) -> float:
        """Predicted seconds of the dense route of `c` per step."""
        moved = allreduce_bytes(c, n) * self.per_byte_s
        if self.dense_per_byte_s is None or n < 2:
            return moved
        # Never less than its allreduce alone (a probe cannot make the bytes free).
        return max(moved, c.rows * (c.row_bytes + 4) * c.gradients * self.dense_per_byte_s)

    def ps_s(self, c: "Candidate", n: int) -> float:
        """Predicted seconds of the parameter servers' bytes of `c` per step."""
        return ps_bytes(c, n) * self.per_byte_s


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A sparse variable that could take either route.

    rows, row_bytes: its shape; alpha: the mean fraction of rows one worker's step touches
    (each of its gradients counted); gradients: how many gradients it has per step.
    """

    name: str
    rows: int
    row_bytes: int
    alpha: float
    gradients: int = 1


@dataclasses.dataclass(frozen=True)
class RouteChoice:
    """The route of one sparse variable and why."""

    route: str
    alpha: Optional[float]
    allreduce_s: Optional[float] = None  # predicted seconds per step on each route
    ps_s: Optional[float] = None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """Whether the workers of a host sum their pushes on the host's PS first, and why.

    saved_bytes: bytes per step that one host's link no longer carries (the host's
    workers' duplicate rows, and all but one copy of a dense gradient, bound for the other
    hosts' parameter servers); saving_s: their time on the link; cost_s: the extra
    sequential exchange (push to the host's PS, then the host's sum forwarded).
    """

    on: bool
    saved_bytes: float
    saving_s: float
    cost_s: float
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Routing:
    """What tfpar measured in the job and decided from it (kept in the Plan): density
    routing's choice per sparse variable and local aggregation's."""

    links: Optional[Links]
    choices: Dict[str, RouteChoice]
    steps: int = 0  # steps measured per worker
    aggregation: Optional[Aggregation] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def allreduce_bytes(c: Candidate, n: int) -> float:
    """Dense allreduce of the variable's summed gradient plus one count per row (the count
    says which rows any worker touched, so the update stays sparse and exact)."""
    return cost.allreduce_bytes(c.rows * (c.row_bytes + 4), n) * c.gradients


def ps_bytes(c: Candidate, n: int) -> float:
    """Parallax's parameter-server model for alpha * rows rows, each with its id."""
    return cost.ps_bytes(c.alpha * c.rows * (c.row_bytes + INDEX_BYTES), n) * c.gradients


def decide(candidates: Tuple[Candidate, ...], n: int, links: Links,
           forced: Optional[Dict[str, str]] = None) -> Dict[str, RouteChoice]:
    """The route of every candidate that minimises the predicted step time.

    Each variable goes where its predicted time is shorter (`Links.allreduce_s`, `ps_s`);
    then, if the variables on the parameter servers save less than the protocol's fixed cost (PS_ROUND_TRIPS exchanges), all of
    them go to allreduce and the job needs no parameter server. `forced` routes are kept.
    """
    forced = forced or {}
    fixed = PS_ROUND_TRIPS * links.latency_s
    volume = {c.name: (allreduce_bytes(c, n), ps_bytes(c, n)) for c in candidates}
    times = {c.name: (links.allreduce_s(c, n), links.ps_s(c, n)) for c in candidates}
    route = {c.name: forced.get(c.name) or ("ps" if times[c.name][1] < times[c.name][0]
                                            else "allreduce") for c in candidates}
    free = [c.name for c in candidates if c.name not in forced]
    saving = sum(times[name][0] - times[name][1] for name in free if route[name] == "ps")
    ps_forced = any(r == "ps" for r in forced.values())
    pooled = not ps_forced and any(route[name] == "ps" for name in free) and saving < fixed
    if pooled:
        for name in free:
            route[name] = "allreduce"
    out = {}
    for c in candidates:
        t_ar, t_ps = times[c.name]
        r = route[c.name]
        if c.name in forced:
            why = "set by tfpar.Config(sparse_route=...)"
        elif pooled:
            why = (f"the parameter servers would save {1e3 * saving:.3f} ms, less "
                   f"than their protocol's {PS_ROUND_TRIPS} exchanges ({1e3 * fixed:.3f} ms)")
        elif t_ar == t_ps:
            why = "the same time either way, and allreduce needs no parameter server"
        elif r == "ps":
            why = (f"{volume[c.name][1]:,.0f} bytes per worker on the parameter servers "
                   f"against a dense allreduce of {volume[c.name][0]:,.0f}")
        else:
            why = (f"most rows touched: a dense allreduce of {volume[c.name][0]:,.0f} bytes per "
                   f"worker takes less time than {volume[c.name][1]:,.0f} on the parameter "
                   "servers")
        out[c.name] = RouteChoice(r, c.alpha, t_ar, t_ps, why)
    return out


def decide_aggregation(saved_bytes: float, links: Links) -> Aggregation:
    """Local aggregation pays when the bytes it keeps off a host's link take longer there
    than the exchange it adds.

    A host link that carries B bytes one way takes about 2 B per_byte_s: `per_byte_s` is
    fitted to an allreduce's bytes sent plus received per worker, which a ring moves over
    full-duplex links in half their sum. The added exchange costs one `latency_s`.
    """
    saving = 2.0 * saved_bytes * links.per_byte_s
    cost_s = links.latency_s
    on = saving > cost_s
    reason = (f"saves {saved_bytes:,.0f} bytes per host link per step "
              f"({1e3 * saving:.3f} ms) {'>' if on else '<='} one more exchange "
              f"({1e3 * cost_s:.3f} ms)")
    return Aggregation(on, saved_bytes, saving, cost_s, reason)


def describe(name: str, choice: RouteChoice) -> str:
    """One line for the plan: the variable's density, both predictions, the route and why."""
    alpha = "?" if choice.alpha is None else f"{choice.alpha:.3f}"
    times = ""
    if choice.allreduce_s is not None and choice.ps_s is not None:
        times = (f" (predicted {1e3 * choice.allreduce_s:.3f} ms allreduce vs "
                 f"{1e3 * choice.ps_s:.3f} ms parameter servers)")
    return f"{name}: alpha {alpha} -> {choice.route}{times}: {choice.reason}"
