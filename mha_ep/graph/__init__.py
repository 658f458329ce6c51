"""Graph passes: what mha_ep does to an ONNX model before a session runs it (no GPU, no session).

  model_io.py               loading and saving models (external data, ORT's format checks)
  partition.py              the partition pass: every MultiHeadAttention node through the claim-time gate
                            (mha_ep.claim), claimed nodes to the plugin domain, declined ones left with their
                            reasons; any subgraph depth
  partition_result.py       what the pass returns: the new model and one Decision per node, its report
  lift.py                   --lift-attention: ORT's packed Attention op rewritten as MultiHeadAttention so it is claimed
  static_cache.py           ``mha-ep static-cache``: a decoder rewritten onto a static KV cache (one CUDA graph a step)
  static_cache_checks.py    its refusals: what a decoder must be for the rewrite to take it (StaticCacheError)
  static_cache_result.py    what it returns: the rewritten model and what was pinned, kept and added, its report
  packed_projections.py     its rule PACKED_PROJECTIONS: a self node's Q, K and V MatMuls as one, a packed QKV query
  affine.py                 the shape arithmetic on one run-time number P evaluated at build time as const + P * coeff
  graph_facts.py            what a graph says about its tensors: declared and inferred dims, what a node reads

Each pass's module docstring names its rules; the code, tests and docs cite them as "rule NAME"
(tests/graph/test_rule_names.py).
"""
