"""The steps of `make demo` (`examples/demo.py`): a tiny Pythia converted, fine-tuned, evaluated, saved, reloaded
with and without the package, and sampled (`pipeline.py`)."""
