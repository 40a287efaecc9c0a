"""Serving a saved DCFormer behind transformers' OpenAI-compatible server (`transformers serve`).

What transformers 5.24's server does and what that means for DCFormer (docs/memory.md, "Serving"):
- It loads a model by `getattr(transformers, config.architectures[0])`: only classes inside transformers are found,
  so neither the installed package nor the folder's remote code (`--trust-remote-code`) is enough by itself. The
  launcher below imports `modeling_dcformer` and names `DCFormerForCausalLM` where the server looks, then runs the
  unchanged `transformers serve` command line.
- `--continuous-batching` needs paged attention ("paged|eager", sdpa or flash), which cannot compose heads: DCFormer
  is served by the plain route, one `generate()` per request with DCFormer's own cache. That is the default; the
  flags to pass are the model folder, `--device` and `--dtype`.

The server binds 127.0.0.1 on a free port, is queried for a greedy completion, and is stopped by the test (bounded
waits; killed if it does not stop). The answer must be the text the same model's `generate` gives in-process.
"""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

pytestmark = pytest.mark.slow  # starts a server process (about 15-30 s on a busy 2-core machine)

# `transformers serve`, with DCFormerForCausalLM where the server looks for architectures (see the module docstring)
LAUNCHER = (
    "import sys, transformers.cli.serving.model_manager as manager, modeling_dcformer; "
    "manager.transformers.DCFormerForCausalLM = modeling_dcformer.DCFormerForCausalLM; "
    "from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
)
STARTUP_S = 120
REQUEST_S = 120


def serve_missing() -> str | None:
    try:
        from transformers.utils.import_utils import is_serve_available
    except ImportError:
        return "this transformers has no `transformers serve`"
    if not is_serve_available():
        return "transformers serve needs fastapi, uvicorn, pydantic and openai: pip install 'transformers[serving]'"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from released_checkpoint import write_tokenizer

    torch.manual_seed(0)
    config = DCFormerConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("serving") / "tiny-dcformer"
    DCFormerForCausalLM(config).save_pretrained(path, model_card=False)
    write_tokenizer(path, config.vocab_size)
    return path


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
        return json.loads(response.read())


def test_transformers_serve_answers_a_completion_from_a_saved_dcformer(saved_model):
    reason = serve_missing()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    prompt, max_tokens = "w5 w6 w7", 5
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    model = DCFormerForCausalLM.from_pretrained(saved_model).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = tokenizer.decode(model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1] :])

    port = free_port()
    command = [
        sys.executable, "-c", LAUNCHER, "serve", str(saved_model), "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"the server exited ({server.returncode}):\n{server.stdout.read()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer /health within {STARTUP_S} s")
                time.sleep(0.5)
        answer = post(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": str(saved_model), "prompt": prompt, "max_tokens": max_tokens},
        )
    finally:
        server.terminate()
        try:
            server.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
    (choice,) = answer["choices"]
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == max_tokens
    assert choice["text"].strip() == expected.strip(), (choice["text"], expected)
    assert server.returncode is not None  # stopped
