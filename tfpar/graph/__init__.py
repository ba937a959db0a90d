"""The graph layer: reading a user's TensorFlow graph, with no job.

- `analysis`: `analyse(graph)`, every variable's role, gradient and updates (the facts
  are `tfpar.plan.graph_facts` values).
- `extract`: the dataflow of a graph's dense layers, for the tiling planner.
- `partitioner`: `tfpar.partitioner()`, which marks variables for the partition search.
- `graph_copy`, `naming`: copies of graphs and names of the ops tfpar adds.
- `initializers`: a variable's initialiser and initial value (a warm start's included).
"""
