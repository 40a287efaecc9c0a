"""Serving a saved DCFormer with `dcformer-serve`: transformers' OpenAI-compatible server (`transformers serve`, same
options) in a process where the server finds DCFormer's class (docs/serving.md).

What transformers 5's server does and what that means for DCFormer:
- It loads a model by `getattr(transformers, config.architectures[0])`: only classes inside transformers are found,
  so `transformers serve FOLDER --trust-remote-code` ends in an AttributeError. `dcformer-serve`
  (`modeling_dcformer.serving`) imports the package and names `DCFormerForCausalLM` where the server looks.
- A chat request formats the messages with the tokenizer's chat template; without one the server fails with a 500
  inside `apply_chat_template`. `dcformer-serve` answers 400 with a message naming the model.
- `--continuous-batching` needs paged attention, which cannot compose heads: DCFormer is served by the plain route,
  one `generate()` per request with DCFormer's own cache.

The server binds 127.0.0.1 on a free port (no model preloaded: each request names its folder), answers a completion
and a chat request with the text the same model's greedy `generate` gives in-process, refuses a chat request for a
tokenizer without a chat template, and is stopped by the fixture (bounded waits; killed if it does not stop).
"""

import configparser
import importlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 120
REQUEST_S = 120
PROMPT, MAX_TOKENS = "w5 w6 w7", 5
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
NO_TEMPLATE = "has no chat template"


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


def save_tiny(path: Path, chat_template: str | None) -> Path:
    from released_checkpoint import write_tokenizer
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    config = DCFormerConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    DCFormerForCausalLM(config).save_pretrained(path, model_card=False)
    write_tokenizer(path, config.vocab_size)
    if chat_template is not None:
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """(a folder whose tokenizer has a chat template, a folder whose tokenizer has none)"""
    root = tmp_path_factory.mktemp("serving")
    return save_tiny(root / "chat", CHAT_TEMPLATE), save_tiny(root / "plain", None)


@pytest.fixture(scope="module")
def server(saved_models):
    """`python -m modeling_dcformer.serving` (the console script `dcformer-serve`) on 127.0.0.1, offline, with the
    flag the plain `transformers serve` fails with; yields its base URL."""
    reason = serve_missing()
    if reason:
        pytest.skip(reason)
    port = free_port()
    command = [
        sys.executable, "-m", "modeling_dcformer.serving", "--trust-remote-code", "--host", "127.0.0.1",
        "--port", str(port), "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited ({process.returncode}):\n{process.stdout.read()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer /health within {STARTUP_S} s")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def post(url: str, body: dict) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a POST, error statuses included (a body that is not JSON as {"text": ...})."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
        try:
            return error.code, json.loads(text)
        except ValueError:  # a plain-text error page ("Internal Server Error")
            return error.code, {"text": text}


def greedy_text(folder: Path, ids: torch.Tensor) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = DCFormerForCausalLM.from_pretrained(folder).eval()
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow  # starts a server process (about 15-30 s on a busy 2-core machine)
def test_dcformer_serve_answers_a_completion(server, saved_models):
    from transformers import AutoTokenizer

    folder = saved_models[1]
    expected = greedy_text(folder, AutoTokenizer.from_pretrained(folder)(PROMPT, return_tensors="pt").input_ids)
    status, answer = post(f"{server}/v1/completions", {"model": str(folder), "prompt": PROMPT, "max_tokens": 5})
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert choice["text"].strip() == expected.strip(), (choice["text"], expected)


@pytest.mark.slow
def test_dcformer_serve_answers_a_chat_request_with_the_chat_template(server, saved_models):
    from transformers import AutoTokenizer

    folder = saved_models[0]
    messages = [{"role": "user", "content": PROMPT}]
    ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    expected = greedy_text(folder, ids)
    body = {"model": str(folder), "messages": messages, "max_tokens": MAX_TOKENS}
    status, answer = post(f"{server}/v1/chat/completions", body)
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert choice["message"]["content"].strip() == expected.strip() != "", (choice["message"], expected)


@pytest.mark.slow
def test_dcformer_serve_refuses_a_chat_request_without_a_chat_template(server, saved_models):
    """400 with a message naming the model and what to do, on both chat endpoints (the server alone answers 500)."""
    folder = str(saved_models[1])
    for endpoint, body in (
        ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS}),
        ("responses", {"input": PROMPT, "max_output_tokens": MAX_TOKENS}),
    ):
        status, answer = post(f"{server}/v1/{endpoint}", {"model": folder, **body})
        assert status == 400, (endpoint, status, answer)
        assert f"{folder} {NO_TEMPLATE}" in answer["detail"] and "/v1/completions" in answer["detail"], answer
    # the same server still answers that model's completions
    status, answer = post(f"{server}/v1/completions", {"model": folder, "prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


# ---- the command line, in this process (no server starts) ----


@pytest.fixture
def serve_cli(monkeypatch):
    """`cli` of `dcformer-serve`, with what `install()` sets in transformers restored after the test, and
    `ServerStarted` raised where the server would start."""
    reason = serve_missing()
    if reason:
        pytest.skip(reason)
    import transformers
    import uvicorn

    from modeling_dcformer.serving import serve

    for name in serve.ARCHITECTURES:
        monkeypatch.setattr(transformers, name, None, raising=False)
    for module_name, class_name in serve.CHAT_HANDLERS:
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, class_name, getattr(module, class_name))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def started(self, *args, **kwargs):
        raise ServerStarted

    monkeypatch.setattr(uvicorn.Server, "run", started)  # input taken as good ends the call, not hangs it
    return serve.cli


class ServerStarted(Exception):
    """Raised where the server would start serving (after the model named on the command line is loaded)."""


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_dcformer_serve_says_bad_input_in_one_line(serve_cli, capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    assert serve_cli([str(missing), "--port", str(free_port())]) == 2
    assert one_error_line(capsys) == f"error: {missing}: no such folder"
    (tmp_path / "empty").mkdir()  # no config, no tokenizer
    assert serve_cli([str(tmp_path / "empty"), "--port", str(free_port())]) == 2
    assert str(tmp_path / "empty") in one_error_line(capsys)
    assert serve_cli(["--dtype", "float33", "--port", str(free_port())]) == 2
    assert "float33" in one_error_line(capsys)
    from released_checkpoint import released_dir, write_tokenizer

    released, config, _ = released_dir(tmp_path)  # the authors' layout: its config loads with no architectures
    write_tokenizer(released, config["vocab_size"])
    assert serve_cli([str(released), "--port", str(free_port())]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {released}: config.json names no model class") and "dcformer-convert" in line


def test_dcformer_serve_loads_a_saved_folder_named_as_a_path_or_as_dot(serve_cli, saved_models, monkeypatch):
    """The neighbours of the refused input: a saved folder (with and without `--trust-remote-code`), and `.`."""
    folder = saved_models[0]
    for argv in ([str(folder)], [str(folder), "--trust-remote-code"], ["."]):
        monkeypatch.chdir(folder)
        with pytest.raises(ServerStarted):
            serve_cli([*argv, "--port", str(free_port()), "--device", "cpu"])


def test_dcformer_serve_without_the_serving_packages(monkeypatch, capsys):
    import transformers.utils.import_utils as import_utils

    from modeling_dcformer.serving import cli

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    assert cli(["--help"]) == 2
    assert 'pip install "transformers[serving]"' in capsys.readouterr().err


def test_dcformer_serve_is_a_console_script_of_the_wheel():
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    scripts = dict(
        line.replace(" ", "").split("=") for line in parser["options.entry_points"]["console_scripts"].split("\n")
        if line.strip()
    )  # fmt: skip
    module, _, function = scripts["dcformer-serve"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert "modeling_dcformer.serving" in parser["options"]["packages"].split()
