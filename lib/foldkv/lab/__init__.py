"""foldkv.lab: what the notebooks, harnesses and tests use to measure the runtime (benchmarks, peers, correctness
gates, the drift study with its model integration and synthetic checkpoints, run records, notebook parameters).

The runtime (`foldkv` itself: config, layout, pool, prep, reference, validate, kernels, aot) never imports
this package.
"""


def _quiet_tqdm_auto() -> None:
    """TileLang and transformers import `tqdm.auto`, which in a Jupyter kernel without ipywidgets warns "IProgress not
    found" and then falls back to tqdm's text bar. Import it once with that warning silenced: notebooks keep the text
    bars (the lab's own use `from tqdm import tqdm` with file=sys.stdout) without a warning in every saved output."""
    import warnings

    try:
        from tqdm import TqdmWarning
    except ImportError:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        import tqdm.auto  # noqa: F401


_quiet_tqdm_auto()
