"""dcformer_research.lm_corpus and `compare_small.py --task lm`:
the corpus split is by document and deterministic, missing
or unusable corpora are clear errors, tokenisation is deterministic (bytes checked against Python's own UTF-8, the
BPE trained on the training documents only), the training blocks cover the stream; the ablation variants compute
what they claim (checked against tests/oracle.py); 10-step smoke runs of the lm mode, the lr sweep and the
ablation write their tables. Corpora are temporary text files made from the shipped examples/data fixture."""

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import as_double, build_model, make_config, zero_dyn
from modeling_dcformer import DCFormerForCausalLM
from dcformer_research import ablation, lm_corpus
from dcformer_research import compare as compare_small  # examples/compare_small.py's command line
from oracle import oracle_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "examples" / "data" / "harbour_train.txt"
RARE_WORD = "zyzzyvaquokkaxylophone"


def write_corpus(folder: Path, n_docs: int = 12, lines_per_doc: int = 20) -> list[Path]:
    """n_docs text files cut from the shipped fixture (some in a subfolder)."""
    lines = FIXTURE.read_text(encoding="utf-8").splitlines()
    paths = []
    for i in range(n_docs):
        path = folder / ("part" if i % 3 == 0 else ".") / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        chunk = lines[(i * lines_per_doc) % len(lines) :][:lines_per_doc]
        path.write_text("\n".join(chunk) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def expected_validation(names: list[str], fraction: float) -> set[str]:
    """The spec of the split, written out: the round(fraction * n) names with the lowest SHA-256 go to validation."""
    n_val = min(len(names) - 1, max(1, round(fraction * len(names))))
    return set(sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())[:n_val])


def test_split_is_by_document_and_deterministic(tmp_path):
    paths = write_corpus(tmp_path / "c")
    docs = lm_corpus.find_documents([tmp_path / "c"])
    names = [d.name for d in docs]
    assert names == sorted(names) and len(names) == 12
    assert "part/doc00.txt" in names and "doc01.txt" in names  # names are paths relative to the folder
    train, val = lm_corpus.split_documents(docs, 0.25)
    assert {d.name for d in val} == expected_validation(names, 0.25) and len(val) == 3
    assert {d.name for d in train} | {d.name for d in val} == set(names) and not {d.name for d in train} & {
        d.name for d in val
    }
    # the same split whatever the listing order, and whatever the contents
    again = lm_corpus.split_documents(list(reversed(docs)), 0.25)
    assert [d.name for d in again[1]] == [d.name for d in val]
    paths[0].write_text("completely different text\n")
    assert [d.name for d in lm_corpus.split_documents(lm_corpus.find_documents([tmp_path / "c"]), 0.25)[1]] == [
        d.name for d in val
    ]
    # files given one by one are documents named by their file name
    single = lm_corpus.find_documents([p for p in paths if p.parent.name != "part"])
    assert [d.name for d in single] == sorted(p.name for p in paths if p.parent.name != "part")


def test_bad_corpora_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no-such-dir.*does not exist"):
        lm_corpus.find_documents([tmp_path / "no-such-dir"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .txt"):
        lm_corpus.find_documents([tmp_path / "empty"])
    one = write_corpus(tmp_path / "one", n_docs=1)
    with pytest.raises(ValueError, match="at least 2"):
        lm_corpus.load_corpus(one)
    with pytest.raises(ValueError, match="between 0 and 1"):
        lm_corpus.split_documents(lm_corpus.find_documents(write_corpus(tmp_path / "two", n_docs=2)), 1.5)
    monkeypatch.setattr(lm_corpus, "default_corpus", lambda: None)
    with pytest.raises(FileNotFoundError, match="apt-get install python3.11-doc"):
        lm_corpus.find_documents(None)
    with pytest.raises(SystemExit, match="does not exist"):
        compare_small.main(["--task", "lm", "--corpus", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")])


def test_byte_tokenisation_is_utf8_and_deterministic(tmp_path):
    tok = lm_corpus.ByteTokenizer()
    text = "Ünïcode → bytes: naïve café, 東京\n"
    assert tok.encode(text) == [b + 1 for b in text.encode("utf-8")]
    assert tok.decode(tok.encode(text)) == text and 0 not in tok.encode(text)
    paths = write_corpus(tmp_path / "c")
    a = lm_corpus.load_corpus([tmp_path / "c"], "byte", val_fraction=0.25)
    b = lm_corpus.load_corpus([tmp_path / "c"], "byte", val_fraction=0.25)
    assert np.array_equal(a.train_ids, b.train_ids) and np.array_equal(a.val_ids, b.val_ids)
    assert a.fingerprint() == b.fingerprint()
    files = [p for p in paths if p.parent.name != "part"]
    in_order = lm_corpus.load_corpus(files, "byte", val_fraction=0.25)
    reordered = lm_corpus.load_corpus(list(reversed(files)), "byte", val_fraction=0.25)  # same files, other order
    assert in_order.fingerprint() == reordered.fingerprint() != a.fingerprint()
    # each stream is its documents in name order, each followed by id 0
    expected = []
    for doc in a.val_documents:
        expected += [x + 1 for x in doc.path.read_bytes()] + [0]
    assert a.val_ids.tolist() == expected
    assert a.val_bytes == sum(len(d.path.read_bytes()) for d in a.val_documents)


def test_bpe_is_deterministic_and_trained_on_the_training_documents_only(tmp_path):
    paths = write_corpus(tmp_path / "c")
    names = [d.name for d in lm_corpus.find_documents([tmp_path / "c"])]
    held_out = expected_validation(names, 0.25)
    for path in paths:  # a word that only the validation documents contain, many times
        name = path.relative_to(tmp_path / "c").as_posix()
        if name in held_out:
            path.write_text(path.read_text() + (RARE_WORD + " ") * 300 + "\n")
    a = lm_corpus.load_corpus([tmp_path / "c"], "bpe", bpe_vocab=400, val_fraction=0.25)
    b = lm_corpus.load_corpus([tmp_path / "c"], "bpe", bpe_vocab=400, val_fraction=0.25)
    assert a.vocab_size == b.vocab_size <= 400
    assert np.array_equal(a.train_ids, b.train_ids) and np.array_equal(a.val_ids, b.val_ids)
    assert a.tokenizer.tokenizer.get_vocab() == b.tokenizer.tokenizer.get_vocab()
    assert not any("zyzzy" in t or "quokka" in t for t in a.tokenizer.tokenizer.get_vocab())
    text = FIXTURE.read_text()[:2000]
    ids = a.tokenizer.encode(text)
    assert a.tokenizer.decode(ids) == text
    # bytes per token, used for bits per byte: they add up to the text's UTF-8 length
    assert int(a.tokenizer.bytes_per_token()[ids].sum()) == len(text.encode("utf-8"))


def test_blocks_cover_the_stream_in_a_seeded_order():
    ids = np.arange(1000)
    train = lm_corpus.BlockDataset(ids, 32, 70, seed=5)
    assert train.num_blocks == 31
    starts = [train[i]["input_ids"][0] for i in range(70)]
    assert all(s % 32 == 0 for s in starts)
    assert sorted(starts[:31]) == list(range(0, 31 * 32, 32)) == sorted(starts[31:62])  # each pass: every block once
    assert starts[:31] != starts[31:62]  # a fresh order each pass
    block = list(range(starts[3], starts[3] + 32))
    assert train[3] == {"input_ids": block, "labels": block}
    assert [lm_corpus.BlockDataset(ids, 32, 70, seed=5)[i] for i in range(70)] == [train[i] for i in range(70)]
    assert [lm_corpus.BlockDataset(ids, 32, 31, seed=6)[i] for i in range(31)] != [train[i] for i in range(31)]
    val = lm_corpus.BlockDataset(ids, 32, 4)
    assert [val[i]["input_ids"][0] for i in range(4)] == [0, 10 * 32, 20 * 32, 30 * 32]  # spread, in order
    with pytest.raises(ValueError, match="shorter than one block"):
        lm_corpus.BlockDataset(ids[:10], 32, 1)
    with pytest.raises(ValueError, match="validation blocks"):
        lm_corpus.BlockDataset(ids, 32, 40)


# ----------------------------------------------------------------------------------------------------------------
# The ablation variants against the oracle


def test_pre_and_post_ablations_zero_the_other_slots_and_keep_them_zero():
    config = make_config(num_hidden_layers=2)
    M = config.heads_per_group
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    for kind, off in (("pre", (2, 3)), ("post", (0, 1))):  # spec slot order: pre-q, pre-k, post-q, post-k
        model = build_model(config)
        reference = as_double(model.state_dict())
        ablation.freeze_slots(model, ablation.FROZEN_SLOTS[kind])
        for key, value in reference.items():
            if key.endswith("dyn_w_proj.qkw"):
                value[:, list(off)] = 0
            elif key.endswith("dyn_w_proj.dd"):
                for slot in off:
                    value[:, :, slot * M : (slot + 1) * M] = 0
        with torch.no_grad():
            logits = model(ids).logits
        torch.testing.assert_close(logits.double(), oracle_causal_lm(reference, config, ids), atol=1e-5, rtol=1e-5)
        # a few AdamW steps with weight decay: the frozen slots stay exactly zero, the others train
        model.train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        for name, p in model.named_parameters():
            if name.endswith("dyn_w_proj.qkw"):
                assert p[:, list(off)].abs().max() == 0 and not torch.equal(p, before[name]), name
            if name.endswith("dyn_w_proj.dd"):
                frozen = torch.cat([p[:, :, s * M : (s + 1) * M] for s in off], dim=-1)
                assert frozen.abs().max() == 0 and not torch.equal(p, before[name]), name


def test_static_ablation_starts_as_plain_attention_and_ignores_the_input():
    config = ablation.variant_config("static", make_config(num_hidden_layers=2))
    assert config.dynamic_rank == config.heads_per_group  # full rank: any static M x M composition
    torch.manual_seed(0)
    model, n_params = ablation.build_model("static", config)
    model.eval()
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    state = as_double(model.state_dict())
    oracle_state = zero_dyn(as_double(DCFormerForCausalLM(config).state_dict()))
    oracle_state.update({k: v for k, v in state.items() if "dyn_w_proj" not in k})
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits.double(), oracle_causal_lm(oracle_state, config, ids), atol=1e-5, rtol=1e-5)
    static = model.model.layers[0].self_attn.dyn_w_proj
    with torch.no_grad():
        static.w2.normal_()
        a, b = static(torch.randn(1, 3, config.hidden_size)), static(torch.randn(1, 3, config.hidden_size))
    assert torch.equal(a, b) and torch.equal(a[0, 0], a[0, 2])  # the same terms for every input and position
    assert n_params == sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------------------
# Smoke runs: 10 steps of each mode


def smoke_argv(tmp_path, *extra):
    write_corpus(tmp_path / "corpus")
    return [
        "--task", "lm", "--corpus", str(tmp_path / "corpus"), "--tokenizer", "byte", "--val-fraction", "0.25",
        "--block-size", "32", "--steps", "10", "--eval-every", "5", "--warmup", "1", "--batch-size", "4",
        "--val-size", "4", "--hidden", "32", "--layers", "1", "--heads", "2", "--quiet", *extra,
    ]  # fmt: skip


def test_lm_smoke_run(tmp_path):
    out = tmp_path / "lm"
    report = compare_small.main(smoke_argv(tmp_path, "--seeds", "2", "--out", str(out)))
    data = json.loads((out / "results.json").read_text())
    assert [(r["model"], r["seed"]) for r in data["runs"]] == [
        ("transformer", 0), ("dcformer", 0), ("transformer", 1), ("dcformer", 1)
    ]  # fmt: skip
    bytes_per_token = data["setup"]["bytes_per_predicted_token"]
    for run in data["runs"]:
        assert [s for s, _ in run["curves"]["lm_loss"]] == [0, 5, 10]
        curves = [run["curves"][f"lm_{m}"] for m in ("loss", "perplexity", "bits_per_byte")]
        for (_, loss), (_, ppl), (_, bpb) in zip(*curves):
            assert ppl == pytest.approx(math.exp(loss)) and bpb == pytest.approx(loss / math.log(2) / bytes_per_token)
        assert run["curves"]["lm_loss"][0][1] == pytest.approx(math.log(257), rel=0.1)  # near uniform at the start
        assert run["curves"]["lm_loss"][-1][1] < run["curves"]["lm_loss"][0][1]  # it learns
        assert run["tokens_per_second"] > 0 and run["lr"] == 3e-3
    dc = [r for r in data["runs"] if r["model"] == "dcformer"]
    assert all([e["step"] for e in r["dyn_norms"]] == [0, 5, 10] for r in dc)
    assert all(set(e["w2"]) == {"pre_q", "pre_k", "post_q", "post_k"} for e in dc[0]["dyn_norms"])
    assert abs(data["parameters"]["relative_difference"]) <= 0.02
    assert data["setup"]["corpus"]["tokenizer"] == "byte" and data["setup"]["corpus"]["val_documents"] == 3
    table = (out / "results.md").read_text()
    assert "language modelling on real text" in table and "| Transformer (GPT-NeoX) | " in table
    assert "perplexity" in table and "w2 pre_q" in table
    for name in ("curves.png", "dyn_norms.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["aggregate"]["models"]["dcformer"]["lm"]["loss"]["n"] == 2
    (out / "results.md").unlink()
    assert compare_small.main(["--report-only", "--out", str(out)])["aggregate"] == data["aggregate"]
    assert (out / "results.md").read_text() == table


def test_lr_sweep_smoke_run_picks_each_models_best_rate(tmp_path):
    out = tmp_path / "sweep"
    compare_small.main(smoke_argv(tmp_path, "--lr-sweep", "1e-4,3e-2", "--seeds", "2", "--out", str(out)))
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 2 * 2 + 2  # both rates with seed 0, then seed 1 at the chosen rate
    for kind in ("transformer", "dcformer"):
        sweep = {r["lr"]: r["final"]["lm_loss"] for r in data["runs"] if r["model"] == kind and r["seed"] == 0}
        best = min(sweep, key=sweep.get)
        assert data["chosen_lr"][kind] == best
        assert [r["lr"] for r in data["runs"] if r["model"] == kind and r["seed"] == 1] == [best]
        assert data["aggregate"]["models"][kind]["lr"] == best and data["aggregate"]["models"][kind]["seeds"] == [0, 1]
    assert "Learning-rate sweep" in (out / "results.md").read_text()


def test_ablation_smoke_run(tmp_path):
    out = tmp_path / "ablation"
    compare_small.main(smoke_argv(tmp_path, "--ablation", "--seeds", "1", "--out", str(out)))
    data = json.loads((out / "results.json").read_text())
    runs = {r["model"]: r for r in data["runs"]}
    assert list(runs) == list(ablation.MODELS)
    last = {kind: runs[kind]["dyn_norms"][-1] for kind in ablation.DC_MODELS}
    pre, post = ("pre_q", "pre_k"), ("post_q", "post_k")
    for kind, off, on in (("pre", post, pre), ("post", pre, post)):
        assert all(last[kind][part][s] == 0 for part in ("w2", "dd") for s in off)
        assert all(last[kind]["w2"][s] > 0 for s in on)
    assert set(last["query-wise"]["w2"]) == {"pre_q", "post_q"}
    assert runs["static"]["dyn_norms"][0]["w2"]["pre_q"] == 0 < last["static"]["w2"]["pre_q"]  # starts at identity
    assert runs["query-wise"]["parameters"] < runs["dcformer"]["parameters"]
    assert runs["pre"]["parameters"] < runs["dcformer"]["parameters"]  # the frozen half is not counted
    table = (out / "results.md").read_text()
    for kind in ablation.MODELS:
        assert f"| {ablation.LABELS[kind]} | " in table
