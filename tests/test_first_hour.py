"""A user's first hour with a saved DCFormer and its tokenizer, in fresh Python processes whose
stdin is closed: transformers' "Do you wish to run the custom code? [y/N]" prompt would then fail at once instead
of waiting 15 s on a terminal.

transformers 5.24's `AutoTokenizer.from_pretrained(folder)` reads the folder's `config.json` through
`AutoConfig.from_pretrained` before it looks at `tokenizer_config.json` (and its `tokenizer_class`). A saved
DCFormer's `config.json` names its configuration class as remote code (`auto_map["AutoConfig"]`, which
`trust_remote_code=True` loads need), so wherever the model type "dcformer" is not registered, transformers asks
before it ever reads the tokenizer's files, then warns about "a model of type ``" once the prompt is refused. What
a folder holds cannot change that order; what registers the model type can: `import modeling_dcformer` where the
package is installed (this file), `trust_remote_code=True` where it is not (the card's second snippet,
tests/test_hub.py::test_card_snippet_without_the_package_never_prompts).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import TINY
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PROMPT = "Do you wish to run the custom code"
EMPTY_TYPE_WARNING = "to instantiate a model of type ``"


def save_tiny_with_tokenizer(folder: Path) -> list[int]:
    """A tiny DCFormer saved by this package, with a word-level tokenizer beside it; returns the ids of "w3 w5"."""
    torch.manual_seed(0)
    DCFormerForCausalLM(DCFormerConfig(**{**TINY, "eos_token_id": 1})).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(TINY["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1").save_pretrained(folder)
    return [3, 5]


def fine_tune_block_loading() -> str:
    """The README's Fine-tune block up to the lines that load the tokenizer and the model (what follows trains),
    without its peft import (peft registers no model type; importing it, and the torchao it pulls in, is most of a
    fresh interpreter's time on a busy machine)."""
    blocks = [code for lang, code in FENCE.findall((ROOT / "README.md").read_text()) if lang == "python"]
    (block,) = [code for code in blocks if "get_peft_model" in code]
    assert "\nlora = LoraConfig(" in block and "from peft import LoraConfig, get_peft_model\n" in block, block
    block = block.split("\nlora = LoraConfig(", 1)[0] + "\n"
    return block.replace("from peft import LoraConfig, get_peft_model\n", "")


def run_closed_stdin(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter of this environment (the package installed, not imported by anyone but
    `code`), offline, stdin closed, stderr into stdout (unbuffered: in the order written)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf_home"), "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "warning"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-u", "-c", code], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def test_readme_fine_tune_block_loads_a_saved_folder_without_a_prompt(tmp_path):
    """The README's Fine-tune block, as a user pastes it into a fresh Python (the package installed): its
    `AutoTokenizer` and `AutoModelForCausalLM` load `./dcpythia-410m` natively, with no prompt and no warning
    about a model of type ``. The neighbour first, in the same process (one interpreter start): the same lines
    without `import modeling_dcformer` (the block before this fix) do prompt, so the check can tell."""
    ids = save_tiny_with_tokenizer(tmp_path / "dcpythia-410m")
    block = fine_tune_block_loading()
    assert "import modeling_dcformer\n" in block
    without_import = block.replace("import modeling_dcformer\n", "")
    code = (f"try:\n    exec({without_import!r})\nexcept ValueError:\n    print('REFUSED')\n"
            f"print('=== THE README BLOCK')\nexec({block!r})\n"
            "print('LOADED', type(model).__module__, tokenizer('w3 w5')['input_ids'])\n")
    proc = run_closed_stdin(code, tmp_path)
    assert proc.returncode == 0 and "=== THE README BLOCK" in proc.stdout, proc.stdout[-3000:]
    neighbour, readme = proc.stdout.split("=== THE README BLOCK", 1)
    assert PROMPT in neighbour and "REFUSED" in neighbour, neighbour[-3000:]
    assert PROMPT not in readme and EMPTY_TYPE_WARNING not in readme, readme[-3000:]
    assert f"LOADED modeling_dcformer.modeling_dcformer {ids}" in readme, readme[-3000:]
