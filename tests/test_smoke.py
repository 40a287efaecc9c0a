import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import modeling_dcformer
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM, DCFormerModel


def test_auto_registration():
    cfg = DCFormerConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    assert isinstance(AutoConfig.for_model("dcformer"), DCFormerConfig)
    assert isinstance(AutoModel.from_config(cfg), DCFormerModel)
    model = AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, DCFormerForCausalLM)
    ids = torch.randint(0, 50, (2, 7))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 7, 50)
    assert torch.isfinite(out.loss)
    assert modeling_dcformer.__version__
