"""foldkv.lab: what the notebooks, harnesses and tests use to measure the runtime (benchmarks, peers, correctness
gates, the drift study with its model integration and synthetic checkpoints, run records, notebook parameters).

The runtime (`foldkv` itself: config, layout, pool, prep, reference, floor, validate, kernels, aot) never imports
this package.
"""
