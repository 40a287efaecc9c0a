"""Sharing on the Hub: saved directories carry the remote code and a model card; they load with
`trust_remote_code=True` in a Python that cannot import this package, and natively (without the copies) where it
can; `push_to_hub` and the converters' `--push-to-hub` upload all of it (the Hub API is replaced by fakes: no
network)."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

import modeling_dcformer  # noqa: F401  (registers the auto classes)
from conftest import TINY, randomize_dyn_w
from modeling_dcformer.conversion import released as released_converter
from modeling_dcformer.conversion import pythia as p2d
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM, DCPythiaConfig, publishing
from modeling_dcformer.publishing import model_card
from helpers import fake_hub_cards, install_fake_hub, isolated_paths, run_without_the_package
from released_checkpoint import released_dir

# What computes travels (the model, its config, cache, the DCMHA interface and PyTorch backends, the load-time checks);
# saving, cards, uploads and kernels stay in the package. `publishing.remote_code_files()` finds them by relative imports.
CODE_FILES = {p.name for p in publishing.remote_code_files()}
assert {"modeling_dcformer.py", "configuration_dcformer.py", "dcmha.py", "dcmha_eager.py", "dcmha_compiled.py",
        "cache_dcformer.py", "checkpoint_checks.py"} <= CODE_FILES
assert not CODE_FILES & {"hub.py", "atomic_dir.py", "model_card.py", "trainer.py", "dcmha_cpu.py", "loading.py",
                         "weight_files.py", "dcmha_triton.py", "released_format.py"}  # a save is in our names
LM_EVAL_RESULTS = {  # the shape of what lm-eval / dcformer-eval write (abridged)
    "results": {
        "piqa_local": {"alias": "piqa_local", "acc,none": 0.625, "acc_stderr,none": 0.125, "acc_norm,none": 0.5,
                       "acc_norm_stderr,none": "N/A"},
        "lambada_openai_local": {"alias": "lambada", "perplexity,none": 12.5, "perplexity_stderr,none": 1.5,
                                 "acc,none": 0.25, "acc_stderr,none": 0.1},
        "dcformer_gen_local": {"exact_match,strip": 0.75, "exact_match_stderr,strip": 0.2},
    },
    "config": {"model": "dcformer", "limit": 8},
}


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def tiny(config_class=DCFormerConfig, seed: int = 0, **overrides) -> DCFormerForCausalLM:
    torch.manual_seed(seed)
    return randomize_dyn_w(DCFormerForCausalLM(config_class(**{**TINY, **overrides})).eval(), seed=seed + 1)


@torch.no_grad()
def logits_of(model, ids):
    return model(ids).logits


def ids_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 11), generator=torch.Generator().manual_seed(7))


def load_native(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def build_neox_source(path: Path) -> Path:
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    GPTNeoXForCausalLM(config).eval().save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Saved directories, and loading them in a Python that cannot import modeling_dcformer
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: directory} of models saved or converted by this package, each with the input ids to check."""
    root = tmp_path_factory.mktemp("hub")
    dirs = {}
    # DCPythia body, a local window and qk-norm
    tiny(window_size=4, use_qk_norm=True).save_pretrained(root / "dcformer")
    dirs["dcformer"] = root / "dcformer"
    # DCFormer++ body from a DCPythiaConfig (model_type "dcpythia")
    plus = dict(norm_type="rmsnorm", use_gated_mlp=True, hidden_act="silu", use_parallel_residual=False,
                attention_bias=False, mlp_bias=False, partial_rotary_factor=1.0)
    tiny(DCPythiaConfig, seed=3, **plus).save_pretrained(root / "dcpythia")
    dirs["dcpythia"] = root / "dcpythia"
    # the converters' outputs
    p2d.convert(str(build_neox_source(root / "neox")), str(root / "converted-pythia"), verify=False)
    dirs["converted-pythia"] = root / "converted-pythia"
    src, _, _ = released_dir(root, "released")
    released_converter.convert(str(src), str(root / "converted-released"))
    dirs["converted-released"] = root / "converted-released"
    for name, directory in dirs.items():
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        torch.save(ids_for(vocab), directory.parent / f"{name}.ids.pt")
    return dirs


ISOLATED_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    from pathlib import Path

    try:
        report = {"spec": repr(importlib.util.find_spec("modeling_dcformer"))}
    except ModuleNotFoundError:
        report = {"spec": "None"}
    try:
        import modeling_dcformer  # noqa: F401
        report["importable"] = True
    except ImportError:
        report["importable"] = False
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    out = Path(sys.argv[1])

    def run(name, directory):
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
        ids = torch.load(out / (name.split("@")[0] + ".ids.pt"))
        with torch.no_grad():
            torch.save(model(ids).logits, out / (name + ".remote.pt"))
        torch.save(model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False), out / (name + ".gen.pt"))
        report[name] = type(model).__module__ + "." + type(model).__name__
        return model

    for name in sys.argv[2:]:
        model = run(name, str(out / name))
    # a model loaded as remote code saves with transformers' own save_pretrained: the copies of the copies, no card
    run("dcformer", str(out / "dcformer")).save_pretrained(out / "resaved", model_card={"overwrite": True})
    run("dcformer@resaved", str(out / "resaved"))
    report["top_level_modules"] = sorted({m.split(".")[0] for m in sys.modules if "dcformer" in m})
    configuration = sys.modules[type(model.config).__module__]  # the copy's config module and its link to the package
    report["package_link"] = {k: repr(getattr(configuration.PACKAGE, k))
                              for k in ("released", "loading", "publishing", "presets")}
    # the authors' released config, given to the remote code alone (which has no released format): one error
    released = out / "released-config"
    released.mkdir()
    for code in (out / "dcformer").glob("*.py"):
        (released / code.name).write_bytes(code.read_bytes())
    auto_map = {"AutoConfig": "configuration_dcformer.DCFormerConfig"}
    (released / "config.json").write_text(json.dumps({"model_type": "dcpythia", "dim": 32, "n_layer": 2, "n_head": 4,
                                                      "auto_map": auto_map}))
    from transformers import AutoConfig
    try:
        report["released"] = type(AutoConfig.from_pretrained(str(released), trust_remote_code=True)).__name__
    except ValueError as err:
        report["released"] = str(err)
    (out / "report.json").write_text(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def isolated(saved):
    """Runs ISOLATED_SCRIPT once over every saved directory in a Python that cannot import the package
    (`run_without_the_package`)."""
    root = next(iter(saved.values())).parent
    run_without_the_package(ISOLATED_SCRIPT, root, root, *saved)
    return root, json.loads((root / "report.json").read_text())


def test_isolated_paths_keep_a_venv_inside_the_checkout(tmp_path):
    """With the README's `python -m venv .venv` inside the clone, the isolated process must still
    find torch (the fixture dropped every path under the checkout, so `make test` failed there)."""
    checkout = tmp_path / "clone"
    venv_site = checkout / ".venv" / "lib" / "python3.11" / "site-packages"
    stdlib = tmp_path / "python" / "lib" / "python3.11"
    for folder in (checkout / "tests", checkout / "examples", venv_site, stdlib):
        folder.mkdir(parents=True)
    paths = [str(checkout), str(checkout / "tests"), str(checkout / "examples"), str(stdlib), str(venv_site), ""]
    assert isolated_paths(paths, checkout) == [str(stdlib), str(venv_site)]


def test_saved_remote_code_carries_the_interface_but_no_kernel(saved):
    """The remote code is the model, its interface and the pure-PyTorch backends; the kernels stay in the package."""
    for directory in saved.values():
        names = {p.name for p in directory.iterdir()}
        assert CODE_FILES <= names, names
        assert not names & {"dcmha_cpu.py", "dcmha_triton.py", "csrc", "dcmha_cpu.cpp"}, names


def test_isolated_python_cannot_import_the_package(isolated):
    _, report = isolated
    assert report["importable"] is False and report["spec"] == "None", report
    assert report["top_level_modules"] == ["transformers_modules"], report


def test_the_package_fills_the_flat_modules_link_and_remote_code_alone_leaves_it_empty(isolated):
    """`configuration_dcformer.PACKAGE` is the flat modules' one link to what only the installed package has: filled
    when the package is imported, empty in a save's remote code alone (which then saves and loads as transformers
    does)."""
    from modeling_dcformer import configuration, configuration_dcformer
    from modeling_dcformer.checkpoints import loading, released_format

    link = configuration_dcformer.PACKAGE
    assert (link.released, link.loading, link.publishing, link.presets) == (
        released_format, loading, publishing, configuration)
    _, report = isolated
    assert report["package_link"] == dict.fromkeys(("released", "loading", "publishing", "presets"), "None")


@pytest.mark.parametrize("name", ["dcformer", "dcpythia", "converted-pythia", "converted-released"])
def test_remote_code_gives_the_native_logits_exactly(isolated, saved, name):
    root, report = isolated
    assert report[name].startswith("transformers_modules.") and report[name].endswith(".DCFormerForCausalLM")
    native = load_native(saved[name])
    assert type(native) is DCFormerForCausalLM  # no trust_remote_code: the installed package, not the copies
    ids = torch.load(root / f"{name}.ids.pt")
    # the remote code carries no kernel: its "auto" runs "eager" at this size, and so does the native model here
    # (the native "auto" takes the CPU kernel, equal to rounding: test_dcmha_backends.py)
    native.config.dcmha_implementation = "eager"
    expected = logits_of(native, ids)
    assert torch.equal(torch.load(root / f"{name}.remote.pt"), expected)
    greedy = native.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    assert torch.equal(torch.load(root / f"{name}.gen.pt"), greedy)


def test_remote_code_alone_refuses_a_released_config_in_one_line(isolated):
    """The released layout's translation stays in the package (a save is in our names); the remote
    code alone, pointed at a released config, says which file it is and what to install or run instead."""
    root, report = isolated
    message = report["released"]
    assert message.startswith(str(root / "released-config" / "config.json")), message
    assert "pip install modeling-dcformer" in message and "dcformer-convert-released" in message
    assert "\n" not in message


def test_remote_loaded_model_saves_loadable_remote_code(isolated, saved):
    root, report = isolated
    assert report["dcformer@resaved"].startswith("transformers_modules.")
    resaved = root / "resaved"
    assert CODE_FILES <= {p.name for p in resaved.iterdir()}
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == publishing.AUTO_MAP
    expected = torch.load(root / "dcformer.remote.pt")
    assert torch.equal(torch.load(root / "dcformer@resaved.remote.pt"), expected)
    ids = torch.load(root / "dcformer.ids.pt")
    native = load_native(resaved)
    native.config.dcmha_implementation = "eager"  # as above: the remote code's "auto" runs eager here
    assert torch.equal(logits_of(native, ids), expected)  # and natively here
    assert not (resaved / "README.md").exists()  # cards are written by the installed package only


@pytest.mark.parametrize("name", ["dcformer", "dcpythia", "converted-pythia", "converted-released"])
def test_saved_directory_layout(saved, name):
    directory = saved[name]
    names = {p.name for p in directory.iterdir()}
    assert CODE_FILES | {"config.json", "README.md", "model.safetensors"} <= names, names
    package = Path(modeling_dcformer.__file__).parent
    for file in CODE_FILES:
        assert (directory / file).read_bytes() == (package / file).read_bytes(), file
    config = json.loads((directory / "config.json").read_text())
    assert config["auto_map"] == publishing.AUTO_MAP
    assert config["model_type"] == "dcformer"  # also for the DCPythiaConfig model: "dcpythia" reads released keys
    card = ModelCard.load(directory / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"dcformer", "dcmha"} <= set(card.data.tags)
    assert model_card.is_generated_card(card.content)
    assert f'from_pretrained("{directory.name}", trust_remote_code=True)' in card.text


def test_native_load_needs_no_copied_code(saved, tmp_path):
    """trust_remote_code=True still takes the installed classes; the copies can be gone altogether."""
    ids = torch.load(saved["dcformer"].parent / "dcformer.ids.pt")
    expected = logits_of(load_native(saved["dcformer"]), ids)
    trusted = load_native(saved["dcformer"], trust_remote_code=True)
    assert type(trusted) is DCFormerForCausalLM and torch.equal(logits_of(trusted, ids), expected)
    bare = tmp_path / "bare"
    shutil.copytree(saved["dcformer"], bare)
    for file in CODE_FILES:
        (bare / file).unlink()
    assert torch.equal(logits_of(load_native(bare), ids), expected)
    assert not [m for m in sys.modules if m.startswith(("transformers_modules.dcformer", "transformers_modules.bare"))]


def test_remote_code_can_be_left_out(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path, remote_code=False, model_card=False)
    assert not CODE_FILES & {p.name for p in tmp_path.iterdir()} and not (tmp_path / "README.md").exists()
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())
    ids = ids_for(TINY["vocab_size"])
    assert torch.equal(logits_of(load_native(tmp_path), ids), logits_of(model, ids))


CARD_SNIPPET_SCRIPT = textwrap.dedent(
    """
    import sys, time

    start = time.monotonic()
    exec(open(sys.argv[1]).read())  # the card's snippet for a Python without the package
    print("vocabulary", len(tokenizer), type(model).__module__.split(".")[0], f"{time.monotonic() - start:.1f}s")
    """
)


def test_card_snippet_without_the_package_never_prompts(tmp_path):
    """The card's snippet for a Python without the package loads the tokenizer and the model
    without asking "Do you wish to run the custom code?" (stdin closed: an unanswered prompt there would be an
    error, on a terminal a 15 s wait). transformers' AutoTokenizer reads the model's config first, through
    `auto_map` when it has one, so the snippet passes `trust_remote_code=True` to both."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tiny-dc"
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)
    tiny().save_pretrained(folder)  # after the tokenizer: the card's snippet loads it from the folder
    card = (folder / "README.md").read_text()
    snippet = card.split("Anywhere else", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "snippet.py").write_text(snippet)
    proc = run_without_the_package(CARD_SNIPPET_SCRIPT, tmp_path, tmp_path / "snippet.py", timeout=300)
    assert "custom code" not in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert f"vocabulary {TINY['vocab_size']} transformers_modules" in proc.stdout


# ----------------------------------------------------------------------------------------------------------------
# The model card
# ----------------------------------------------------------------------------------------------------------------
def test_card_never_replaces_a_users_readme(tmp_path):
    model = tiny()
    (tmp_path / "README.md").write_text("# My own card\n")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "# My own card\n"
    model.save_pretrained(tmp_path, model_card={"overwrite": True, "license": "mit"})
    assert ModelCard.load(tmp_path / "README.md").data.license == "mit"
    model.save_pretrained(tmp_path)  # our own card is refreshed
    assert ModelCard.load(tmp_path / "README.md").data.license == "apache-2.0"


def test_card_eval_results_from_every_input_form(tmp_path):
    """The offline `*_local` tasks run with a limit are smoke runs: in the card's text, never in its model-index
    (tests/test_model_card.py checks what does go there)."""
    results_file = tmp_path / "lm-eval" / "my-model" / "results_2024-06-01T12-00-00.json"  # --output_path's layout
    results_file.parent.mkdir(parents=True)
    results_file.write_text(json.dumps(LM_EVAL_RESULTS))
    for eval_results in (LM_EVAL_RESULTS, str(results_file), tmp_path / "lm-eval", LM_EVAL_RESULTS["results"]):
        path = model_card.write_model_card(tmp_path, DCFormerConfig(**TINY), model_name="tiny-dc",
                                           eval_results=eval_results)
        card = ModelCard.load(path)  # parses the YAML
        assert card.data.eval_results is None and "model-index:" not in card.content
        for row in ("| piqa_local | acc | 0.6250 | 0.1250 |", "| piqa_local | acc_norm | 0.5000 |  |",
                    "| lambada_openai_local | perplexity | 12.5000 | 1.5000 |",
                    "| lambada_openai_local | acc | 0.2500 | 0.1000 |",
                    "| dcformer_gen_local | exact_match,strip | 0.7500 "):
            assert row in card.text, row
        assert ("limit=8" in card.text) == (eval_results is not LM_EVAL_RESULTS["results"])  # lm-eval's `limit`
    with pytest.raises(ValueError, match="no metric"):
        model_card.model_card(DCFormerConfig(**TINY), model_name="x",
                              eval_results={"results": {"piqa": {"alias": "p"}}})


def test_card_base_model_and_provenance():
    config = DCFormerConfig(**TINY, converted_from="EleutherAI/pythia-70m", converted_from_revision="step1000",
                            converted_from_model_type="gpt_neox",
                            conversion={"exact": True, "max_logit_difference": 2e-6})
    card = model_card.model_card(config, model_name="dcpythia-70m", repo_id="me/dcpythia-70m")
    assert card.data.base_model == "EleutherAI/pythia-70m"
    assert "[EleutherAI/pythia-70m](https://huggingface.co/EleutherAI/pythia-70m) (revision step1000)" in card.text
    assert "2.0e-06" in card.text and 'from_pretrained("me/dcpythia-70m")' in card.text
    config.converted_from = "/data/checkpoints/my-neox"  # a local source is no base_model
    card = model_card.model_card(config, model_name="x", base_model=None, license=None)
    assert card.data.base_model is None and card.data.license is None and "checkpoint `my-neox` (local)" in card.text
    assert model_card.model_card(config, model_name="x", base_model="org/base").data.base_model == "org/base"


# ----------------------------------------------------------------------------------------------------------------
# Uploads (fake Hub API)
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    return fake_hub_cards(monkeypatch, install_fake_hub(monkeypatch, tmp_path), tmp_path)


def test_push_to_hub_uploads_weights_config_code_and_card(fake_hub):
    model = tiny(window_size=4)
    info = model.push_to_hub("tiny-dc", private=True, token="hf_x", eval_results=LM_EVAL_RESULTS, tags=["demo"],
                             commit_message="first")
    assert info.commit_url == "https://huggingface.co/me/tiny-dc/commit/0123abc"
    assert fake_hub.create_repo == [dict(repo_id="tiny-dc", private=True, token="hf_x", exist_ok=True)]
    (upload,) = fake_hub.upload
    assert upload["repo_id"] == "me/tiny-dc" and upload["kwargs"]["commit_message"] == "first"
    assert upload["kwargs"]["token"] == "hf_x"
    assert set(upload["files"]) == CODE_FILES | {"config.json", "generation_config.json", "model.safetensors",
                                                "README.md"}
    assert upload["config"]["auto_map"] == publishing.AUTO_MAP
    card = ModelCard(upload["readme"])
    assert card.data.license == "apache-2.0" and "demo" in card.data.tags
    assert card.data.eval_results is None and "| piqa_local | acc | 0.6250 | 0.1250 |" in card.text  # a smoke run
    assert 'from_pretrained("me/tiny-dc", trust_remote_code=True)' in card.text
    assert not upload["folder"].exists()  # a temporary directory
    assert not {"_upload_modified_files", "_dcformer_push"} & set(vars(model))  # the push's upload step: its own


def test_push_keeps_a_users_card_on_the_hub(fake_hub):
    """transformers' push_to_hub keeps a card the user wrote on the Hub and adds the model's tags to it; ours replaces
    it only with `overwrite_model_card`, and refreshes a card of ours."""
    fake_hub.hub_readme = "---\nlicense: mit\n---\n# Written by hand\n"
    tiny().push_to_hub("me/tiny-dc", tags=["demo"])
    card = ModelCard(fake_hub.upload[-1]["readme"])
    assert card.text.strip() == "# Written by hand" and card.data.license == "mit"
    assert {"dcformer", "dcmha", "demo"} <= set(card.data.tags) and not model_card.is_generated_card(card.content)
    tiny().push_to_hub("me/tiny-dc", overwrite_model_card=True)
    assert model_card.is_generated_card(fake_hub.upload[-1]["readme"])
    fake_hub.hub_readme = fake_hub.upload[-1]["readme"].replace("me/tiny-dc", "me/old")  # our own card on the Hub
    tiny().push_to_hub("me/tiny-dc")
    readme = fake_hub.upload[-1]["readme"]
    assert 'from_pretrained("me/tiny-dc"' in readme and "me/old" not in readme


def test_push_to_hub_is_transformers_with_the_models_tags(fake_hub, monkeypatch):
    """`model.push_to_hub` runs transformers' `PushToHubMixin.push_to_hub`, whose card step
    (`create_and_tag_model_card`) gets the model's tags (`add_model_tags`) and the call's; the card uploaded is
    DCFormer's, with those tags."""
    import transformers.utils.hub as transformers_hub

    seen, original = [], transformers_hub.create_and_tag_model_card
    monkeypatch.setattr(transformers_hub, "create_and_tag_model_card",
                        lambda repo_id, tags=None, token=None: seen.append((repo_id, tags)) or original(repo_id, tags))
    model = tiny()
    model.add_model_tags(["mine"])
    model.push_to_hub("tiny-dc", tags=["demo"])
    ((repo_id, tags),) = seen
    assert repo_id == "me/tiny-dc" and {"dcformer", "dcmha", "mine", "demo"} <= set(tags)
    card = ModelCard(fake_hub.upload[-1]["readme"])
    assert model_card.is_generated_card(card.content) and {"dcformer", "dcmha", "mine", "demo"} <= set(card.data.tags)
    assert 'from_pretrained("me/tiny-dc", trust_remote_code=True)' in card.text


def test_a_broken_install_never_falls_back_to_a_plain_save(tmp_path):
    """Only a Python without the package saves with transformers' plain (not atomic, card-less) save: a package
    whose saving module fails to import fails to import itself, never a silent fallback."""
    code = ("import sys; sys.modules['modeling_dcformer.publishing.saving'] = None\n"
            "import modeling_dcformer")  # its import raises ModuleNotFoundError
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "modeling_dcformer.publishing.saving" in proc.stderr, proc.stderr[-2000:]


def test_save_pretrained_push_to_hub(fake_hub, tmp_path):
    tiny().save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="me/tiny-dc", commit_message="m")
    (upload,) = fake_hub.upload
    assert upload["folder"] == tmp_path / "local" and upload["kwargs"]["commit_message"] == "m"
    assert CODE_FILES | {"README.md", "model.safetensors"} <= set(upload["files"])
    assert 'from_pretrained("me/tiny-dc")' in upload["readme"]


@pytest.mark.parametrize("repo_id", ["a/b/c", "./local-dir", "my model", ""])
def test_bad_repo_id_is_refused_before_anything_happens(fake_hub, tmp_path, capsys, repo_id):
    with pytest.raises(ValueError, match="is not a Hub repository id"):
        tiny().push_to_hub(repo_id)
    src = build_neox_source(tmp_path / "neox")
    assert p2d.main([str(src), str(tmp_path / "dst"), "--push-to-hub", repo_id]) == 2
    assert "is not a Hub repository id" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists() and not fake_hub.create_repo and not fake_hub.upload


def test_pythia_converter_pushes_the_finished_directory(fake_hub, tmp_path, capsys):
    src = build_neox_source(tmp_path / "neox")
    dst = tmp_path / "dcpythia-tiny"
    argv = [str(src), str(dst), "--push-to-hub", "me/dcpythia-tiny", "--private", "--token", "hf_x"]
    assert p2d.main(argv) == 0, capsys.readouterr().err
    assert "Pushed" in capsys.readouterr().out
    assert fake_hub.create_repo == [dict(repo_id="me/dcpythia-tiny", private=True, token="hf_x", exist_ok=True)]
    (upload,) = fake_hub.upload
    assert upload["folder"] == dst and upload["repo_id"] == "me/dcpythia-tiny"
    assert set(upload["files"]) == CODE_FILES | {"config.json", "model.safetensors", "README.md",
                                                "generation_config.json"}  # (copied from the source)
    assert upload["config"]["auto_map"] == publishing.AUTO_MAP
    config = upload["config"]  # the source's folder's name (never its path)
    assert Path(config.get("converted_from") or config["converted_from_folder"]).name == "neox"
    card = ModelCard(upload["readme"])
    assert card.data.license == "apache-2.0" and card.data.base_model is None  # a local source
    assert "# dcpythia-tiny" in card.text and "exactly the source's function" in card.text


def test_released_converter_pushes_with_base_model(fake_hub, tmp_path, capsys, monkeypatch):
    src, _, _ = released_dir(tmp_path, "released")
    from modeling_dcformer.conversion import converter as skeleton  # the pipeline both converters run

    # as if SRC were the Hub id of the release: resolve_source returns its snapshot directory
    monkeypatch.setattr(skeleton, "resolve_source", lambda name, revision=None: src)
    dst = tmp_path / "dcpythia-hf"
    argv = ["Caiyun-AI/DCPythia-tiny", str(dst), "--push-to-hub", "me/dcpythia-hf", "--license", "mit"]
    assert released_converter.main(argv) == 0, capsys.readouterr().err
    (upload,) = fake_hub.upload
    assert upload["folder"] == dst and CODE_FILES | {"README.md", "model.safetensors"} <= set(upload["files"])
    card = ModelCard(upload["readme"])
    assert card.data.base_model == "Caiyun-AI/DCPythia-tiny" and card.data.license == "mit"
    assert "released checkpoint" in card.text


# ----------------------------------------------------------------------------------------------------------------
# A failed upload: the retry keeps the user's choices
# ----------------------------------------------------------------------------------------------------------------
SECRET = "hf_secret_token_123"


@pytest.mark.parametrize("stage", ["create_repo", "upload"])
def test_failed_push_retry_keeps_private_revision_and_pull_request(fake_hub, stage):
    """A failed `push_to_hub(..., private=True)` must not suggest a retry that creates a public repository: the
    Python retry and the `hf upload` command repeat private, the revision and the pull request; never the token."""
    fake_hub.fail = stage
    with pytest.raises(publishing.HubUploadError) as failure:
        tiny().push_to_hub("me/tiny-dc", private=True, revision="exp", create_pr=True, token=SECRET)
    message = str(failure.value)
    assert "model.push_to_hub('me/tiny-dc', private=True, revision='exp', create_pr=True)" in message
    assert "hf upload me/tiny-dc DIR --private --revision exp --create-pr" in message
    assert SECRET not in message and "pass your token again" in message
    assert "\n" not in message


def test_failed_save_and_push_retry_keeps_private_and_revision(fake_hub, tmp_path):
    fake_hub.fail = "upload"
    target = tmp_path / "my model"  # a space: the command quotes it
    with pytest.raises(publishing.HubUploadError) as failure:
        tiny().save_pretrained(target, push_to_hub=True, repo_id="me/tiny-dc", private=True, revision="exp")
    message = str(failure.value)
    assert f"hf upload me/tiny-dc '{target}' --private --revision exp" in message
    assert "model.push_to_hub('me/tiny-dc', private=True, revision='exp')" in message
    assert failure.value.command == f"hf upload me/tiny-dc '{target}' --private --revision exp"
    # a public push says nothing of private, and the command-line form holds no Python
    fake_hub.fail = "create_repo"
    with pytest.raises(publishing.HubUploadError) as failure:
        tiny().save_pretrained(target, push_to_hub=True, repo_id="me/tiny-dc")
    assert "--private" not in str(failure.value) and "private=" not in str(failure.value)
    assert "push_to_hub(" not in failure.value.for_command_line()
    assert f"hf upload me/tiny-dc '{target}'" in failure.value.for_command_line()


def trainer_for(tmp_path, **args):
    from transformers import TrainingArguments

    from modeling_dcformer.publishing.trainer import DCFormerTrainer

    rows = [{"input_ids": list(range(i, i + 8)), "labels": list(range(i, i + 8))} for i in range(8)]
    arguments = TrainingArguments(str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                                  save_strategy="no", report_to="none", use_cpu=True, **args)
    return DCFormerTrainer(model=tiny(), args=arguments, train_dataset=rows)


def test_trainer_push_to_hub_failures_are_one_message(fake_hub, tmp_path):
    """`DCFormerTrainer.push_to_hub()` offline: one HubUploadError (no HTTP traceback chained), with a retry keeping
    `hub_private_repo` and `hub_revision`, and the `hf upload` command leaving checkpoints out as Trainer does."""
    import traceback

    trainer = trainer_for(tmp_path, hub_model_id="me/tiny-trained", hub_private_repo=True, hub_revision="exp")
    fake_hub.fail = "create_repo"
    with pytest.raises(publishing.HubUploadError) as failure:
        trainer.push_to_hub()
    message = str(failure.value)
    assert "Hugging Face Hub repository 'me/tiny-trained' failed" in message and "nothing was saved" in message
    assert "trainer.push_to_hub(private=True, revision='exp')" in message
    printed = "".join(traceback.format_exception(failure.value))
    assert "During handling" not in printed and "direct cause" not in printed

    fake_hub.fail = "upload"
    with pytest.raises(publishing.HubUploadError) as failure:
        trainer.push_to_hub()
    out = (tmp_path / "out").absolute()
    message = str(failure.value)
    assert f"saved the model to {out} (complete" in message
    excluded = "--exclude '_*' --exclude 'checkpoint-*'"  # what Trainer's own upload leaves out
    assert f"hf upload me/tiny-trained {out} --private --revision exp {excluded}" in message
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_trainer_with_push_to_hub_offline_is_one_message(fake_hub, tmp_path):
    fake_hub.fail = "create_repo"
    with pytest.raises(publishing.HubUploadError) as failure:
        trainer_for(tmp_path, push_to_hub=True, hub_private_repo=True)
    message = str(failure.value)
    assert message.startswith("creating the Hugging Face Hub repository 'out' failed")
    assert "nothing was trained" in message
    assert f"hf upload out {(tmp_path / 'out').absolute()} --private" in message
    fake_hub.fail = None  # the neighbour: a reachable Hub
    assert trainer_for(tmp_path, push_to_hub=True).hub_model_id == "me/out"

