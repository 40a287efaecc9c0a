"""Research around modeling_dcformer, kept out of the library's wheel: the small DCFormer vs Transformer comparison
of `examples/compare_small.py` and the longer study built on it.

* `compare`: the comparison's command line (one comparison, several sizes); `ablation`: its models and the DCFormer
  ablation variants; `runner`: one training run and its data; `report`: statistics, tables and plots;
* `study`: the longer language-modelling study, a resumable queue of the comparison's runs;
* `synthetic_tasks`, `lm_corpus`: the data (synthetic in-context tasks, real text offline); `flops`: training FLOPs
  from the models' shapes; `arguments`: the argparse types of the command lines.

Importing `dcformer_research` imports nothing heavy; import the modules you need.
"""
