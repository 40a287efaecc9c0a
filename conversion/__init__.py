"""Converters into this package's layout, one module per source family, each a command (docs/conversion.md):

- `pythia`: GPT-NeoX / Pythia -> DCPythia computing the source's function (`dcformer-convert-pythia`);
- `llama`: Llama, Qwen2, Qwen3, Mistral -> DCFormer++ computing the source's function (`dcformer-convert-llama`);
- `released`: the authors' released DCFormer checkpoints re-saved in our names (`dcformer-convert-released`).

`converter` is the skeleton they fill in (check, source, config, tensors, verify, finalize, push); `common` holds the
pieces it is built from (sources, shards, the output folder, provenance); `exact` is the skeleton of a conversion
whose output computes the source's function (the exact DCMHA initialisation, its options, the verification), on which
`pythia` and `llama` are built."""
