"""Routing by measurement: sparse variables to parameter servers, a dense allreduce, a
sparse allgather or rows sharded over the workers (all-to-all), and whether each host
aggregates its pushes and row gradients.

Parallax sends every sparse variable to the parameter servers. That pays when a step
touches few of its rows (alpha << 1) of many workers, but when most rows are touched (a
small vocabulary, a large batch) the parameter servers move as many bytes as an allreduce
of the whole variable, plus indices, and when the rows are few (a small batch, few
workers, fast links) their protocol (pull, push, the chief's update, the token) costs more
than the bytes it saves over Horovod's allgather of each worker's rows. So tfpar measures
each sparse variable's alpha (the mean fraction of its rows one worker's step touches),
the rows its gradients carry (duplicate ids included: what an allgather sends) and the
job's links (an alpha-beta fit of Horovod allreduces), predicts each route's time per step
with the cost model and picks per variable; the parameter-server protocol's fixed cost is
paid once if any variable uses it. Sharded rows move the parameter servers' bytes (each
worker's unique rows to and from their owners) with three all-to-alls (two with the ids
a step ahead) instead of the servers' protocol, so between those two the measured
latencies decide (a tiny all-to-all against a tiny allreduce).

Pure: no TensorFlow here (measurement is in `tfpar.runtime.measure`).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Optional, Tuple

from tfpar.plan import cost

# What density routing chooses between, and what Config.sparse_route may fix.
SPARSE_ROUTES = ("ps", "allreduce", "allgather", "sharded")
FIXED_SPARSE_ROUTES = SPARSE_ROUTES
# Sequential exchanges the synchronous parameter-server protocol adds to a step that an
# allreduce-only step does not have: the pull before the forward pass, the push after the
# backward pass, and the chief's token that ends the step (the chief's update waits for
# the pushes it sums, so it is not overlapped either).
PS_ROUND_TRIPS = 3
# Sequential all-to-alls of route "sharded": ids to their owners and rows back before the
# forward pass goes on, then the row gradients to their owners.
SHARDED_EXCHANGES = 3
# With the ids a step ahead (Config.ids_ahead: every sparse variable sharded, no local
# aggregation), the next batch's ids go to their owners with this batch's rows: two.
SHARDED_EXCHANGES_AHEAD = 2
# What local aggregation adds to them: ids to the host's collector and rows back from it,
# the row gradients to it.
SHARDED_HOST_EXCHANGES = 3
# What local aggregation adds to the servers' route for each part (row range) of a variable
# on them, beside its one more exchange, in exchanges (`Links.latency_s`): each host's sum
# of a part is taken and forwarded to the part's server by the host's PS, after the host's
# workers pushed, and the parts' forwards share that process's CPU. Measured on the
# recommender (2 emulated hosts x 2, 10 tables, 1 Gbit/s; docs/results/ps_parts/): local
# aggregation cost 13, 21 and 30 ms more per step with 10, 20 and 40 parts, its one
# exchange ~2 ms; the LM's 6 parts ~5 ms (docs/results/step_breakdown/).
AGGREGATED_PART_EXCHANGES = 1.0 / 3.0
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
    # Time of a tiny all-to-all, the cost of one of route "sharded"'s exchanges (None:
    # latency_s).
    alltoall_latency_s: Optional[float] = None
    # Seconds per byte a worker sends plus receives in an allgather (`allgather_bytes`;
    # None: per_byte_s): what the allreduced gradients cost in it (allreduce_by_allgather).
    allgather_per_byte_s: Optional[float] = None

    @property
    def gathered_byte_s(self) -> float:
        return self.per_byte_s if self.allgather_per_byte_s is None \
            else self.allgather_per_byte_s

    @property
    def alltoall_s(self) -> float:
        return self.latency_s if self.alltoall_latency_s is None else self.alltoall_latency_s

    def allreduce_s(self, c: "Candidate", n: int) -> float:
        """Predicted seconds of the dense route of `c` per step."""
        moved = allreduce_bytes(c, n) * self.per_byte_s
        if self.dense_per_byte_s is None or n < 2:
            return moved
        # Never less than its allreduce alone (a probe cannot make the bytes free).
        return max(moved, c.rows * (c.row_bytes + 4) * c.gradients * self.dense_per_byte_s)

    def ps_s(self, c: "Candidate", n: int, aggregation: bool = False) -> float:
        """Predicted seconds of the parameter servers' bytes of `c` per step (on the
        busiest host's link: `Candidate.servers_balance`), less what
        local aggregation keeps off the host links (never below half the bytes' time),
        plus, with local aggregation, the forwarding of its parts
        (`AGGREGATED_PART_EXCHANGES` each)."""
        moved = ps_bytes(c, n) * self.per_byte_s * c.servers_balance
        forwards = aggregation * c.parts * AGGREGATED_PART_EXCHANGES * self.latency_s
        return max(moved - c.aggregation_s, moved / 2) + forwards

    def allgather_s(self, c: "Candidate", n: int) -> float:
        """Predicted seconds of the allgather route of `c` per step."""
        return allgather_bytes(c, n) * self.per_byte_s

    def folded_s(self, c: "Candidate", n: int) -> float:
        """Predicted seconds of the dense route of `c` per step when its allreduce rides in
        the allgather (Config.allreduce_by_allgather): its summed rows and flags gathered
        from every worker, at the allgather's cost per byte."""
        return cost.allgather_bytes(dense_sum_bytes(c), n) * self.gathered_byte_s

    def sharded_s(self, c: "Candidate", n: int) -> float:
        """Predicted seconds of the sharded route's bytes of `c` per step (on the busiest
        host's link: `Candidate.sharded_balance`), less what
        local aggregation keeps off the host links: the shared rows' gradients, as on the
        servers' route, and their lookups (never below half the bytes' time)."""
        moved = sharded_bytes(c, n) * self.per_byte_s * c.sharded_balance
        return max(moved - 2 * c.aggregation_s, moved / 2)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A sparse variable that could take any of the routes.

    rows, row_bytes: its shape; alpha: the mean fraction of rows one worker's step touches
    (each of its gradients counted); gradients: how many gradients it has per step;
    sent_rows: the rows one worker's gradients carry per step, duplicate ids included, all
    gradients together, where the allgather cannot sum them by id first (None: alpha *
    rows per gradient, what it sends when it can); dense_route: False
    when the dense allreduce cannot be exact for it (a sum over its gradient's rows);
    sharded_route: False when route "sharded" cannot take it (fewer rows than workers, a
    dense update, a read of the whole variable); ps_route: False when the parameter
    servers cannot (a dense update).
    """

    name: str
    rows: int
    row_bytes: int
    alpha: float
    gradients: int = 1
    sent_rows: Optional[float] = None
    dense_route: bool = True
    sharded_route: bool = True
    ps_route: bool = True
    # What local aggregation spares it on the servers' and the sharded routes: seconds per step
    # its host-shared rows (the rows the workers of a host touch in common) would take on
    # a host link (`aggregation_saving_s`; 0: no aggregation).
    aggregation_s: float = 0.0
    parts: int = 1  # its parts (row ranges) on the servers' route
    # How much more than its share of the rows asked the busiest host serves, on the
    # servers' route (its parts are row ranges) and on the sharded route (its rows dealt
    # out as the plan deals them): measured, 1 where even. A vocabulary sorted by
    # frequency puts its hot rows in the first range, so that one host's link carries
    # them for every worker elsewhere (`measure.link_balance`).
    servers_balance: float = 1.0
    sharded_balance: float = 1.0


@dataclasses.dataclass(frozen=True)
class RouteChoice:
    """The route of one sparse variable and why."""

    route: str
    alpha: Optional[float]
    allreduce_s: Optional[float] = None  # predicted seconds per step on each route
    ps_s: Optional[float] = None
    reason: str = ""
    allgather_s: Optional[float] = None
    sharded_s: Optional[float] = None
    # Its dense route's seconds when the step's allreduce rides in the allgather (priced
    # where Config.allreduce_by_allgather may fold it; None: not priced).
    folded_s: Optional[float] = None
    # The busiest host's load over its share on the servers' and the sharded routes, as
    # priced (`Candidate.servers_balance`, `sharded_balance`; 1: even, or one host).
    servers_balance: Optional[float] = None
    sharded_balance: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Fold:
    """Config.allreduce_by_allgather as density routing prices it. dense_s: what the dense
    gradients' bytes add to a step in the allgather less their own allreduce, its round
    included (`fold_seconds(..., forced=True)`); forced: True folds whatever it costs,
    False ("auto") only where the step is faster for it. The sparse variables on the dense
    route ride along, each priced by `Links.folded_s`."""

    dense_s: float
    forced: bool = False
    # The same in the sharded rows' gradient all-to-all, where every sparse variable is
    # sharded and no host aggregates (`fold_seconds(..., via="alltoall")`; None: not
    # possible, a global norm over the rows reads the dense gradients summed).
    alltoall_s: Optional[float] = None

    def into_alltoall_s(self, kinds, aggregation: bool) -> float:
        """What the fold into the sharded rows' all-to-all adds to a step whose sparse
        variables take the route kinds `kinds` (0: it does not fold there)."""
        if (self.alltoall_s is None or aggregation or set(kinds) != {"sharded"}
                or not (self.forced or self.alltoall_s < 0)):
            return 0.0
        return self.alltoall_s


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
class RouteTrial:
    """One set of routes timed in the job (`Config(search_routes=True)`).

    routes: {sparse variable: route} of the variables density routing decides;
    aggregation: local aggregation on or off (None: as the config and the model decide);
    predicted_s: the cost model's step time for them; measured_s: the trial's median step
    time, averaged over the workers (None: not run, or it failed).
    """

    label: str
    routes: Dict[str, str]
    aggregation: Optional[bool]
    predicted_s: float
    measured_s: Optional[float] = None

    def describe(self) -> str:
        took = "failed" if self.measured_s is None else f"{1e3 * self.measured_s:.2f} ms/step"
        return f"{self.label}: predicted {1e3 * self.predicted_s:.2f} ms, measured {took}"


@dataclasses.dataclass(frozen=True)
class Routing:
    """What tfpar measured in the job and decided from it (kept in the Plan): density
    routing's choice per sparse variable and local aggregation's, and the route trials
    that overruled the model (`Config(search_routes=True)`)."""

    links: Optional[Links]
    choices: Dict[str, RouteChoice]
    steps: int = 0  # steps measured per worker
    aggregation: Optional[Aggregation] = None
    trials: Tuple[RouteTrial, ...] = ()
    trials_remembered: bool = False  # an earlier job's trials (search_cache), not timed now

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Routing":
        return cls(Links(**d["links"]) if d.get("links") else None,
                   {k: RouteChoice(**c) for k, c in d["choices"].items()}, d.get("steps", 0),
                   Aggregation(**d["aggregation"]) if d.get("aggregation") else None,
                   tuple(RouteTrial(**t) for t in d.get("trials", ())),
                   d.get("trials_remembered", False))


def fastest_trial(trials: Tuple[RouteTrial, ...]) -> Optional[RouteTrial]:
    """The trial with the least measured step time (ties: the earlier, i.e. the model's
    choice first); None when none ran."""
    ran = [t for t in trials if t.measured_s is not None]
    return min(ran, key=lambda t: t.measured_s) if ran else None


def uniform_routes(choices: Dict[str, RouteChoice], route: str,
                   allowed: Dict[str, Tuple[str, ...]]) -> Dict[str, str]:
    """Every variable on `route` where it may take it, the others on their chosen route."""
    return {name: route if route in allowed[name] else c.route for name, c in choices.items()}


def dense_sum_bytes(c: Candidate) -> float:
    """What a worker puts into the dense route of `c` a step: each gradient's rows summed
    into the whole table, with one count per row (the count says which rows any worker
    touched, so the update stays sparse and exact)."""
    return float(c.rows * (c.row_bytes + 4) * c.gradients)


def allreduce_bytes(c: Candidate, n: int) -> float:
    """Dense allreduce of the variable's summed gradient plus its counts."""
    return cost.allreduce_bytes(dense_sum_bytes(c), n)


def ps_bytes(c: Candidate, n: int) -> float:
    """Parallax's parameter-server model for alpha * rows rows, each with its id."""
    return cost.ps_bytes(c.alpha * c.rows * (c.row_bytes + INDEX_BYTES), n) * c.gradients


def allgather_bytes(c: Candidate, n: int) -> float:
    """Horovod's allgather of every worker's rows (values and int64 ids): its unique rows
    where they are summed by id first, else as its gradients carry them (`sent_rows`)."""
    sent = c.alpha * c.rows * c.gradients if c.sent_rows is None else c.sent_rows
    return cost.allgather_bytes(sent * (c.row_bytes + INDEX_BYTES), n)


def sharded_bytes(c: Candidate, n: int) -> float:
    """Each worker's unique rows: ids out and rows back (lookups), row gradients with their
    ids out (the backward), as all-to-alls: the parameter servers' bytes, no server."""
    rows = c.alpha * c.rows * c.gradients
    return cost.sharded_bytes(rows * c.row_bytes, rows * INDEX_BYTES, n)


def allowed_routes(c: Candidate, n: int) -> Tuple[str, ...]:
    """The routes `c` can take exactly on n workers, in the order ties go."""
    return tuple(r for r in _ORDER if (r != "allreduce" or c.dense_route)
                 and (r != "ps" or c.ps_route)
                 and (r != "sharded" or (c.sharded_route and c.rows >= n)))


def decide(candidates: Tuple[Candidate, ...], n: int, links: Links,
           forced: Optional[Dict[str, str]] = None,
           aggregation: bool = False, fold: Optional[Fold] = None,
           ahead: bool = False) -> Dict[str, RouteChoice]:
    """The routes of the candidates that minimise the predicted step time.

    A step pays each variable's time on its route (`Links.allreduce_s`, `ps_s`,
    `allgather_s`, `sharded_s`) plus, once, the fixed cost of every kind of route some
    variable takes (`fixed_costs`: the parameter servers' protocol, the all-to-alls of
    sharded rows, the allgather's own collective; the allreduce route joins the dense
    gradients' fused allreduce). Every choice of which kinds to pay for is tried, each
    variable taking its fastest route among them; the cheapest step wins, fewer kinds on
    a tie, then the order of `SPARSE_ROUTES`. `forced` routes are kept (their kinds are
    paid for). aggregation: the hosts aggregate their pushes and row gradients (the
    servers' and the sharded routes gain each candidate's `aggregation_s` and pay one more
    exchange, the servers' also the forwarding of each candidate's parts). fold: where
    the allgather is taken, the step's allreduce may ride in it (`Fold`): then the dense
    gradients cost `fold.dense_s` more and each variable on the dense route its
    `Links.folded_s` instead of its allreduce, and each choice of kinds is priced with
    and without it ("auto") or with it (forced). ahead: the ids go a step ahead
    (Config.ids_ahead) where every variable is sharded and the hosts do not aggregate
    (`fixed_costs`).
    """
    forced = forced or {}
    volume = {c.name: {"allreduce": allreduce_bytes(c, n), "ps": ps_bytes(c, n),
                       "allgather": allgather_bytes(c, n), "sharded": sharded_bytes(c, n)}
              for c in candidates}
    times = {c.name: {"allreduce": links.allreduce_s(c, n),
                      "ps": links.ps_s(c, n, aggregation),
                      "allgather": links.allgather_s(c, n), "sharded": links.sharded_s(c, n)}
             for c in candidates}
    folded_times = {c.name: links.folded_s(c, n) for c in candidates} if fold else {}
    allowed = {c.name: allowed_routes(c, n) for c in candidates}
    fixed = fixed_costs(links, aggregation)

    def fixed_of(used):
        return fixed_costs(links, aggregation, ahead and used == {"sharded"})

    paid = set(forced.values())
    free = [c.name for c in candidates if c.name not in forced]

    def time_of(name, route, folded):
        return folded_times[name] if folded and route == "allreduce" else times[name][route]

    def routes_with(kinds, folded=False):
        """Each free variable's fastest route among the kinds paid for (None: impossible),
        the step's time and the sum of the variables' times alone."""
        route = dict(forced)
        for name in free:
            options = [r for r in allowed[name] if r == "allreduce" or r in kinds]
            if not options:
                return None, float("inf"), float("inf")
            route[name] = min(options, key=lambda r: time_of(name, r, folded))  # ties: first
        used = {r for r in route.values()}
        if folded and "allgather" not in used:
            return routes_with(kinds, False)  # nothing to ride in: no fold
        bytes_s = sum(time_of(name, r, folded) for name, r in route.items() if name in times)
        total = bytes_s + sum(fixed_of(used).get(r, 0.0) for r in used) \
            + (fold.dense_s if folded else 0) \
            + (fold.into_alltoall_s(used, aggregation) if fold is not None else 0)
        return route, total, bytes_s

    choices = []
    kinds = [k for k in _ORDER if k in fixed]
    variants = (False,) if fold is None else (True, False) if not fold.forced else (True,)
    for extra in sorted((subset for size in range(len(kinds) + 1)
                         for subset in itertools.combinations(kinds, size)), key=len):
        for folded in variants if "allgather" in paid | set(extra) else (False,):
            route, total, bytes_s = routes_with(paid | set(extra), folded)
            if route is not None:
                choices.append((total, len(set(route.values())), route, bytes_s, folded))
    _, _, route, bytes_s, folded = min(choices, key=lambda c: (c[0], c[1]))
    used = set(route.values())
    fixed = fixed_of(used)
    out = {}
    for c in candidates:
        b, r = volume[c.name], route[c.name]
        t = {k: time_of(c.name, k, folded) for k in times[c.name]}
        # The fastest without fixed costs (equal bytes: the cheaper protocol).
        alone = min(allowed[c.name], key=lambda k: (t[k], fixed.get(k, 0.0)))
        if c.name in forced:
            why = "set by tfpar.Config(sparse_route=...)"
        elif alone != r:
            _, _, with_it = routes_with(used | {alone}, folded)
            why = (f"{_KIND[alone]} would save {1e3 * (bytes_s - with_it):.3f} ms, less "
                   f"than {_FIXED_WHY[alone]} ({1e3 * fixed[alone]:.3f} ms)")
        elif r in ("ps", "sharded"):
            twin = "sharded" if r == "ps" else "ps"
            other = min((k for k in allowed[c.name] if k not in ("ps", "sharded")),
                        key=lambda k: t[k])
            why = (f"{b[r]:,.0f} bytes per worker " + ("on the parameter servers" if r == "ps"
                                                       else "by all-to-all to the rows' owners")
                   + " against " + ("a dense allreduce" if other == "allreduce"
                                    else "an allgather") + f" of {b[other]:,.0f}")
            if twin in allowed[c.name]:
                why += (f"; {_FIXED_WHY[r]} ({1e3 * fixed[r]:.3f} ms) "
                        + ("<=" if fixed[r] <= fixed[twin] else ">")
                        + f" {_FIXED_WHY[twin]} ({1e3 * fixed[twin]:.3f} ms)")
            if (c.servers_balance, c.sharded_balance) != (1.0, 1.0):
                why += (f"; the busiest host serves {c.servers_balance:.2f}x its share of "
                        f"the rows on the servers, {c.sharded_balance:.2f}x sharded")
        elif r == "allreduce" and folded:
            why = (f"most rows touched: its summed rows ({dense_sum_bytes(c):,.0f} bytes) "
                   "in the allgather with the dense gradients take less time than "
                   f"{b['ps']:,.0f} bytes per worker on the parameter servers or an "
                   f"allgather of its rows ({b['allgather']:,.0f})")
        elif r == "allreduce":
            why = (f"most rows touched: a dense allreduce of {b['allreduce']:,.0f} bytes per "
                   f"worker takes less time than {b['ps']:,.0f} on the parameter "
                   f"servers or an allgather of {b['allgather']:,.0f}")
        else:
            why = (f"an allgather of {b['allgather']:,.0f} bytes per worker takes less time "
                   f"than {b['ps']:,.0f} on the parameter servers or by all-to-all"
                   + (f" or a dense allreduce of {b['allreduce']:,.0f}" if c.dense_route
                      else " (a dense allreduce would not be exact)"))
        out[c.name] = RouteChoice(r, c.alpha, times[c.name]["allreduce"], t["ps"], why,
                                  t["allgather"],
                                  t["sharded"] if "sharded" in allowed[c.name] else None,
                                  folded_times.get(c.name), c.servers_balance,
                                  c.sharded_balance)
    return out


def fold_delta_s(choices: Dict[str, RouteChoice], fold: Fold) -> float:
    """What folding the step's allreduce into the allgather adds to the step of `choices`
    (below zero: saves): the dense gradients' `fold.dense_s` and, for each variable on
    the dense route, its time in the allgather less its allreduce's."""
    return fold.dense_s + sum(c.folded_s - c.allreduce_s for c in choices.values()
                              if c.route == "allreduce" and c.folded_s is not None
                              and c.allreduce_s is not None)


def folds(choices: Dict[str, RouteChoice], fold: Optional[Fold],
          forced: Tuple[str, ...] = ()) -> bool:
    """Whether the step of `choices` folds its allreduce into the allgather: some variable
    takes the allgather (`forced`: the routes of variables not measured) and the fold is
    forced or saves time (`fold_delta_s`)."""
    if fold is None or "allgather" not in {c.route for c in choices.values()} | set(forced):
        return False
    return fold.forced or fold_delta_s(choices, fold) < 0


def predicted_step_s(choices: Dict[str, RouteChoice], links: Links,
                     aggregation: bool = False, forced: Tuple[str, ...] = (),
                     fold: Optional[Fold] = None, ahead: bool = False) -> float:
    """The step time `decide` predicted for its choices: each measured variable's time on
    its route plus the fixed cost of every kind of route taken (`forced`: the routes of
    variables not measured, whose kinds are paid for too; `ahead` as `decide`'s), and the
    fold's where it folds (`folds`)."""
    moved = sum(getattr(c, f"{c.route}_s") or 0.0 for c in choices.values())
    kinds = {c.route for c in choices.values()} | set(forced)
    fixed = fixed_costs(links, aggregation, ahead and kinds == {"sharded"})
    folding = fold_delta_s(choices, fold) if folds(choices, fold, forced) else 0.0
    if fold is not None:
        folding += fold.into_alltoall_s(kinds, aggregation)
    return moved + sum(fixed.get(r, 0.0) for r in kinds) + folding


def fixed_costs(links: Links, aggregation: bool = False,
                ahead: bool = False) -> Dict[str, float]:
    """Seconds a kind of route adds to a step once any variable takes it (sequential
    exchanges; local aggregation one more on the servers' route, three more all-to-alls
    within the host on the sharded rows'; `ahead`, the ids a step ahead, one fewer on the
    sharded rows' unless the hosts aggregate, which turns it off); the allreduce route
    joins the dense gradients' allreduce."""
    sharded = SHARDED_EXCHANGES_AHEAD if ahead and not aggregation else \
        SHARDED_EXCHANGES + SHARDED_HOST_EXCHANGES * aggregation
    return {"ps": (PS_ROUND_TRIPS + aggregation) * links.latency_s,
            "allgather": links.latency_s,
            "sharded": sharded * links.alltoall_s}


def fold_seconds(dense_bytes: float, n: int, links: Links, forced: bool = False,
                 via: str = "allgather") -> float:
    """What the allgather's kind adds to a step when the step's allreduce of `dense_bytes`
    rides in it (Config.allreduce_by_allgather): their bytes at the allgather's cost, less
    their own allreduce (a round and its bytes). "auto" folds only where that is below
    zero (else 0: no fold); `forced` (True) folds whatever it costs. via "alltoall": in
    the sharded rows' gradient all-to-all instead, each worker's gradient sent whole to
    every other (the allgather's bytes) at the links' own cost per byte."""
    if n < 2 or dense_bytes <= 0:
        return 0.0
    per_byte = links.gathered_byte_s if via == "allgather" else links.per_byte_s
    delta = cost.allgather_bytes(dense_bytes, n) * per_byte - (
        links.latency_s + cost.allreduce_bytes(dense_bytes, n) * links.per_byte_s)
    return delta if forced else min(delta, 0.0)


def aggregation_saving_s(shared_rows: float, row_bytes: int, hosts: int,
                         links: Links) -> float:
    """Seconds per step local aggregation spares one host link for a variable whose hosts'
    workers touch `shared_rows` rows in common per step (summed over hosts): each such row
    crosses to the other hosts' servers ((H-1)/H of the parts) once instead of twice, one
    host's share of them (1/H), on a link carrying B bytes one way in 2 B per_byte_s
    (`decide_aggregation`)."""
    if hosts < 2:
        return 0.0
    spared = shared_rows * (row_bytes + INDEX_BYTES) * (hosts - 1) / hosts / hosts
    return 2.0 * spared * links.per_byte_s


_ORDER = ("allreduce", "allgather", "ps", "sharded")  # ties go to the first
_KIND = {"ps": "the parameter servers", "allgather": "an allgather",
         "allreduce": "a dense allreduce", "sharded": "sharded rows (all-to-all)"}
_FIXED_WHY = {"ps": "their protocol's exchanges",
              "allgather": "the collective it adds",
              "sharded": "its all-to-alls"}


def decide_aggregation(saved_bytes: float, links: Links, servers: bool = True,
                       sharded: bool = False, parts: int = 0,
                       ahead: bool = False) -> Aggregation:
    """Local aggregation pays when the bytes it keeps off a host's link take longer there
    than the exchanges it adds.

    A host link that carries B bytes one way takes about 2 B per_byte_s: `per_byte_s` is
    fitted to an allreduce's bytes sent plus received per worker, which a ring moves over
    full-duplex links in half their sum. The added exchange costs one `latency_s` on the
    servers' route (push to the host's PS, then the host's sum forwarded), plus
    `AGGREGATED_PART_EXCHANGES` for each of the `parts` the servers hold, and three
    all-to-alls on route "sharded" (ids, rows and row gradients through a worker of the
    host), one more where it turns the ids a step ahead off (`ahead`).
    """
    saving = 2.0 * saved_bytes * links.per_byte_s
    forwards = servers * parts * AGGREGATED_PART_EXCHANGES
    more = SHARDED_HOST_EXCHANGES + (SHARDED_EXCHANGES - SHARDED_EXCHANGES_AHEAD) * ahead
    cost_s = (servers + forwards) * links.latency_s + sharded * more * links.alltoall_s
    on = saving > cost_s
    what = " and ".join(w for w, used in (
        ("one more exchange" + (f" and the forwarding of {parts} parts" if forwards else ""),
         servers),
        (f"{more} more all-to-alls" + (" (the ids a step ahead off)" if ahead else ""),
         sharded)) if used)
    reason = (f"saves {saved_bytes:,.0f} bytes per host link per step "
              f"({1e3 * saving:.3f} ms) {'>' if on else '<='} {what} "
              f"({1e3 * cost_s:.3f} ms)")
    return Aggregation(on, saved_bytes, saving, cost_s, reason)


def describe(name: str, choice: RouteChoice) -> str:
    """One line for the plan: the variable's density, both predictions, the route and why."""
    alpha = "?" if choice.alpha is None else f"{choice.alpha:.3f}"
    times = ""
    if choice.allreduce_s is not None and choice.ps_s is not None:
        times = (f" (predicted {1e3 * choice.allreduce_s:.3f} ms allreduce vs "
                 f"{1e3 * choice.ps_s:.3f} ms parameter servers"
                 + ("" if choice.allgather_s is None else
                    f" vs {1e3 * choice.allgather_s:.3f} ms allgather")
                 + ("" if choice.sharded_s is None else
                    f" vs {1e3 * choice.sharded_s:.3f} ms sharded")
                 + ("" if choice.folded_s is None else
                    f"; {1e3 * choice.folded_s:.3f} ms allreduce in the allgather")
                 + ("" if (choice.servers_balance or 1.0, choice.sharded_balance or 1.0) ==
                    (1.0, 1.0) else f"; the busiest host {choice.servers_balance:.2f}x its "
                    f"share on the servers, {choice.sharded_balance:.2f}x sharded") + ")")
    return f"{name}: alpha {alpha} -> {choice.route}{times}: {choice.reason}"
