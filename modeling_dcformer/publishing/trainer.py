"""`DCFormerTrainer`: transformers' `Trainer` that keeps DCFormer's model card when it writes its own.

`Trainer.create_model_card` (which `Trainer.push_to_hub` calls after saving) replaces the output folder's README.md
with Trainer's card. For a DCFormer model this subclass merges the two instead (`merge_trainer_card`):
DCFormer's card (usage, architecture, provenance, evaluation) with Trainer's tags, datasets and a "Training" section
(hyperparameters, results on the evaluation set). Other models, and a README.md this package did not generate, get
Trainer's own behaviour. Use it in place of `Trainer`, or call `keep_dcformer_card(trainer)` after
`trainer.create_model_card()`. Installed package only (not remote code).
"""

import re
from pathlib import Path

from transformers import PreTrainedModel, Trainer

from ..checkpoints.atomic_dir import write_file
from .model_card import card_options, is_generated_card, model_card

TRAINER_SECTION = "## Training (written by transformers' Trainer)"


def _trainer_body(text: str) -> list[str]:
    """The body of a card from `Trainer.create_model_card`, one heading level down, without its title, its comment
    and its empty or "More information needed" sections."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = text.replace("This model is a fine-tuned version of [](https://huggingface.co/) on", "It was trained on")
    sections = [[]]
    for line in text.splitlines():
        if line.startswith("#"):
            sections.append([])
        sections[-1].append(line)
    level = lambda section: len(section[0]) - len(section[0].lstrip("#")) if section else 0  # noqa: E731
    lines = []
    for i, section in enumerate(sections):
        body = [line for line in section[1:] if line.strip()]
        if level(section) == 1:  # the title: the card has its own
            section = section[1:]
        elif level(section) > 1:
            following = sections[i + 1] if i + 1 < len(sections) else []
            if body == ["More information needed"] or (not body and level(following) <= level(section)):
                continue
        lines += ["#" + line if line.startswith("#") else line for line in section]
    return "\n".join(lines).strip("\n").splitlines()


def merge_trainer_card(card_text: str, trainer_text: str, repo_id: str | None = None,
                       model_name: str | None = None) -> str:
    """DCFormer's card `card_text` with what `Trainer.create_model_card` wrote (`trainer_text`): Trainer's tags,
    datasets and language (and base model or license where ours has none) join the metadata, its text (training
    procedure, hyperparameters, results on the evaluation set) becomes a "Training" section before the citation.
    Trainer's model-index is left out (it names no split or source). `repo_id`, `model_name`: the repository
    Trainer pushes to and its name, for the usage snippets and the title."""
    from huggingface_hub import ModelCard

    ours, theirs = ModelCard(card_text), ModelCard(trainer_text)
    data = ours.data
    data.tags = list(dict.fromkeys([*(data.tags or []), *(theirs.data.tags or [])]))
    for key in ("datasets", "language", "base_model", "license"):
        if getattr(data, key, None) is None and getattr(theirs.data, key, None) is not None:
            setattr(data, key, getattr(theirs.data, key))
    body = ours.text
    if TRAINER_SECTION in body:  # merged before: the new Trainer text replaces the old
        head, _, rest = body.partition(TRAINER_SECTION)
        following = re.search(r"^## ", rest, re.M)
        body = head.rstrip("\n") + "\n\n" + (rest[following.start() :] if following else "")
    old_id = re.search(r'from_pretrained\("([^"]*)"', body)
    if repo_id and old_id and old_id.group(1) != repo_id:
        body = body.replace(f'from_pretrained("{old_id.group(1)}"', f'from_pretrained("{repo_id}"')
    if model_name:
        body = re.sub(r"^# .*$", lambda _: f"# {model_name}", body, count=1, flags=re.M)
        if data.eval_results:
            data.model_name = model_name
    section = "\n".join([TRAINER_SECTION, "", *_trainer_body(theirs.text), "", ""])
    head, citation, tail = body.partition("\n## Citation")
    body = head.rstrip("\n") + "\n\n" + section + citation.lstrip("\n") + tail if citation else body + "\n" + section
    return f"---\n{data.to_yaml()}\n---\n" + body


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
    write_file(path, merged)
    return path


class DCFormerTrainer(Trainer):
    """`Trainer` whose `create_model_card` keeps DCFormer's card, merged with Trainer's (see the module)."""

    def create_model_card(self, *args, **kwargs):
        path = Path(self.args.output_dir) / "README.md"
        before = path.read_text(encoding="utf-8") if path.is_file() else None
        result = super().create_model_card(*args, **kwargs)
        keep_dcformer_card(self, before, kwargs.get("model_name"))
        return result


__all__ = ["DCFormerTrainer", "TRAINER_SECTION", "keep_dcformer_card", "merge_trainer_card"]
