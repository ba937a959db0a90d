"""`tfpar.partitioner()`: marks variables whose partition count tfpar searches for.

The graph keeps each marked variable whole; tfpar splits it into row ranges on the
parameter servers (see tfpar.transform.parameter_server), so trying another count needs
no rebuilt model. The marks live in graph collections of JSON strings, which a
MetaGraphDef carries along.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, Optional, Tuple

import tensorflow as tf

from tfpar.errors import TfparError

GROUPS = "tfpar_partitioner_groups"
MEMBERS = "tfpar_partitioner_members"


class partitioner:  # noqa: N801  (used like TensorFlow's lowercase partitioners)
    """Marks the variables created inside it for a searched partition count.

        with tfpar.partitioner(min_partitions=2):
            emb = tf.compat.v1.get_variable("emb", [vocab, dim])

    or `tf.compat.v1.variable_scope("x", partitioner=tfpar.partitioner())`. Variables of
    one partitioner share a count; several partitioners may coexist. The count is found by
    timing a few short trials inside the job (Parallax's search) and remembered for the
    next run; `tfpar.Config(partitions=...)` overrides it. Only sparse variables on the
    parameter servers (HYBRID or PS mode) are split; in AR mode the marks are ignored.
    """

    def __init__(self, min_partitions: Optional[int] = None,
                 max_partitions: Optional[int] = None):
        for name, value in (("min_partitions", min_partitions),
                            ("max_partitions", max_partitions)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise TfparError(f"tfpar.partitioner: {name} must be a positive int, got "
                                 f"{value!r}")
        if min_partitions and max_partitions and min_partitions > max_partitions:
            raise TfparError(f"tfpar.partitioner: min_partitions={min_partitions} is larger "
                             f"than max_partitions={max_partitions}")
        self.min_partitions, self.max_partitions = min_partitions, max_partitions
        self.group: Optional[str] = None  # named when first used in a graph
        self._scopes = []

    # -- as a context manager ---------------------------------------------------------------
    def __enter__(self):
        self._register()
        scope = tf.compat.v1.variable_creator_scope(self._create)
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(self, *exc):
        return self._scopes.pop().__exit__(*exc)

    def _create(self, next_creator, **kwargs):
        variable = next_creator(**kwargs)
        tf.compat.v1.add_to_collection(MEMBERS, json.dumps(
            {"group": self.group, "variable": variable.op.name}))
        return variable

    # -- as the partitioner= of a variable scope ------------------------------------------------
    def __call__(self, shape, dtype, **unused):
        """One piece: tfpar splits the variable itself. The piece is matched to this call by
        its shape when the graph is analysed (TensorFlow passes no name)."""
        self._register()
        shape = tf.TensorShape(shape)
        tf.compat.v1.add_to_collection(MEMBERS, json.dumps(
            {"group": self.group, "shape": shape.as_list(), "dtype": tf.as_dtype(dtype).name}))
        return [1] * shape.rank

    def _register(self):
        graph = tf.compat.v1.get_default_graph()
        if self.group is None:
            # By order of first use, so the same model code gives the same names (the
            # remembered search is keyed by them).
            self.group = f"partitioner_{len(graph.get_collection(GROUPS))}"
        entry = json.dumps({"group": self.group, "min": self.min_partitions,
                            "max": self.max_partitions})
        if entry not in graph.get_collection(GROUPS):
            graph.add_to_collection(GROUPS, entry)


@dataclasses.dataclass(frozen=True)
class Group:
    """The variables of one `tfpar.partitioner` and its bounds."""

    group: str
    min_partitions: Optional[int]
    max_partitions: Optional[int]
    variables: Tuple[str, ...]


def marked_groups(graph: tf.Graph) -> Dict[str, Group]:
    """{group id: Group} of the variables marked in `graph` (an imported copy is fine)."""
    groups = {}
    for raw in graph.get_collection(GROUPS):
        g = json.loads(_text(raw))
        groups[g["group"]] = (g["min"], g["max"], [])
    pending = []
    for raw in graph.get_collection(MEMBERS):
        m = json.loads(_text(raw))
        if "variable" in m:
            groups[m["group"]][2].append(m["variable"])
        else:
            pending.append(m)
    if pending:
        # partitioner= calls come in creation order, each just before its one-piece variable.
        pieces = _single_pieces(graph)
        for m in pending:
            match = next((i for i, (shape, dtype, _) in enumerate(pieces)
                          if shape == m["shape"] and dtype == m["dtype"]), None)
            if match is None:
                raise TfparError(f"tfpar.partitioner was called for a variable of shape "
                                 f"{m['shape']} that the graph does not have")
            groups[m["group"]][2].append(pieces.pop(match)[2])
    return {gid: Group(gid, lo, hi, tuple(dict.fromkeys(vs))) for gid, (lo, hi, vs)
            in groups.items() if vs}


def _single_pieces(graph: tf.Graph):
    """(full shape, dtype, name) of every variable that is the only piece of its partitioned
    variable, in creation order."""
    out = []
    with graph.as_default():
        for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
            info = v.to_proto().save_slice_info_def
            if info.full_name and list(info.full_shape) == v.shape.as_list():
                out.append((list(info.full_shape), v.dtype.base_dtype.name, v.op.name))
    return out


def _text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw
