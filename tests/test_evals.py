"""evals/: lm-eval 0.4.13 on DCFormer, offline, on a tiny model and the fixtures shipped in evals/fixtures.

Checks: the three local tasks score like their upstream YAMLs (same prompts, metrics, HellaSwag preprocessing)
and produce acc (and perplexity for LAMBADA); batch size 1 and 8 give the same numbers; `--model dcformer`
(the script, in a subprocess) and `--model hf` give the same numbers; `--model hf` on a GPT-NeoX and
`--model dcformer` on its DCPythia conversion agree; the released layout loads; a generate_until task runs
with left-padded batches; the data directory comes from the argument or the environment; the report renders.
Nothing is downloaded: the tokenizer is trained here with `tokenizers`, the models are built here.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DISABLE_MULTIPROC": "1",  # lm-eval's bootstrap stderr in-process, no worker pool
    "OMP_NUM_THREADS": "1",
}
for _key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # before datasets / lm_eval load
    os.environ.setdefault(_key, "1")

pytest.importorskip("lm_eval")
import huggingface_hub.constants  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import modeling_dcformer  # noqa: E402,F401
from modeling_dcformer.evals import harness, report  # noqa: E402
from modeling_dcformer.evals.dcformer_lm import DCFormerLM  # noqa: E402
from modeling_dcformer.evals.tasks import local_data  # noqa: E402
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM  # noqa: E402

FIXTURES = ROOT / "evals" / "fixtures"
LOCAL_TASKS = ["lambada_openai_local", "piqa_local", "hellaswag_local"]
FIXTURE_ROWS = {"lambada_openai_local": 32, "piqa_local": 30, "hellaswag_local": 30}


@pytest.fixture(scope="module", autouse=True)
def offline_single_thread():
    """Tiny models: one intra-op thread is faster and does not spin against a busy machine. Hub access is off
    for the whole module (huggingface_hub reads HF_HUB_OFFLINE once, at import)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        for key, value in OFFLINE_ENV.items():
            mp.setenv(key, value)
        mp.delenv(local_data.ENV_VAR, raising=False)
        yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------------
# A tokenizer trained on the fixtures, a tiny DCFormer that has learned the generation fixture
# ----------------------------------------------------------------------------------------------------------------
def fixture_texts() -> list[str]:
    texts = []
    for path in sorted(FIXTURES.glob("*.jsonl")):
        for row in local_data.read_jsonl(path):
            for value in row.values():
                values = value if isinstance(value, list) else [value]
                texts.extend(v for v in values if isinstance(v, str))
    return texts


def gen_texts() -> list[str]:
    rows = local_data.read_jsonl(FIXTURES / "dcformer_gen.jsonl")
    return [f"Question: {r['question']}\nAnswer: {r['answer']}\n" for r in rows]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(fixture_texts(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>",
        pad_token="<|padding|>",
    )


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    """(model, tokenizer, saved directory): 2 layers (one local with window 8), hidden 32, composition weights
    randomised large so that a padding bug would show, then trained briefly on the generation fixture."""
    torch.manual_seed(0)
    config = DCFormerConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=512, window_size=8, bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )
    model = DCFormerForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "dyn_w_proj" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    batch = tokenizer(gen_texts(), padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    path = tmp_path_factory.mktemp("tiny-dcformer")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, path


@pytest.fixture(scope="module")
def results_bs1(tiny):
    model, tok, _ = tiny
    return harness.evaluate(model, tok, LOCAL_TASKS, batch_size=1)


def assert_same_numbers(a: dict, b: dict, rel: float = 0.0) -> None:
    """Every metric (and stderr) of every task: accuracies exactly equal, perplexities equal to `rel` (a sum of
    float32 log-probabilities computed in differently shaped batches may differ in the last bit)."""
    assert set(a["results"]) == set(b["results"])
    for task, metrics in a["results"].items():
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert numbers, task
        for key, value in numbers.items():
            other = b["results"][task][key]
            if key.startswith("perplexity"):
                assert other == pytest.approx(value, rel=rel, abs=0.0), (task, key, value, other)
            else:
                assert other == value, (task, key, value, other)


def latest_results(directory: Path) -> dict:
    files = sorted(Path(directory).rglob("results*.json"))
    assert files, f"no results file under {directory}"
    return json.loads(files[-1].read_text())


# ----------------------------------------------------------------------------------------------------------------
# The tasks
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ours, upstream",
    [
        ("lambada_openai_local.yaml", "lambada/lambada_openai.yaml"),
        ("piqa_local.yaml", "piqa/piqa.yaml"),
        ("hellaswag_local.yaml", "hellaswag/hellaswag.yaml"),
    ],
)
def test_local_task_scores_like_upstream(ours, upstream):
    """Same prompts, targets, choices, splits, metrics and preprocessing as lm-eval's own YAML; only where the
    data comes from (and the name) differ."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    mine = load_yaml(ROOT / "evals" / "tasks" / ours, resolve_func=True)
    theirs = load_yaml(Path(lm_eval.tasks.__file__).parent / upstream, resolve_func=True)
    data_keys = {"task", "tag", "dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset"}
    mine_rest = {k: v for k, v in mine.items() if k not in data_keys}
    theirs_rest = {k: v for k, v in theirs.items() if k not in data_keys}
    mine_fn, theirs_fn = mine_rest.pop("process_docs", None), theirs_rest.pop("process_docs", None)
    assert mine_rest == theirs_rest
    assert (mine_fn is None) == (theirs_fn is None)
    if theirs_fn is not None:  # HellaSwag: upstream's own preprocessing function
        assert inspect.getsource(mine_fn) == inspect.getsource(theirs_fn)
    assert mine["task"] == theirs["task"] + "_local"
    assert callable(mine["custom_dataset"])


def test_fixtures_follow_upstream_schemas():
    schemas = {
        "lambada_openai.jsonl": {"text"},
        "piqa.jsonl": {"goal", "sol1", "sol2", "label"},
        "piqa.train.jsonl": {"goal", "sol1", "sol2", "label"},
        "hellaswag.jsonl": {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split",
                            "split_type", "label"},
        "hellaswag.train.jsonl": {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id",
                                  "split", "split_type", "label"},
        "dcformer_gen.jsonl": {"question", "answer"},
    }
    for name, keys in schemas.items():
        rows = local_data.read_jsonl(FIXTURES / name)
        assert all(set(row) == keys for row in rows), name
    assert len(local_data.read_jsonl(FIXTURES / "lambada_openai.jsonl")) >= 30
    for row in local_data.read_jsonl(FIXTURES / "hellaswag.jsonl"):
        assert len(row["endings"]) == 4 and row["label"] in {"0", "1", "2", "3"}
        assert row["ctx"] == (row["ctx_a"] + " " + row["ctx_b"]).strip()


def test_data_dir_from_argument_environment_or_default(tmp_path, monkeypatch, tiny):
    rows = local_data.read_jsonl(FIXTURES / "piqa.jsonl")[:3]
    data = tmp_path / "data"
    data.mkdir()
    (data / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def count(**kwargs):
        return len(local_data.load_local("piqa", "validation", "train", **kwargs)["validation"])

    assert count() == 30  # evals/fixtures
    assert count(data_dir=data) == 3
    assert len(local_data.load_local("piqa", "validation", "train", data_dir=data)["train"]) == 0  # no train file
    monkeypatch.setenv(local_data.ENV_VAR, str(data))
    assert count() == 3
    assert count(data_dir=FIXTURES) == 30  # the argument wins
    monkeypatch.delenv(local_data.ENV_VAR)
    with pytest.raises(FileNotFoundError, match="lambada_openai.jsonl"):
        local_data.load_local("lambada_openai", "test", data_dir=data)

    model, tok, _ = tiny  # end to end: evaluate(data_dir=...) reaches the loader through the task metadata
    results = harness.evaluate(model, tok, ["piqa_local"], batch_size=4, data_dir=data)
    assert results["n-samples"]["piqa_local"]["effective"] == 3


# ----------------------------------------------------------------------------------------------------------------
# Python entry point, batch sizes, the command line, dcformer vs hf
# ----------------------------------------------------------------------------------------------------------------
def test_local_tasks_produce_metrics(results_bs1):
    res = results_bs1["results"]
    assert set(res) == set(LOCAL_TASKS)
    for task in LOCAL_TASKS:
        assert results_bs1["n-samples"][task]["effective"] == FIXTURE_ROWS[task]
        assert 0.0 <= res[task]["acc,none"] <= 1.0
        assert "acc_stderr,none" in res[task]
    for task in ("piqa_local", "hellaswag_local"):
        assert 0.0 <= res[task]["acc_norm,none"] <= 1.0
    perplexity = res["lambada_openai_local"]["perplexity,none"]
    assert math.isfinite(perplexity) and perplexity > 1.0
    assert results_bs1["model_name"]


def test_batch_size_does_not_change_results(tiny, results_bs1):
    """Batch 8: lm-eval right-pads the loglikelihood batches (no attention mask); the numbers stay the same."""
    model, tok, _ = tiny
    results_bs8 = harness.evaluate(model, tok, LOCAL_TASKS, batch_size=8)
    assert_same_numbers(results_bs1, results_bs8, rel=1e-5)


def test_cli_dcformer_and_hf_give_identical_numbers(tiny, results_bs1, tmp_path):
    """`python -m modeling_dcformer.evals.harness run --model dcformer ...` (what `dcformer-eval` runs) in a subprocess (from another directory) and
    `--model hf` through the same command line in-process, on the saved checkpoint: the same numbers, and the
    same as the in-memory model through the Python entry point."""
    _, _, path = tiny
    common = ["--tasks", ",".join(LOCAL_TASKS), "--batch_size", "8", "--device", "cpu"]
    out_dc, out_hf = tmp_path / "dcformer", tmp_path / "hf"
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "modeling_dcformer.evals.harness", "run", "--model", "dcformer",
         "--model_args", f"pretrained={path},dtype=float32", *common, "--output_path", str(out_dc)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lambada_openai_local" in proc.stdout
    via_dcformer = latest_results(out_dc)
    assert via_dcformer["config"]["model"] == "dcformer"

    assert harness.main(["run", "--model", "hf", "--model_args", f"pretrained={path},dtype=float32", *common,
                         "--output_path", str(out_hf)]) == 0
    via_hf = latest_results(out_hf)
    assert via_hf["config"]["model"] == "hf"

    assert_same_numbers(via_dcformer, via_hf)  # the very same computation
    assert_same_numbers(via_dcformer, results_bs1, rel=1e-5)


def test_hf_on_gpt_neox_matches_dcformer_on_its_conversion(tokenizer, tmp_path):
    """`--model hf` on a (tiny) Pythia-style GPT-NeoX, `--model dcformer` on its DCPythia conversion (which
    computes the same function): the same accuracies, perplexity within the conversion's tolerance."""
    convert = pytest.importorskip("modeling_dcformer.conversion.pythia").convert
    torch.manual_seed(0)
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
    )).eval()
    with torch.no_grad():
        for name, p in neox.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else 1.5 / p.shape[1] ** 0.5)
    src, dst = tmp_path / "neox", tmp_path / "dcpythia"
    neox.save_pretrained(src)
    tokenizer.save_pretrained(src)
    convert(str(src), str(dst))

    plain = harness.evaluate(src, None, LOCAL_TASKS, batch_size=8, limit=12, lm_class="hf", device="cpu")
    converted = harness.evaluate(dst, None, LOCAL_TASKS, batch_size=8, limit=12, device="cpu")
    assert type(AutoModelForCausalLM.from_pretrained(dst)).__name__ == "DCFormerForCausalLM"
    for task in LOCAL_TASKS:
        a, b = plain["results"][task], converted["results"][task]
        assert a["acc,none"] == b["acc,none"], task
    ppl_a = plain["results"]["lambada_openai_local"]["perplexity,none"]
    ppl_b = converted["results"]["lambada_openai_local"]["perplexity,none"]
    assert ppl_b == pytest.approx(ppl_a, rel=1e-3)


def test_dcformer_model_loads_the_released_layout(tokenizer, tmp_path):
    """A checkpoint in the authors' layout (model_type "dcpythia", their tensor names, an auto_map to remote
    code that does not exist) loads through `--model dcformer` without trust_remote_code."""
    released = pytest.importorskip("released_checkpoint")
    cfg = released.released_config("dcpythia", vocab_size=len(tokenizer), block_size=512, window_size=8)
    state = released.released_state_dict(cfg, seed=0)
    path = released.write_released_checkpoint(tmp_path / "released", cfg, state, tokenizer=False)
    tokenizer.save_pretrained(path)

    lm = DCFormerLM(pretrained=str(path), device="cpu", batch_size=4)
    assert isinstance(lm.model, DCFormerForCausalLM)
    results = harness.evaluate(lm, None, ["lambada_openai_local"], limit=6)
    assert math.isfinite(results["results"]["lambada_openai_local"]["perplexity,none"])


def test_generate_until_left_padded_batches(tiny):
    """A generate_until task through generate(): left-padded batches of 5 give exactly the generations of
    batch 1, and the model trained on the fixture answers (exact match)."""
    model, tok, _ = tiny
    runs = {}
    for batch_size in (1, 5):
        results = harness.evaluate(model, tok, ["dcformer_gen_local"], batch_size=batch_size, log_samples=True)
        samples = sorted(results["samples"]["dcformer_gen_local"], key=lambda s: s["doc_id"])
        runs[batch_size] = (results["results"]["dcformer_gen_local"], [s["filtered_resps"] for s in samples])
    assert runs[1][1] == runs[5][1]
    assert len(runs[1][1]) == 12
    assert runs[1][0]["exact_match,strip"] == runs[5][0]["exact_match,strip"] >= 0.5


# ----------------------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------------------
def test_report_renders_table_and_chart(results_bs1, tmp_path, capsys):
    ours = harness.save_results(results_bs1, tmp_path / "runs" / "tiny")
    other = dict(results_bs1, model_name="other-model")
    harness.save_results(other, tmp_path / "runs" / "other" / "results_x.json")
    published = tmp_path / "published.yaml"
    published.write_text(
        "models:\n"
        "  - name: Reference-6.9B\n"
        "    source: numbers made up for this test\n"
        "    results:\n"
        "      lambada_openai: {acc: 55.0, perplexity: {value: 6.5, stderr: 0.2}}\n"
        "      piqa: {acc: 0.7, acc_norm: null}\n"
        "      hellaswag: {acc_norm: 0.5}\n"
    )
    prefix = tmp_path / "out" / "report"
    assert report.main([f"tiny-dc={ours}", str(tmp_path / "runs" / "other"), "--published", str(published),
                        "-o", str(prefix)]) == 0
    text = Path(f"{prefix}.md").read_text()
    assert text in capsys.readouterr().out
    header = text.splitlines()[0]
    for column in ("lambada_openai_local acc", "lambada_openai_local perplexity", "piqa_local acc_norm",
                   "hellaswag_local acc"):
        assert column in header
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    acc = results_bs1["results"]["piqa_local"]["acc,none"]
    stderr = results_bs1["results"]["piqa_local"]["acc_stderr,none"]
    assert f"{acc:.4f} ± {stderr:.4f}" in lines["tiny-dc"]
    assert "other-model" in lines
    published_row = lines["*Reference-6.9B [1]*"]
    assert "0.5500" in published_row and "6.500 ± 0.200" in published_row and "0.7000" in published_row
    assert "numbers made up for this test" in text
    assert Path(f"{prefix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The shipped file parses; its values are left for the user to fill in (no invented numbers).
    shipped = report.load_published(ROOT / "evals" / "published.yaml")
    assert {row.label for row in shipped} >= {"DCPythia-6.9B (paper)", "Pythia-6.9B (paper)"}
    assert all(not row.values for row in shipped)
    text, chart = report.build_report([str(ours)], ROOT / "evals" / "published.yaml", output=None)
    assert "fill them in" in text and chart is None
