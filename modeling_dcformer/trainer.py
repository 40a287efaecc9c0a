"""`DCFormerTrainer`: transformers' `Trainer` that keeps DCFormer's model card when it writes its own.

`Trainer.create_model_card` (which `Trainer.push_to_hub` calls after saving) replaces the output folder's README.md
with Trainer's card. For a DCFormer model this subclass merges the two instead (`model_card.merge_trainer_card`):
DCFormer's card (usage, architecture, provenance, evaluation) with Trainer's tags, datasets and a "Training" section
(hyperparameters, results on the evaluation set). Other models, and a README.md this package did not generate, get
Trainer's own behaviour. Use it in place of `Trainer`, or call `keep_dcformer_card(trainer)` after
`trainer.create_model_card()`. Installed package only (not remote code).
"""

from pathlib import Path

from transformers import PreTrainedModel, Trainer

from .model_card import card_options, is_generated_card, merge_trainer_card, model_card, replace_file


def _dcformer_model(trainer):
    """The DCFormer model `trainer` trains (a `PreTrainedModel`: not a PEFT model, whose card is PEFT's), or None."""
    model = trainer.model
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    model = unwrap(model) if unwrap is not None else model
    if isinstance(model, PreTrainedModel) and getattr(model.config, "model_type", None) in ("dcformer", "dcpythia"):
        return model
    return None


def keep_dcformer_card(trainer, before: str | None = None, model_name: str | None = None) -> Path | None:
    """Merge the card Trainer just wrote in `trainer.args.output_dir` with DCFormer's: `before` (the README.md that
    was there, if this package generated it) or a card made now from the model. Returns the README.md merged, or
    None (not a DCFormer model, not the main process, or a card of the user's own)."""
    model = _dcformer_model(trainer)
    path = Path(trainer.args.output_dir) / "README.md"
    if model is None or not trainer.is_world_process_zero() or not path.is_file():
        return None
    if before is None:  # no save wrote our card here yet
        options = card_options(model, {"model_name": model_name or path.parent.resolve().name})
        before = str(model_card(model.config, **options))
    elif not is_generated_card(before):
        return None  # the user's own card: Trainer's behaviour
    merged = merge_trainer_card(before, path.read_text(encoding="utf-8"), getattr(trainer, "hub_model_id", None),
                                model_name)
    replace_file(path, merged)
    return path


class DCFormerTrainer(Trainer):
    """`Trainer` whose `create_model_card` keeps DCFormer's card, merged with Trainer's (see the module)."""

    def create_model_card(self, *args, **kwargs):
        path = Path(self.args.output_dir) / "README.md"
        before = path.read_text(encoding="utf-8") if path.is_file() else None
        result = super().create_model_card(*args, **kwargs)
        keep_dcformer_card(self, before, kwargs.get("model_name"))
        return result


__all__ = ["DCFormerTrainer", "keep_dcformer_card"]
