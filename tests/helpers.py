"""Helpers shared by the test modules (no test module imports another): tiny models whose every parameter
matters, comparisons, and the common checks of a DCMHA implementation against the oracle (`oracle.py`)."""

import contextlib
import fnmatch
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from huggingface_hub import HfApi
from huggingface_hub.errors import LocalEntryNotFoundError

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from oracle import oracle_causal_lm, oracle_local_layers

ATOL = 1e-5
RTOL = 1e-5
MARGIN = 0.05  # a variant of the computation must move the output by more than this to count as "detected"
VOCAB, T_SEQ, BATCH, WINDOW = 64, 11, 2, 4
ROOT = Path(__file__).resolve().parent.parent



def make_config(**overrides) -> DCFormerConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        partial_rotary_factor=0.5,  # 4 rotary dims of 8: tells "rotate half" from interleaved pairs
        rope_theta=1000.0,
    )
    kwargs.update(overrides)
    return DCFormerConfig(**kwargs)


def randomize_(model: torch.nn.Module, seed: int = 0, qkw_scale: float = 0.5) -> None:
    """Every parameter re-drawn so that each term of the computation is O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("dyn_w_proj.dw1"):  # [D, G, C, K]: pre-activations ~ N(0, 1)
                p.copy_(r / math.sqrt(p.shape[0]))
            elif name.endswith("dyn_w_proj.qkw"):  # [G, C, K, 2I, M]: w2 entries ~ 0.3
                p.copy_(qkw_scale * r / math.sqrt(p.shape[2]))
            elif name.endswith("dyn_w_proj.dd"):  # [D, G, C*M]: tanh arguments ~ N(0, 1)
                p.copy_(r / math.sqrt(p.shape[0]))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(r)
            else:  # Linear [out, in]
                p.copy_(r / math.sqrt(p.shape[1]))


def build_model(config: DCFormerConfig, seed: int = 0) -> DCFormerForCausalLM:
    torch.manual_seed(seed)
    model = DCFormerForCausalLM(config).eval()
    randomize_(model, seed)
    return model


def as_double(state: dict) -> dict:
    return {k: v.detach().double() for k, v in state.items()}


def zero_dyn(params: dict) -> dict:
    return {k: torch.zeros_like(v) if "dyn_w_proj" in k else v for k, v in params.items()}


def capture_attention_io(model: DCFormerForCausalLM, input_ids: torch.Tensor):
    """Runs the model and returns, per layer, (attention input, attention output) as seen in the real forward."""
    io = {}
    handles = []
    for idx, layer in enumerate(model.model.layers):

        def hook(module, args, kwargs, output, idx=idx):
            hidden = args[0] if args else kwargs["hidden_states"]
            io[idx] = (hidden.detach().clone(), output[0].detach().clone())

        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return logits, io


def call_attention(model, layer_idx: int, x: torch.Tensor):
    """Calls one attention module directly on x [B, T, D] (token positions 0..T-1)."""
    B, T, _ = x.shape
    position_embeddings = model.model.rotary_emb(x, torch.arange(T).unsqueeze(0).expand(B, T))
    out, _ = model.model.layers[layer_idx].self_attn(
        x, position_embeddings=position_embeddings, query_start=0
    )
    return out


def assert_close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def assert_close_to_scale(actual, expected, rel=1e-5):
    """`actual` equals `expected` within `rel` of expected's largest magnitude (and `rel` of each value): the
    comparison for float32 gradients that are sums of many terms, whose rounding scales with the tensor's largest
    values, not with each element (an element that cancels to 0.3 among values of 100 carries their rounding)."""
    expected = expected.double()
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual.double(), expected, atol=rel * max(scale, 1.0), rtol=rel)


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def layer_window(config, layer_idx):
    local = oracle_local_layers(config.window_size, config.window_type, config.num_hidden_layers)
    return config.window_size if local[layer_idx] else None


def padded_batch():
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (2, 13), generator=gen)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    return input_ids, mask


def loss_and_grads(model, input_ids, mask):
    model.zero_grad()
    out = model(input_ids, attention_mask=mask, use_cache=False)
    weights = torch.linspace(-1, 1, out.logits.numel(), device=out.logits.device).view_as(out.logits)
    loss = (out.logits * weights * mask[..., None]).mean()  # a mean, as in test_oracle's backward tests
    loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_rows_match_oracle(model, logits, input_ids, mask):
    """The logits of each row's real tokens against the oracle run on that row alone, without padding."""
    state = as_double(model.state_dict())
    real = mask.bool()
    for row in range(input_ids.shape[0]):
        ids = input_ids[row, real[row]][None]
        assert_close(logits[row, real[row]], oracle_causal_lm(state, model.config, ids)[0])


def assert_decoding_matches_full_forward(model):
    """Prefill of 6 tokens, then one token at a time through the cache (a local layer's cache keeps only its
    window): the logits of the full forward pass."""
    input_ids = padded_batch()[0].to(model.device)
    with torch.no_grad():
        full = model(input_ids, use_cache=False).logits
        out = model(input_ids[:, :6], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(6, input_ids.shape[1]):
            out = model(input_ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def sharpen_neox_(model: torch.nn.Module) -> torch.nn.Module:
    """Re-draw a GPT-NeoX model's weights (from torch's global generator) large enough that attention is sharp and
    the logits are O(1..10): norms near 1 with some spread, matrices at 1.5 / sqrt(fan-in), embeddings N(0, 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else 1.5 / p.shape[1] ** 0.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def save_tiny_neox(path, seed: int = 0, dtype: torch.dtype | None = None, **overrides):
    """A tiny random GPT-NeoX causal LM saved at `path` (no tokenizer), with weights large enough that the logits
    are O(1..10) and rounding the weights to bf16/fp16 moves them by far more than 1e-4. Saved in `dtype` (default
    fp32); returns the saved model in fp32."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    settings = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        rotary_pct=0.5, max_position_embeddings=160, bos_token_id=0, eos_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**settings)).eval()
    sharpen_neox_(model)
    (model if dtype is None else model.to(dtype)).save_pretrained(path)
    return model.float()


def install_fake_hub(monkeypatch, tmp_path):
    """Replace the HfApi methods that uploads (ours and Trainer's) use, for this test: record each call and a snapshot of
    each uploaded folder; `calls.hub_readme` is the README.md the Hub repo already has (None: none), and
    `calls.fail = "create_repo"` or `"upload"` makes that call fail as a network error would."""
    calls = types.SimpleNamespace(create_repo=[], upload=[], hub_readme=None, fail=None)

    def create_repo(self, repo_id, *, private=None, token=None, exist_ok=False, **kwargs):
        if calls.fail == "create_repo":
            raise ConnectionError("network is unreachable")
        calls.create_repo.append(dict(repo_id=repo_id, private=private, token=token, exist_ok=exist_ok))
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def hf_hub_download(self, repo_id, filename, **kwargs):
        if calls.hub_readme is None:
            raise LocalEntryNotFoundError(f"{repo_id} has no {filename}")
        path = tmp_path / "hub_readme.md"
        path.write_text(calls.hub_readme)
        return str(path)

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, **kwargs):
        if calls.fail == "upload":
            raise ConnectionError("network is unreachable")
        folder = Path(folder_path)
        files = sorted(
            p.name for p in folder.iterdir()
            if not any(fnmatch.fnmatch(p.name, pattern) for pattern in ignore_patterns or [])
        )
        calls.upload.append(dict(
            repo_id=repo_id, folder=folder, files=files, kwargs=kwargs,
            config=json.loads((folder / "config.json").read_text()),
            readme=(folder / "README.md").read_text() if "README.md" in files else None,
        ))
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0123abc")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "create_branch", lambda self, *a, **k: None)
    return calls


def load_example(name: str):
    """The script examples/NAME.py as a module (by its path: the examples are scripts, not an importable package),
    for tests that call its functions in-process instead of running it as a subprocess."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
    spec.loader.exec_module(module)
    return module


def train_argv(out, train_file, *extra) -> list[str]:
    """dcformer-train's arguments: a tiny DCFormer trained on `train_file` into `out` (test_faults and
    test_train_faults)."""
    return [
        "--config_name", "dcformer-tiny", "--config_overrides", "hidden_size=32,intermediate_size=64",
        "--new_tokenizer_vocab_size", "300", "--train_file", str(train_file), "--block_size", "32",
        "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--logging_steps", "1",
        "--output_dir", str(out), "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_num_workers", "0", "--do_train", "--save_strategy", "steps",
        "--cache_dir", str(Path(out).parent / "datasets-cache"), *extra,
    ]  # fmt: skip


def fake_hub_cards(monkeypatch, calls, tmp_path):
    """With `install_fake_hub`'s `calls`: the Hub's README.md as transformers' `push_to_hub` reads it
    (`ModelCard.load`, through huggingface_hub's `hf_hub_download` function): `calls.hub_readme`, or none."""
    import huggingface_hub.repocard as repocard
    from huggingface_hub.errors import LocalEntryNotFoundError

    def hf_hub_download(repo_id, filename, **kwargs):
        if calls.hub_readme is None:
            raise LocalEntryNotFoundError(f"{repo_id} has no {filename}")
        path = tmp_path / "hub_card.md"
        path.write_text(calls.hub_readme)
        return str(path)

    monkeypatch.setattr(repocard, "hf_hub_download", hf_hub_download)
    return calls


def help_options(text: str) -> set[str]:
    """The `--flags` a command's `--help` text names."""
    return set(re.findall(r"--[\w-]+", text))


def in_process_help_options(main, capsys) -> set[str]:
    """The `--flags` of `main(["--help"])` run in this process (it exits 0 after printing the help)."""
    import pytest

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    helped = capsys.readouterr().out
    assert helped.startswith("usage:"), helped[:300]
    return help_options(helped)


def assert_compiled_generation_equals(model, generate, expected, backend) -> None:
    """With `model.forward = torch.compile(model.forward, dynamic=True)` through `backend` (a torch.compile backend
    name), `generate()` returns `expected`, and a second call of the same lengths compiles nothing new."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    try:
        model.forward = torch.compile(model.forward, backend=counter, dynamic=True)
        with torch.no_grad():
            compiled = generate()
            frames = counter.frame_count
            again = generate()
    finally:
        del model.forward
        torch._dynamo.reset()
    assert frames >= 1, "nothing was compiled"
    assert torch.equal(compiled, expected), (compiled, expected)
    assert torch.equal(again, expected)
    assert counter.frame_count == frames, "a second generation of the same lengths compiled again"


@contextlib.contextmanager
def registered(name: str, backend):
    """`backend` registered as the DCMHA implementation `name` for the block (`DCMHAInterface.register`; None: no
    backend of that name), and what was registered under that name before (or nothing) afterwards."""
    from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHAInterface

    previous = DCMHA_BACKENDS.get(name)
    if backend is None:
        DCMHAInterface.unregister(name)
    else:
        DCMHAInterface.register(name, backend)
    try:
        yield backend
    finally:
        if previous is None:
            DCMHAInterface.unregister(name)
        else:
            DCMHAInterface.register(name, previous)


class OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor every op returns (views and `out=` results included)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def kv_copies(shapes: list[tuple], B: int, N: int, S: int, Dh: int) -> list[tuple]:
    """The shapes of `shapes` that hold keys or values once per query head: [B, N, S, Dh] or [B * N, S, Dh], or
    those transposed (S is a size no other tensor of the call has)."""
    return [s for s in shapes if s in {(B, N, S, Dh), (B * N, S, Dh), (B, N, Dh, S), (B * N, Dh, S)}]


# ----------------------------------------------------------------------------------------------------------------
# A Python without the package: what a save's remote code meets where the package is not installed
# ----------------------------------------------------------------------------------------------------------------
WITHOUT_PACKAGE = textwrap.dedent(
    """
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        # the package may sit in the same site-packages as torch (`pip install .` into a venv): hidden from here
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "modeling_dcformer":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NotInstalled())
    """
)


def isolated_paths(paths: list[str], checkout: str | os.PathLike) -> list[str]:
    """`sys.path` without the checkout's source folders (the checkout itself and what pytest's `pythonpath` adds
    under it, such as tests/ and examples/): the folders of torch, transformers and their dependencies stay, also a
    venv's site-packages inside the checkout (`python -m venv .venv`, as the README says)."""
    checkout = Path(checkout).resolve()

    def is_source(path: Path) -> bool:
        return path.is_relative_to(checkout) and not {"site-packages", "dist-packages"} & set(path.parts)

    return [p for p in paths if p and os.path.isdir(p) and not is_source(Path(p).resolve())]


def run_without_the_package(script: str, folder: Path, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """`script` (Python source) run where this package cannot be imported: `python -S -s` (no site hooks, so not
    the editable install's finder; no user site, not the checkout) with PYTHONPATH holding only the folders of
    torch, transformers and their dependencies (`isolated_paths`), the package hidden besides (`WITHOUT_PACKAGE`
    runs first), one thread, an empty HF_HOME, offline, stdin closed. `folder` holds the script and is its working
    directory and HOME; `args` are its arguments. Fails the test unless it exits 0; returns the finished process."""
    folder = Path(folder)
    path = folder / "without_package.py"
    path.write_text(WITHOUT_PACKAGE + textwrap.dedent(script))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder), "HF_HOME": str(folder / "hf_home"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join(isolated_paths(sys.path, ROOT))}
    proc = subprocess.run([sys.executable, "-S", "-s", str(path), *map(str, args)], cwd=folder, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
