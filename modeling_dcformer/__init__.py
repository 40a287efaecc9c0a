"""DCFormer (DCMHA) for Hugging Face transformers.

The flat modules here are the model, its config, cache and the DCMHA interface with its pure-PyTorch backends: what
a save carries as remote code. Importing the package adds what only it has, through public interfaces:

- the Auto classes know model_type "dcformer" (and the released "dcpythia" config), and `register_for_auto_class`
  makes a save carry the classes as remote code;
- the DCMHA registry gets the kernels "cpu" and "triton" (`kernels/`);
- the flat modules' one link to the package (`configuration_dcformer.PACKAGE`) gets the released checkpoint layout
  and guarded loading (`checkpoints/`), saving, cards and uploads (`publishing/`) and the presets (`configuration/`).

Nothing in other libraries changes: LoRA targets are named in `LoraConfig` (`target_modules="all-linear"` or
`LORA_TARGET_MODULES`), and Trainer's model card is merged into DCFormer's by
`modeling_dcformer.publishing.trainer.DCFormerTrainer`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import configuration, publishing
from .cache_dcformer import DCFormerCache
from .checkpoints import loading, released_format
from .checkpoints.released_format import DCPythiaConfig
from .configuration_dcformer import PACKAGE, DCFormerConfig
from .dcmha import DCMHA_BACKENDS, DCMHABackend, DCMHAInputs, DCMHAInterface
from .kernels import CPU, TRITON
from .modeling_dcformer import DCFormerForCausalLM, DCFormerModel, DCFormerPreTrainedModel

AutoConfig.register(DCFormerConfig.model_type, DCFormerConfig, exist_ok=True)
# The released Caiyun-AI/DCPythia-6.9B config: loads as the equivalent DCFormerConfig.
AutoConfig.register(DCPythiaConfig.model_type, DCPythiaConfig, exist_ok=True)
AutoModel.register(DCFormerConfig, DCFormerModel, exist_ok=True)
AutoModelForCausalLM.register(DCFormerConfig, DCFormerForCausalLM, exist_ok=True)
# transformers' save of a model copies the code of classes registered so (custom_object_save: the model's file and
# its relative imports, the config's included) and points auto_map at it; a config saved alone stays plain data
DCFormerModel.register_for_auto_class("AutoModel")
DCFormerForCausalLM.register_for_auto_class("AutoModelForCausalLM")

DCMHAInterface.register("cpu", CPU)
DCMHAInterface.register("triton", TRITON)

PACKAGE.released, PACKAGE.loading, PACKAGE.publishing, PACKAGE.presets = (
    released_format, loading, publishing, configuration)

# The linear layers LoRA can adapt: the attention's and the MLP's (`gate_proj` exists in the DCFormer++ body only),
# what `target_modules="all-linear"` selects. The DCMHA composition weights (`dyn_w_proj`: raw parameters, no
# nn.Linear) cannot take a LoRA adapter: they stay frozen unless listed in `modules_to_save` (trained in full, as a
# converted Pythia needs: see docs/training.md).
LORA_TARGET_MODULES = ["qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

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
