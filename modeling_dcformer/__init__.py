"""DCFormer (DCMHA) for Hugging Face transformers.

Importing this package registers model_type "dcformer" with AutoConfig, AutoModel and AutoModelForCausalLM.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_dcformer import DCFormerCache
from .configuration_dcformer import DCFormerConfig, DCPythiaConfig
from .dcmha import DCMHA_BACKENDS, DCMHABackend, DCMHAInputs, DCMHAInterface
from .modeling_dcformer import DCFormerForCausalLM, DCFormerModel, DCFormerPreTrainedModel

AutoConfig.register(DCFormerConfig.model_type, DCFormerConfig, exist_ok=True)
# The released Caiyun-AI/DCPythia-6.9B config: loads as the equivalent DCFormerConfig.
AutoConfig.register(DCPythiaConfig.model_type, DCPythiaConfig, exist_ok=True)
AutoModel.register(DCFormerConfig, DCFormerModel, exist_ok=True)
AutoModelForCausalLM.register(DCFormerConfig, DCFormerForCausalLM, exist_ok=True)

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
]
