"""`dcformer-convert-pythia --dtype bf16|fp16 --verify`: the check compares the source with the
converted weights in fp32 before the cast (where the conversion is exact), says so, and then casts; the saved
checkpoint is the source rounded to the requested dtype (checked against the oracle and GPT-NeoX on the rounded
source weights), bit for bit what the same conversion without verification writes."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPTNeoXForCausalLM

from helpers import as_double, save_tiny_neox
from modeling_dcformer import DCFormerConfig
from modeling_dcformer.conversion import pythia as p2d
from oracle import oracle_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16"}


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    path = tmp_path_factory.mktemp("neox") / "src"
    save_tiny_neox(path, seed=0)
    return path


def saved_state(directory) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def saved_dtypes(directory) -> set[str]:
    dtypes = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            dtypes |= {f.get_slice(key).get_dtype() for key in f.keys()}
    return dtypes


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_verified_in_fp32_before_casting(name, dtype, neox, tmp_path, capsys):
    dst = tmp_path / "dst"
    code = p2d.main([str(neox), str(dst), "--dtype", name, "--verify", "--max-shard-size", "40KB"])
    out, err = capsys.readouterr()
    assert code == 0, err
    dtype_name = str(dtype).removeprefix("torch.")
    assert f"(fp32, before casting to {dtype_name})" in out and ": OK" in out
    assert f"after casting to {dtype_name}" in out and "not checked" in out

    # The output holds the cast weights only, sharded as asked, with no left-over of the uncast copy.
    assert saved_dtypes(dst) == {SAFETENSORS_DTYPE[dtype]}
    assert (dst / "model.safetensors.index.json").is_file() and len(list(dst.glob("*.safetensors"))) > 1
    assert not (dst / "uncast").exists() and not list(dst.glob("*.tmp"))
    config = json.loads((dst / "config.json").read_text())
    assert config["dtype"] == dtype_name
    conversion = config["conversion"]
    assert conversion["verified_in"] == f"fp32, before casting to {dtype_name}"
    assert conversion["max_logit_difference"] <= 1e-4
    assert conversion["max_logit_difference_after_cast"] > 1e-4  # the rounding is real: why fp32 is compared

    # Independent check: the oracle on the saved weights = GPT-NeoX on the source weights rounded to `dtype`.
    source = GPTNeoXForCausalLM.from_pretrained(neox, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(p.to(dtype).float())
    source = source.double()
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = source(ids, use_cache=False).logits[0]
    state = as_double(saved_state(dst))
    got = oracle_causal_lm(state, DCFormerConfig.from_pretrained(dst), ids)[0]
    # (GPT-NeoX computes its rotary angles in fp32: ~1e-7 apart; the rounding itself moves the logits by ~1e-2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_same_weights_with_and_without_verification(neox, tmp_path, capsys):
    """Verifying before the cast writes exactly what the unverified conversion writes (new tensors included)."""
    assert p2d.main([str(neox), str(tmp_path / "checked"), "--dtype", "bf16", "--verify"]) == 0
    assert p2d.main([str(neox), str(tmp_path / "unchecked"), "--dtype", "bf16", "--no-verify"]) == 0
    capsys.readouterr()
    checked, unchecked = saved_state(tmp_path / "checked"), saved_state(tmp_path / "unchecked")
    assert sorted(checked) == sorted(unchecked)
    for key, tensor in unchecked.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(checked[key], tensor), key


def test_a_wrong_conversion_still_fails_before_casting(neox, tmp_path, capsys, monkeypatch):
    """The fp32 check is not weakened by the cast: a wrong q/k/v layout fails it, names what was compared, and
    writes nothing."""
    monkeypatch.setattr(p2d, "regroup_qkv", lambda tensor, num_heads: tensor)
    code = p2d.main([str(neox), str(tmp_path / "dst"), "--dtype", "bf16", "--verify"])
    out, err = capsys.readouterr()
    assert code == 2 and "(fp32, before casting to bfloat16)" in out and "FAILED" in out, out + err
    assert not (tmp_path / "dst").exists()
