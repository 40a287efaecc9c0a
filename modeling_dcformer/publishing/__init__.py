"""Sharing DCFormer models (installed package only; a save's remote code does not carry it): `save_pretrained` and
`push_to_hub` as the model calls them (`saving`), the Hub side (`hub`), the model card (`model_card`, `model_card_template.md`),
lm-eval results read for it (`eval_results`), and `DCFormerTrainer`, Trainer with DCFormer's card (`trainer`, imported
on its own: it imports Trainer)."""

from .model_card import check_repo_id, is_hub_id, write_model_card
from .hub import HubUploadError, push_folder, retry_upload_command, upload_folder
from .saving import AUTO_MAP, push_to_hub, remote_code_files, save_pretrained, write_remote_code

__all__ = ["AUTO_MAP", "HubUploadError", "check_repo_id", "is_hub_id", "push_folder", "push_to_hub",
           "remote_code_files", "retry_upload_command", "save_pretrained", "upload_folder", "write_model_card",
           "write_remote_code"]
