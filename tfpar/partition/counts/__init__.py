"""Partition counts of sparse variables (Parallax, section 3.2), pure.

- `search`: the sampling-and-fit search over counts, t(P) = a + b/P + cP.

What marks the variables whose count is searched is `tfpar.graph.partitioner`
(`tfpar.partitioner()`); the timed trials inside a running job are
`tfpar.runtime.trials`.
"""
