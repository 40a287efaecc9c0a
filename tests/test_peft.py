"""PEFT LoRA on DCFormer: `LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear")` (or
`modeling_dcformer.LORA_TARGET_MODULES`) adapts the attention's and the MLP's linear layers; peft's own table of
defaults is left alone (importing the package patches no other library), so naming no targets is peft's error; a
few optimizer steps change the output; `merge_and_unload` gives W + (alpha / r) B A, computed here by hand, and
the merged model saves and reloads to the same logits, which match the oracle run on the hand-merged weights. The
DCMHA composition weights (`dyn_w_proj`) stay frozen, or train in full through `modules_to_save`."""

import pytest
import torch
from transformers import AutoModelForCausalLM

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

import modeling_dcformer  # noqa: E402
from helpers import MARGIN, VOCAB, as_double, assert_close, build_model, make_config, max_diff  # noqa: E402
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM, DCPythiaConfig  # noqa: E402
from oracle import oracle_causal_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

LAYERS = 2
GATED_BODY = dict(norm_type="rmsnorm", use_gated_mlp=True, hidden_act="silu", use_parallel_residual=False,
                  attention_bias=False, mlp_bias=False)
BODIES = {  # config class, overrides, the MLP's linear layers
    "dcpythia-body": (DCFormerConfig, {}, ("up_proj", "down_proj")),
    "dcformer++-body": (DCFormerConfig, GATED_BODY, ("gate_proj", "up_proj", "down_proj")),
    "dcpythia-model-type": (DCPythiaConfig, {}, ("up_proj", "down_proj")),
}


def tiny(config_class=DCFormerConfig, seed: int = 0, **overrides) -> DCFormerForCausalLM:
    kwargs = make_config(num_hidden_layers=LAYERS, **overrides).to_diff_dict()
    kwargs.pop("model_type", None)
    return build_model(config_class(**kwargs), seed=seed)


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def logits_of(model, ids):
    return model(input_ids=ids).logits


@pytest.mark.parametrize("body", list(BODIES))
def test_default_lora_targets_are_the_attention_and_mlp_projections(body):
    config_class, overrides, mlp = BODIES[body]
    expected = {
        f"base_model.model.model.layers.{i}.{name}"
        for i in range(LAYERS)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", *(f"mlp.{m}" for m in mlp))
    }
    for target_modules in ("all-linear", modeling_dcformer.LORA_TARGET_MODULES):  # the recipe, and our list
        model = tiny(config_class, **overrides)
        assert model.config.model_type == ("dcpythia" if config_class is DCPythiaConfig else "dcformer")
        lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=target_modules))
        adapted = {name for name, module in lora.named_modules() if isinstance(module, LoraLayer)}
        assert adapted == expected, (target_modules, sorted(adapted ^ expected))
        frozen = [name for name, p in lora.named_parameters() if "dyn_w_proj" in name and p.requires_grad]
        assert not frozen  # no nn.Linear there: LoRA cannot wrap the composition weights
    assert set(modeling_dcformer.LORA_TARGET_MODULES) == {"qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_peft_defaults_are_not_patched():
    """peft's table of default targets has no DCFormer entry (it did while `import modeling_dcformer` filled it in):
    a LoraConfig that names no targets gets peft's own error, which says to name them."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    assert "dcformer" not in defaults and "dcpythia" not in defaults
    with pytest.raises(ValueError, match="target_modules"):
        get_peft_model(tiny(), LoraConfig(task_type="CAUSAL_LM", r=4))


@pytest.mark.parametrize("modules_to_save", [None, ["dyn_w_proj"]], ids=["dyn-frozen", "dyn-trained"])
def test_lora_finetune_merge_save_and_reload(tmp_path, modules_to_save):
    rank, alpha = 4, 8
    model = tiny()
    base = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    ids = input_ids()
    before = logits_of(model, ids)
    config = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, target_modules="all-linear",
                        modules_to_save=modules_to_save)
    lora = get_peft_model(model, config)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    lora.train()
    for _ in range(3):
        lora(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    lora.eval()
    tuned = logits_of(lora, ids)
    assert max_diff(tuned, before) > MARGIN

    # the merged weights, by hand: W + (alpha / r) B A for each adapted layer; dyn_w_proj the trained copy or frozen
    expected = dict(base)
    for name, module in lora.named_modules():
        if isinstance(module, LoraLayer):
            key = name.removeprefix("base_model.model.") + ".weight"
            lora_a, lora_b = module.lora_A["default"].weight, module.lora_B["default"].weight
            expected[key] = base[key] + (alpha / rank) * (lora_b @ lora_a).detach()
    dyn = {name: p.detach().clone() for name, p in lora.named_parameters() if "dyn_w_proj" in name}
    if modules_to_save:
        trained = {n.replace("modules_to_save.default.", ""): p for n, p in dyn.items() if "modules_to_save" in n}
        trained = {n.removeprefix("base_model.model."): p for n, p in trained.items()}
        assert len(trained) == 3 * LAYERS
        assert all(max_diff(p, base[n]) > 0 for n, p in trained.items())  # trained in full
        expected.update(trained)
    else:
        assert all(torch.equal(p, base[n.removeprefix("base_model.model.")]) for n, p in dyn.items())  # frozen

    merged = lora.merge_and_unload()
    assert type(merged) is DCFormerForCausalLM
    state = merged.state_dict()
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert_close(state[key], tensor)
    merged_logits = logits_of(merged, ids)
    assert_close(merged_logits, tuned, atol=1e-4, rtol=1e-4)  # merging keeps the adapted function

    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(reloaded) is DCFormerForCausalLM
    reloaded_logits = logits_of(reloaded, ids)
    assert torch.equal(reloaded_logits, merged_logits)
    assert_close(reloaded_logits, oracle_causal_lm(as_double(expected), reloaded.config, ids), atol=1e-4, rtol=1e-4)
