"""DCFormer (DCMHA) for Hugging Face transformers.

Importing this package registers model_type "dcformer" with AutoConfig, AutoModel and AutoModelForCausalLM, and,
where peft is installed, the default LoRA target modules of "dcformer" and "dcpythia" (`LORA_TARGET_MODULES`).
"""

import importlib.util

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.utils import logging

from .cache_dcformer import DCFormerCache
from .configuration_dcformer import DCFormerConfig, DCPythiaConfig
from .dcmha import DCMHA_BACKENDS, DCMHABackend, DCMHAInputs, DCMHAInterface
from .hub import keep_card_under_trainer
from .modeling_dcformer import DCFormerForCausalLM, DCFormerModel, DCFormerPreTrainedModel

AutoConfig.register(DCFormerConfig.model_type, DCFormerConfig, exist_ok=True)
# The released Caiyun-AI/DCPythia-6.9B config: loads as the equivalent DCFormerConfig.
AutoConfig.register(DCPythiaConfig.model_type, DCPythiaConfig, exist_ok=True)
AutoModel.register(DCFormerConfig, DCFormerModel, exist_ok=True)
AutoModelForCausalLM.register(DCFormerConfig, DCFormerForCausalLM, exist_ok=True)

logger = logging.get_logger(__name__)

# What `LoraConfig(task_type="CAUSAL_LM")` adapts when it names no `target_modules`: every linear layer of the
# attention and the MLP (`gate_proj` exists in the DCFormer++ body only). The DCMHA composition weights
# (`dyn_w_proj`: raw parameters, no nn.Linear) cannot take a LoRA adapter: they stay frozen unless listed in
# `modules_to_save` (trained in full, as a converted Pythia needs: see docs/training.md).
LORA_TARGET_MODULES = ["qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _register_peft_defaults() -> None:
    """Add "dcformer" and "dcpythia" to peft's table of default LoRA target modules (peft is optional)."""
    if importlib.util.find_spec("peft") is None:
        return
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
    except Exception as err:  # a peft that does not import (say, too old for this transformers): LoRA unaffected
        logger.warning(f"peft is installed but failed to import ({err}): no default LoRA target modules for DCFormer")
        return
    for model_type in (DCFormerConfig.model_type, DCPythiaConfig.model_type):
        mapping.setdefault(model_type, list(LORA_TARGET_MODULES))


_register_peft_defaults()
keep_card_under_trainer()  # where Trainer is imported already; else a DCFormer model's first save does it

__version__ = "0.1.0"

__all__ = [
    "DCFormerCache",
    "DCFormerConfig",
    "DCFormerForCausalLM",
    "DCFormerModel",
    "DCFormerPreTrainedModel",
    "DCMHABackend",
    "DCMHAInputs",
    "DCMHAInterface",
    "DCMHA_BACKENDS",
    "DCPythiaConfig",
    "LORA_TARGET_MODULES",
]
