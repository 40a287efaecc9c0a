"""The `dcformer` model of lm-eval: lm-eval's own Hugging Face model class (HFLM) for DCFormer checkpoints.

Importing this module imports `modeling_dcformer` (which registers model types "dcformer" and "dcpythia" with
transformers' Auto classes) and registers the name `dcformer` with lm-eval's model registry, so that
`--model dcformer` (or `lm_eval.api.registry.get_model("dcformer")`) resolves to `DCFormerLM`.

`DCFormerLM` is HFLM with three differences, everything else passed through unchanged (`dtype`, `device`,
`batch_size`, `max_length`, `tokenizer`, `revision`, `parallelize`, `peft`, ... and any other keyword, which HFLM
hands to `from_pretrained`, so a config override such as `attention_chunk_size=512` works too):

- the backend is causal (transformers' static list of causal model types does not know "dcformer", so plain
  HFLM guesses, with a warning);
- `trust_remote_code` defaults to False: every checkpoint this project loads -- our native layout, a converted
  Pythia, the authors' released layout (config `model_type` "dcpythia"/"dcformer" with `dim`, `n_layer`, ...
  and an `auto_map` to their remote code) -- loads with the code in this repository;
- a checkpoint without tokenizer files fails with a message that says to pass `tokenizer=...` (also where
  transformers would build an empty tokenizer, as it does for a GPT-NeoX directory).
"""

from __future__ import annotations

import logging

from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM

import modeling_dcformer  # registers the Auto classes

MODEL_NAME = "dcformer"

logger = logging.getLogger(__name__)


class TokenizerLoadError(OSError):
    """The tokenizer of a `dcformer` model did not load, or encodes no text (`dcformer-eval` prints it as one line)."""


class DCFormerLM(HFLM):
    """lm-eval's HFLM for DCFormer / DCPythia checkpoints (a path, a Hub id, or an in-memory model)."""

    def __init__(self, pretrained, backend: str = "causal", trust_remote_code: bool | None = False, **kwargs) -> None:
        if trust_remote_code:
            logger.warning(
                "--model %s with trust_remote_code=True: a checkpoint whose config has an auto_map (the released "
                "layout has one) then runs its own remote code, not modeling_dcformer", MODEL_NAME,
            )
        super().__init__(pretrained=pretrained, backend=backend, trust_remote_code=trust_remote_code, **kwargs)
        model_type = getattr(self.config, "model_type", None)
        if model_type != modeling_dcformer.DCFormerConfig.model_type:
            logger.warning(
                "--model %s got a model of type %r, not a DCFormer; it is evaluated as any Hugging Face causal LM "
                "(the same as --model hf)", MODEL_NAME, model_type,
            )

    def _create_tokenizer(self, pretrained, tokenizer, *args, **kwargs) -> None:
        where = tokenizer if isinstance(tokenizer, str) else pretrained if isinstance(pretrained, str) else None
        hint = (
            "Pass one in --model_args, e.g. tokenizer=EleutherAI/pythia-6.9b (DCPythia checkpoints use the Pythia / "
            "GPT-NeoX tokenizer), or tokenizer=<local directory>"
        )
        try:
            super()._create_tokenizer(pretrained, tokenizer, *args, **kwargs)
        except (OSError, ValueError, TypeError, AssertionError) as err:
            raise TokenizerLoadError(f"could not load a tokenizer from {where!r} ({err}). {hint}") from err
        # transformers builds an empty tokenizer for some model types (GPT-NeoX) from a directory without
        # tokenizer files: every text would then encode to nothing.
        if where is not None and not self.tokenizer("Hello world", add_special_tokens=False)["input_ids"]:
            raise TokenizerLoadError(
                f"the tokenizer loaded from {where!r} encodes no text (no vocabulary files there). {hint}"
            )


def register() -> None:
    """Register `dcformer` with lm-eval's model registry (idempotent; done on import)."""
    if MODEL_NAME not in model_registry:
        register_model(MODEL_NAME)(DCFormerLM)


register()

__all__ = ["DCFormerLM", "MODEL_NAME", "TokenizerLoadError", "register"]
