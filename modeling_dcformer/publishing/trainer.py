"""`DCFormerTrainer`: transformers' `Trainer` that keeps DCFormer's model card when it writes its own.

`Trainer.create_model_card` (which `Trainer.push_to_hub` calls after saving) replaces the output folder's README.md
with Trainer's card. For a DCFormer model this subclass merges the two instead (`merge_trainer_card`):
DCFormer's card (usage, architecture, provenance, evaluation) with Trainer's tags, datasets and a "Training" section
(hyperparameters, results on the evaluation set). Other models, and a README.md this package did not generate, get
Trainer's own behaviour. Use it in place of `Trainer`, or call `keep_dcformer_card(trainer)` after
`trainer.create_model_card()`. Installed package only (not remote code).

`DCFormerTrainer` also saves a DCFormer model's tokenizer before the model (so that the card's usage loads it from
the folder), and its Hub steps fail in one `HubUploadError` (the repository it could not create, or the folder it
saved and could not upload, with the retry keeping `private` and the revision) instead of the HTTP client's traceback.
"""

import os
import re
from pathlib import Path

from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints.atomic_dir import write_file
from .hub import HubUploadError, retry_call
from .model_card import card_options, has_tokenizer, is_generated_card, model_card

TRAINER_SECTION = "## Training (written by transformers' Trainer)"
# What `Trainer.push_to_hub` leaves out of its upload of the output folder (its `ignore_patterns`)
TRAINER_UPLOAD_EXCLUDE = ("_*", f"{PREFIX_CHECKPOINT_DIR}-*")


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
    old_id = re.search(r'AutoModelForCausalLM\.from_pretrained\("([^"]*)"', body)  # not a tokenizer's source
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
        options = card_options(model, {"model_name": model_name or path.parent.resolve().name,
                                       "tokenizer": has_tokenizer(path.parent)})
        before = str(model_card(model.config, **options))
    elif not is_generated_card(before):
        return None  # the user's own card: Trainer's behaviour
    merged = merge_trainer_card(before, path.read_text(encoding="utf-8"), getattr(trainer, "hub_model_id", None),
                                model_name)
    write_file(path, merged)
    return path


class DCFormerTrainer(Trainer):
    """`Trainer` whose `create_model_card` keeps DCFormer's card, merged with Trainer's, and whose Hub steps fail in
    one `HubUploadError` (see the module)."""

    _saved_for_push = False  # `push_to_hub` saved the output folder: a failure after it is the upload's

    def create_model_card(self, *args, **kwargs):
        self._saved_for_push = True  # `Trainer.push_to_hub` writes the card after saving the model
        path = Path(self.args.output_dir) / "README.md"
        before = path.read_text(encoding="utf-8") if path.is_file() else None
        result = super().create_model_card(*args, **kwargs)
        keep_dcformer_card(self, before, kwargs.get("model_name"))
        return result

    def _save(self, output_dir: str | None = None, state_dict=None):
        """Trainer's save, with a DCFormer model's tokenizer written before the model: the model's save then writes
        a card whose usage loads the tokenizer from the folder (Trainer writes the tokenizer again after it)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self.processing_class is not None and _dcformer_model(self) is not None:
            os.makedirs(output_dir, exist_ok=True)
            self.processing_class.save_pretrained(output_dir)
        return super()._save(output_dir, state_dict)

    def _hub_options(self, token=None, private=None, revision=None) -> dict:
        args = self.args
        return dict(private=private if private is not None else args.hub_private_repo,
                    revision=revision if revision is not None else args.hub_revision,
                    token=token if token is not None else args.hub_token)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Trainer's repository creation; a failure is one `HubUploadError` (nothing uploaded)."""
        try:
            super().init_hf_repo(token=token, private=private)
        except Exception as err:
            options = self._hub_options(token, private)
            repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
            output_dir = Path(self.args.output_dir).absolute()
            retry = retry_call("trainer.push_to_hub", private=options["private"], revision=options["revision"])
            error = HubUploadError.of(err, repo_id, None, **options, retry=retry, exclude=TRAINER_UPLOAD_EXCLUDE,
                                      upload_dir=output_dir, save_call="trainer.save_model()")
            if not hasattr(self, "state"):  # in `Trainer.__init__` (push_to_hub=True): before any training
                error.args = (f"creating {error.failure}: nothing was trained or uploaded. Create the Trainer again "
                              f"once the Hub is reachable, or without push_to_hub and upload {output_dir} after "
                              f"training with `{error.command}`",)
            raise error from None

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """Trainer's `push_to_hub`; a failure to create the repository or to upload is one `HubUploadError` (the
        output folder, once saved, stays complete: its message gives the `hf upload` command that uploads it)."""
        self._saved_for_push = False
        try:
            return super().push_to_hub(commit_message, blocking, token, revision, private, **kwargs)
        except HubUploadError:
            raise
        except Exception as err:
            if not self._saved_for_push or not self.is_world_process_zero():
                raise  # the local save failed: its own error
            options = self._hub_options(token, private, revision)
            retry = retry_call("trainer.push_to_hub", private=options["private"], revision=options["revision"])
            repo_id = self.hub_model_id or self.args.hub_model_id or Path(self.args.output_dir).absolute().name
            raise HubUploadError.of(err, repo_id, Path(self.args.output_dir).absolute(), **options, retry=retry,
                                    exclude=TRAINER_UPLOAD_EXCLUDE) from None


__all__ = ["DCFormerTrainer", "TRAINER_SECTION", "TRAINER_UPLOAD_EXCLUDE", "keep_dcformer_card",
           "merge_trainer_card"]
