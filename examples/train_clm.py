#!/usr/bin/env python
"""Causal-LM training of DCFormer with the `transformers` Trainer: the console script `dcformer-train` as a file,
for launchers that take a script (`accelerate launch`, `torchrun`). Everything it does, and every flag, is in
`modeling_dcformer.training.train_clm` (`dcformer-train --help`).

    python examples/train_clm.py --config_name dcformer-tiny --new_tokenizer_vocab_size 512 \
        --train_file examples/data/harbour_train.txt --validation_file examples/data/harbour_validation.txt \
        --block_size 64 --per_device_train_batch_size 8 --max_steps 100 --learning_rate 3e-3 \
        --do_train --do_eval --output_dir /tmp/dcformer-tiny-harbour --use_cpu --report_to none
    accelerate launch --config_file $(dcformer-train --print-accelerate-config multi_cpu_gloo) \
        examples/train_clm.py ... --use_cpu
"""

import sys

from modeling_dcformer.training.train_clm import cli

if __name__ == "__main__":
    sys.exit(cli())
