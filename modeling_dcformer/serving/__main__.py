"""`python -m modeling_dcformer.serving`: the console script `dcformer-serve`."""

import sys

from .serve import cli

sys.exit(cli())
