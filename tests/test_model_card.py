"""The model card is honest and survives: only whole-benchmark lm-eval runs enter the `model-index` (with dataset,
split and source), smoke runs (a `limit`, the bundled `*_local` tasks) are labelled so in the text; the usage
snippet (tokenizer + `generate`) runs; a reloaded model saved again keeps its eval results while its weights are
the ones measured; the model's tags reach its card; `Trainer.push_to_hub` keeps DCFormer's card, merged with
Trainer's; a `save_pretrained(..., push_to_hub=True)` whose upload fails leaves a complete directory and says how
to retry. The Hub API is replaced by fakes: no network."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainingArguments

import modeling_dcformer  # noqa: F401  (registers the auto classes)
from conftest import TINY, randomize_dyn_w
from helpers import fake_hub_cards, install_fake_hub
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM, publishing
from modeling_dcformer.checkpoints.fingerprint import model_fingerprint
from modeling_dcformer.publishing import model_card
from modeling_dcformer.publishing.eval_results import read_eval_results
from modeling_dcformer.publishing.trainer import TRAINER_SECTION, DCFormerTrainer

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

LM_EVAL = "https://github.com/EleutherAI/lm-evaluation-harness"
# The shape of what lm-eval 0.4.13 returns and writes (abridged; the numbers are made up): two upstream tasks run
# on every row, and the bundled offline copy of PIQA.
FULL_RUN = {
    "results": {
        "piqa": {"alias": "piqa", "acc,none": 0.7622, "acc_stderr,none": 0.0099, "acc_norm,none": 0.7644,
                 "acc_norm_stderr,none": 0.0098},
        "lambada_openai": {"alias": "lambada_openai", "perplexity,none": 4.45, "perplexity_stderr,none": 0.1,
                           "acc,none": 0.671, "acc_stderr,none": 0.0065},
        "piqa_local": {"alias": "piqa_local", "acc,none": 0.6, "acc_stderr,none": 0.09},
    },
    "configs": {
        "piqa": {"task": "piqa", "dataset_path": "baber/piqa", "training_split": "train",
                 "validation_split": "validation"},
        "lambada_openai": {"task": "lambada_openai", "dataset_path": "EleutherAI/lambada_openai",
                           "dataset_name": "default", "test_split": "test"},
        "piqa_local": {"task": "piqa_local", "dataset_path": "json", "validation_split": "validation"},
    },
    "n-shot": {"piqa": 0, "lambada_openai": 0, "piqa_local": 0},
    "n-samples": {"piqa": {"original": 1838, "effective": 1838},
                  "lambada_openai": {"original": 5153, "effective": 5153},
                  "piqa_local": {"original": 30, "effective": 30}},
    "config": {"model": "dcformer", "limit": None},
    "lm_eval_version": "0.4.13",
}
# (task, metric): (value, dataset, config, split) of the model-index entries FULL_RUN must give, and no others
EXPECTED_INDEX = {
    ("piqa", "acc"): (0.7622, "baber/piqa", None, "validation"),
    ("piqa", "acc_norm"): (0.7644, "baber/piqa", None, "validation"),
    ("lambada_openai", "perplexity"): (4.45, "EleutherAI/lambada_openai", "default", "test"),
    ("lambada_openai", "acc"): (0.671, "EleutherAI/lambada_openai", "default", "test"),
}
SMOKE_HEADING = "### Smoke runs: not benchmark results"


def tiny(seed: int = 0, **overrides) -> DCFormerForCausalLM:
    torch.manual_seed(seed)
    return randomize_dyn_w(DCFormerForCausalLM(DCFormerConfig(**{**TINY, **overrides})).eval(), seed=seed + 1)


def ids_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def logits_of(model, ids):
    return model(ids).logits


def index_of(card: ModelCard) -> dict:
    return {(r.dataset_name, r.metric_name): r for r in card.data.eval_results or []}


def smoke_rows(card: ModelCard) -> dict[tuple[str, str], str]:
    """{(task, metric): why} from the card's smoke-run table."""
    if SMOKE_HEADING not in card.text:
        return {}
    table = card.text.split(SMOKE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return {(cells[0].strip(), cells[1].strip()): cells[4].strip() for cells in rows[1:]}


@pytest.fixture
def tokenizer():
    """A small byte-level BPE trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["The harbour town wakes before the boats come in.", "Gulls follow the last boat home at dusk."] * 4
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    return fake_hub_cards(monkeypatch, install_fake_hub(monkeypatch, tmp_path), tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# Honest metadata
# ----------------------------------------------------------------------------------------------------------------
def test_only_whole_benchmark_runs_enter_the_model_index():
    card = ModelCard(str(model_card.model_card(DCFormerConfig(**TINY), model_name="tiny-dc", eval_results=FULL_RUN)))
    index = index_of(card)  # parsed back from the YAML
    assert set(index) == set(EXPECTED_INDEX)
    for key, (value, dataset, config, split) in EXPECTED_INDEX.items():
        entry = index[key]
        assert (entry.metric_value, entry.dataset_type, entry.dataset_config, entry.dataset_split) == (
            value, dataset, config, split)
        assert entry.source_name == "lm-evaluation-harness 0.4.13" and entry.source_url == LM_EVAL
        assert entry.task_type == "text-generation" and entry.metric_type == key[1]
    assert "| piqa | baber/piqa | validation | 0 | acc | 0.7622 | 0.0099 |" in card.text
    assert set(smoke_rows(card)) == {("piqa_local", "acc")}  # the bundled fixture task: in the text, labelled
    assert "offline copy" in smoke_rows(card)[("piqa_local", "acc")]


@pytest.mark.parametrize("run", ["limit", "fewer-rows", "no-dataset-record"])
def test_smoke_runs_stay_out_of_the_model_index(run):
    if run == "limit":  # lm-eval's --limit
        results, why = {**FULL_RUN, "config": {"model": "dcformer", "limit": 100}}, "limit=100"
    elif run == "fewer-rows":  # a subset without --limit: n-samples says so
        samples = {task: {"original": 1838, "effective": 200} for task in FULL_RUN["results"]}
        results, why = {**FULL_RUN, "n-samples": samples}, "200 of the task's 1838 rows"
    else:  # the bare results mapping: no dataset, split or limit recorded
        results, why = FULL_RUN["results"], "no dataset and split"
    card = ModelCard(str(model_card.model_card(DCFormerConfig(**TINY), model_name="tiny-dc", eval_results=results)))
    assert card.data.eval_results is None and "model-index:" not in card.content
    rows = smoke_rows(card)
    assert set(rows) == {(task, metric) for task, metric in EXPECTED_INDEX} | {("piqa_local", "acc")}
    assert all(why in reason for (task, _), reason in rows.items() if task != "piqa_local"), rows


def test_a_real_limited_lm_eval_run_is_a_smoke_run(tokenizer, tmp_path):
    """lm-eval's own output (the bundled piqa_local, limit=3) read from the results file it wrote."""
    pytest.importorskip("lm_eval")
    from modeling_dcformer.evals import harness

    model = tiny(vocab_size=len(tokenizer))
    harness.evaluate(model, tokenizer, ["piqa_local"], batch_size=4, limit=3, output_path=tmp_path / "lm-eval")
    results = read_eval_results(tmp_path / "lm-eval")
    import lm_eval

    assert results["source"] == f"lm-evaluation-harness {lm_eval.__version__}"
    records = {r["metric"]: r for r in results["results"]}
    assert set(records) == {"acc", "acc_norm"}
    for record in records.values():  # what lm-eval recorded of the task, read under the keys it uses
        assert (record["task"], record["dataset"], record["split"], record["samples"]) == (
            "piqa_local", "json", "validation", 3)
        assert record["num_fewshot"] == 0 and "limit=3" in record["smoke"]
    model.save_pretrained(tmp_path / "model", model_card={"eval_results": tmp_path / "lm-eval"})
    card = ModelCard.load(tmp_path / "model" / "README.md")
    assert card.data.eval_results is None and "model-index:" not in card.content
    assert set(smoke_rows(card)) == {("piqa_local", "acc"), ("piqa_local", "acc_norm")}


def test_card_usage_snippet_runs_tokenizer_and_generate(tokenizer, tmp_path, monkeypatch):
    model = tiny(vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "snippet-model")  # first: the model's save writes the card for what is there
    model.save_pretrained(tmp_path / "snippet-model")
    text = (tmp_path / "snippet-model" / "README.md").read_text()
    native, remote = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)[:2]
    assert 'AutoTokenizer.from_pretrained("snippet-model", trust_remote_code=True)' in remote
    assert 'from_pretrained("snippet-model", trust_remote_code=True)' in remote
    monkeypatch.chdir(tmp_path)  # the snippet names the model by its directory
    namespace = {}
    exec(compile(native, "card-snippet", "exec"), namespace)
    inputs = namespace["inputs"]
    expected = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert torch.equal(namespace["output"], expected) and expected.shape[1] > inputs["input_ids"].shape[1]


def code_blocks(text: str) -> list[str]:
    """The card's two usage snippets: with the package installed, and anywhere else (remote code)."""
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)[:2]


def test_card_of_a_model_saved_without_a_tokenizer_loads_none_from_its_folder(tokenizer, tmp_path):
    """A save without a tokenizer: the usage never calls AutoTokenizer on that folder; it says where the tokenizer
    comes from. Saved with one (the tokenizer first, or the model again after it, or into a folder that holds one):
    the snippets load it from the folder."""
    model, folder = tiny(vocab_size=len(tokenizer)), tmp_path / "no-tok"
    model.save_pretrained(folder)
    text = (folder / "README.md").read_text()
    native, remote = code_blocks(text)
    assert 'AutoTokenizer.from_pretrained("no-tok"' not in text
    assert 'AutoModelForCausalLM.from_pretrained("no-tok")' in native
    assert 'AutoModelForCausalLM.from_pretrained("no-tok", trust_remote_code=True)' in remote
    assert "saved without a tokenizer" in text and "the tokenizer the model was trained with" in native

    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)  # again, now beside a tokenizer (carried over into the new save)
    native, remote = code_blocks((folder / "README.md").read_text())
    assert 'AutoTokenizer.from_pretrained("no-tok")' in native
    assert 'AutoTokenizer.from_pretrained("no-tok", trust_remote_code=True)' in remote
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}


def test_card_follows_what_the_save_carries_over_not_another_users_files(tokenizer, tmp_path, monkeypatch):
    """A tokenizer or README.md another user put in the folder is not carried over into a re-save (atomic_dir), so
    the card neither loads that tokenizer from the folder nor keeps that README in place of the card; the user's
    own are (the other side)."""
    model, folder = tiny(vocab_size=len(tokenizer)), tmp_path / "shared"
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text("# my notes\n")
    stranger = {folder / name for name in ("tokenizer.json", "tokenizer_config.json", "README.md")}
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):  # the other owner, simulated (the test may not run as root)
        st = real_lstat(path, *args, **kwargs)
        if Path(path) in stranger:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, os.geteuid() + 1, st.st_gid,
                                   st.st_size, st.st_atime, st.st_mtime, st.st_ctime))
        return st

    assert model_card.users_readme(folder) and model_card.has_tokenizer(folder)  # the user's own: kept, loaded
    monkeypatch.setattr(os, "lstat", lstat)
    assert not model_card.users_readme(folder) and not model_card.has_tokenizer(folder)
    model.save_pretrained(folder)  # a re-save: the card is written, and loads no tokenizer from the folder
    assert 'AutoTokenizer.from_pretrained("shared")' not in (folder / "README.md").read_text()


def test_card_without_a_tokenizer_names_the_converted_source(tokenizer, tmp_path):
    """A converted model saved without a tokenizer: the usage loads the tokenizer of the model it was converted
    from (its Hub id in the config); with its own tokenizer saved, the folder's."""
    model = tiny(vocab_size=len(tokenizer))
    model.config.converted_from = "EleutherAI/pythia-70m"
    model.save_pretrained(tmp_path / "converted", model_card={"repo_id": "me/dcpythia-70m"})
    text = (tmp_path / "converted" / "README.md").read_text()
    native, _ = code_blocks(text)
    assert 'AutoTokenizer.from_pretrained("EleutherAI/pythia-70m")' in native
    assert 'AutoTokenizer.from_pretrained("me/dcpythia-70m"' not in text
    assert "the model it was converted from" in text

    tokenizer.save_pretrained(tmp_path / "with-tok")
    model.save_pretrained(tmp_path / "with-tok", model_card={"repo_id": "me/dcpythia-70m"})
    native, _ = code_blocks((tmp_path / "with-tok" / "README.md").read_text())
    assert 'AutoTokenizer.from_pretrained("me/dcpythia-70m")' in native and "EleutherAI" not in native


def test_trainer_merge_renames_the_model_not_the_tokenizers_source():
    config = DCFormerConfig(**TINY)
    config.converted_from = "EleutherAI/pythia-70m"
    ours = str(model_card.model_card(config, model_name="local", repo_id="local", tokenizer=False))
    trainer_card = "---\ntags:\n- generated_from_trainer\n---\n# local\n\n## Training procedure\n\nsteps: 2\n"
    from modeling_dcformer.publishing.trainer import merge_trainer_card

    merged = merge_trainer_card(ours, trainer_card, repo_id="me/new")
    assert 'AutoModelForCausalLM.from_pretrained("me/new")' in merged and 'from_pretrained("local"' not in merged
    assert 'AutoTokenizer.from_pretrained("EleutherAI/pythia-70m")' in merged


def test_pushed_card_and_trainer_card_follow_the_tokenizer(fake_hub, tokenizer, tmp_path):
    """`model.push_to_hub` uploads no tokenizer: its card loads none from the repository. `DCFormerTrainer` saves
    the tokenizer before the model: the output's card loads it from the folder; without a tokenizer, it does not."""
    tiny().push_to_hub("me/tiny-dc")
    readme = fake_hub.upload[-1]["readme"]
    assert 'AutoTokenizer.from_pretrained("me/tiny-dc"' not in readme and "saved without a tokenizer" in readme

    args = TrainingArguments(str(tmp_path / "out"), report_to="none", use_cpu=True)
    DCFormerTrainer(model=tiny(vocab_size=len(tokenizer)), args=args, processing_class=tokenizer).save_model()
    native, _ = code_blocks((tmp_path / "out" / "README.md").read_text())
    assert 'AutoTokenizer.from_pretrained("out")' in native
    args = TrainingArguments(str(tmp_path / "bare"), report_to="none", use_cpu=True)
    DCFormerTrainer(model=tiny(), args=args).save_model()
    assert 'AutoTokenizer.from_pretrained("bare"' not in (tmp_path / "bare" / "README.md").read_text()


# ----------------------------------------------------------------------------------------------------------------
# What survives a re-save, tags, Trainer's card
# ----------------------------------------------------------------------------------------------------------------
def index_values(card: ModelCard) -> dict:
    return {key: (r.metric_value, r.dataset_type, r.dataset_split, r.source_name) for key, r in index_of(card).items()}


def test_resaving_a_loaded_model_keeps_its_eval_results(tmp_path, caplog):
    tiny().save_pretrained(tmp_path / "first", model_card={"eval_results": FULL_RUN})
    first = ModelCard.load(tmp_path / "first" / "README.md")
    assert set(index_of(first)) == set(EXPECTED_INDEX)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "first").eval()
    for again in (tmp_path / "again", tmp_path / "first"):  # elsewhere, and in place
        reloaded.save_pretrained(again)
        card = ModelCard.load(again / "README.md")
        assert index_values(card) == index_values(first), again
        assert set(smoke_rows(card)) == {("piqa_local", "acc")}
    with torch.no_grad():  # the weights change (fine-tuning would): the results no longer describe them
        reloaded.model.norm.weight.mul_(1.5)
    reloaded.save_pretrained(tmp_path / "changed")
    card = ModelCard.load(tmp_path / "changed" / "README.md")
    assert card.data.eval_results is None and "## Evaluation" not in card.text
    assert model_card.CONFIG_EVAL_KEY not in json.loads((tmp_path / "changed" / "config.json").read_text())
    assert "measured on other weights" in caplog.text


def test_model_tags_are_per_model_and_reach_the_card(tmp_path):
    tagged, plain = tiny(), tiny()
    assert plain.model_tags == ["dcformer", "dcmha"]
    tagged.add_model_tags(["harbour"])
    assert tagged.model_tags == ["dcformer", "dcmha", "harbour"] and plain.model_tags == ["dcformer", "dcmha"]
    tagged.save_pretrained(tmp_path)
    assert ModelCard.load(tmp_path / "README.md").data.tags == ["dcformer", "dcmha", "harbour"]


def test_trainer_push_to_hub_keeps_the_dcformer_card(fake_hub, tmp_path):
    tiny().save_pretrained(tmp_path / "base", model_card={"eval_results": FULL_RUN})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    rows = [{"input_ids": list(range(i, i + 8)), "labels": list(range(i, i + 8))} for i in range(8)]
    args = TrainingArguments(str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                             save_strategy="no", report_to="none", use_cpu=True, hub_model_id="tiny-trained")
    trainer = DCFormerTrainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    trainer.push_to_hub()

    (upload,) = fake_hub.upload
    assert upload["repo_id"] == "me/tiny-trained" and upload["folder"] == tmp_path / "out"
    card = ModelCard(upload["readme"])
    assert model_card.is_generated_card(card.text)  # DCFormer's card, not Trainer's alone
    assert {"dcformer", "dcmha", "generated_from_trainer"} <= set(card.data.tags)
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-trained", trust_remote_code=True)' in card.text
    assert card.text.count("\n# ") == 1 and "\n# tiny-trained\n" in card.text
    training = card.text.split(TRAINER_SECTION, 1)[1].split("\n## ", 1)[0]  # Trainer's own text, merged
    assert "Training hyperparameters" in training and "training_steps: 2" in training
    # the base model's lm-eval results measured other weights: not in the fine-tuned model's card or config
    assert card.data.eval_results is None and "## Evaluation" not in card.text
    assert model_card.CONFIG_EVAL_KEY not in upload["config"]
    assert (tmp_path / "out" / "README.md").read_text() == upload["readme"]

    trainer.create_model_card(model_name="tiny-trained")  # again: still one Trainer section
    assert (tmp_path / "out" / "README.md").read_text().count(TRAINER_SECTION) == 1


# ----------------------------------------------------------------------------------------------------------------
# A failed upload
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["create_repo", "upload"])
def test_failed_upload_leaves_a_complete_directory(fake_hub, tmp_path, stage):
    target = tmp_path / "tiny-dc"
    tiny(seed=1).save_pretrained(target)  # an older save, replaced by the new one
    model = tiny(seed=2)
    fake_hub.fail = stage
    with pytest.raises(publishing.HubUploadError) as failure:
        model.save_pretrained(target, push_to_hub=True, repo_id="me/tiny-dc")
    message = str(failure.value)
    assert f"saved the model to {target}" in message and "network is unreachable" in message
    assert f"hf upload me/tiny-dc {target}" in message and "push_to_hub('me/tiny-dc')" in message
    assert isinstance(failure.value.cause, ConnectionError) and not fake_hub.upload
    assert failure.value.__cause__ is None and failure.value.__suppress_context__  # no chained traceback

    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-dc"]  # no unfinished save beside it
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "modeling_dcformer.py"} <= names
    assert json.loads((target / "config.json").read_text())["auto_map"] == publishing.AUTO_MAP
    assert 'from_pretrained("me/tiny-dc", trust_remote_code=True)' in (target / "README.md").read_text()
    ids = ids_for(TINY["vocab_size"])
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(target).eval(), ids), logits_of(model, ids))

    fake_hub.fail = None  # the retry the message suggests
    model.push_to_hub("me/tiny-dc")
    assert fake_hub.upload[-1]["repo_id"] == "me/tiny-dc"


@pytest.mark.parametrize("stage", ["create_repo", "upload"])
def test_failed_push_to_hub_is_one_message(fake_hub, tmp_path, stage):
    """`model.push_to_hub` offline ends in one HubUploadError naming the Hub, the repository and
    the retry, with the network error kept in `.cause` instead of a chained traceback."""
    import traceback

    fake_hub.fail = stage
    with pytest.raises(publishing.HubUploadError) as failure:
        tiny().push_to_hub("me/tiny-dc")
    message = str(failure.value)
    assert "Hugging Face Hub repository 'me/tiny-dc'" in message and "network is unreachable" in message
    assert "push_to_hub('me/tiny-dc')" in message and "nothing was saved locally" in message
    assert isinstance(failure.value.cause, ConnectionError)
    printed = "".join(traceback.format_exception(failure.value))
    assert "During handling" not in printed and "direct cause" not in printed
    assert not fake_hub.upload


def test_plain_trainer_card_is_trainers_and_keep_dcformer_card_merges(tmp_path):
    """Without DCFormerTrainer nothing is patched: Trainer's `create_model_card` writes Trainer's card; the
    documented `keep_dcformer_card(trainer)` then merges DCFormer's in."""
    from transformers import Trainer

    from modeling_dcformer.publishing.trainer import keep_dcformer_card

    args = TrainingArguments(str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, save_strategy="no",
                             report_to="none", use_cpu=True)
    rows = [{"input_ids": list(range(i, i + 8)), "labels": list(range(i, i + 8))} for i in range(4)]
    trainer = Trainer(model=tiny(), args=args, train_dataset=rows)
    trainer.train()
    trainer.create_model_card(model_name="tiny-trained")
    readme = tmp_path / "out" / "README.md"
    assert not model_card.is_generated_card(readme.read_text())  # Trainer's own card: no wrapped method
    assert keep_dcformer_card(trainer, model_name="tiny-trained") == readme
    card = ModelCard.load(readme)
    assert model_card.is_generated_card(card.text) and TRAINER_SECTION in card.text
    assert {"dcformer", "dcmha", "generated_from_trainer"} <= set(card.data.tags)


def test_card_of_a_converted_model_trained_since(tmp_path):
    """A converted Pythia says it computes the source's function only while its
    weights are the converted ones (the converters record their fingerprint in `config.conversion["weights"]`)."""
    model = tiny()
    model.config.converted_from_model_type = "gpt_neox"
    model.config.converted_from_folder = "pythia-tiny"
    model.config.conversion = {"exact": True, "weights": model_fingerprint(model)}
    model.save_pretrained(tmp_path / "same")
    text = (tmp_path / "same" / "README.md").read_text()
    assert "computes exactly the source's function; these weights are the converted ones." in text
    assert "`pythia-tiny` (local)" in text
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # trained since
    model.save_pretrained(tmp_path / "trained")
    text = (tmp_path / "trained" / "README.md").read_text()
    assert "exactly the source's function" not in text
    assert "Its weights have changed since the conversion (trained or edited)." in text


def test_one_atomic_file_write_for_cards_and_reports(tmp_path, monkeypatch):
    """`atomic_dir.write_file` is the package's one write-beside-and-rename of a file (the card,
    Trainer's card merge, the study's reports): a new file gets the umask's mode (not a temporary file's 0600), and a
    write that fails before the rename leaves the old file whole and no temporary file beside it."""
    import stat

    from modeling_dcformer.checkpoints import atomic_dir
    from dcformer_research import report

    assert report.write_atomic is atomic_dir.write_file
    path = tmp_path / "README.md"
    umask = os.umask(0o022)
    try:
        atomic_dir.write_file(path, "first \u00fc\r\n")
    finally:
        os.umask(umask)
    assert path.read_bytes() == "first \u00fc\r\n".encode() and stat.S_IMODE(path.stat().st_mode) == 0o644

    def disk_full(*args):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_dir.os, "replace", disk_full)
    with pytest.raises(OSError, match="disk full"):
        atomic_dir.write_file(path, "second")
    assert path.read_bytes() == "first \u00fc\r\n".encode() and [p.name for p in tmp_path.iterdir()] == ["README.md"]


def test_report_figures_use_the_same_atomic_write(tmp_path, monkeypatch):
    """The report's figures are written by `atomic_dir.write_file` too (they had their own `mkstemp` swap, whose file
    kept mode 0600): a whole PNG with the umask's mode; a failed rename leaves the old figure and nothing beside it."""
    import stat

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from modeling_dcformer.checkpoints import atomic_dir
    from dcformer_research import report

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = tmp_path / "curves.png"
    umask = os.umask(0o022)
    try:
        report.save_figure(fig, path)
    finally:
        os.umask(umask)
    image = path.read_bytes()
    assert image.startswith(b"\x89PNG") and stat.S_IMODE(path.stat().st_mode) == 0o644

    def disk_full(*args):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_dir.os, "replace", disk_full)
    ax.plot([0, 1], [0, 1])
    with pytest.raises(OSError, match="disk full"):
        report.save_figure(fig, path)
    plt.close(fig)
    assert path.read_bytes() == image and [p.name for p in tmp_path.iterdir()] == ["curves.png"]
