"""Training DCFormer: `dcformer-train` (`train_clm.py`, Trainer in the style of `run_clm.py`), the accelerate
configs it is launched with (`accelerate/`), and a tiny byte-level BPE tokenizer trained locally (`tokenizer.py`)."""
