"""`dcformer-serve`: transformers' OpenAI-compatible server (`transformers serve`) for DCFormer models
(`serve.py`; docs/serving.md)."""

from .serve import cli, install, require_chat_template

__all__ = ["cli", "install", "require_chat_template"]
