"""What `DCFormerPreTrainedModel.from_pretrained` adds where the package is installed (a save's remote code loads
without it): a local folder read under `atomic_dir.reading`'s shared lock, a config read from an earlier save read
again, a shard index naming a file outside its folder refused before transformers follows it, one line naming an
unreadable weight file, and the released checkpoints' query-wise check."""

from transformers.utils import logging

from . import atomic_dir, released_format, weight_files

logger = logging.get_logger(__name__)

# from_pretrained's arguments that say where the files are: passed on to the config and checkpoint reads here
HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def from_pretrained(load, source, *args, **kwargs):
    """`load(source, *args, **kwargs)` (transformers' `from_pretrained` of the model class) with the additions above."""
    config = kwargs.get("config")
    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if kwargs.get(k) is not None}
    if hasattr(config, "query_wise"):  # a DCFormer config given with the checkpoint
        released_format.check_query_wise(config, source, hub_kwargs)
    with atomic_dir.reading(source, hub_kwargs.get("subfolder")) as save_id:
        if getattr(config, "save_id", None) not in (None, save_id):  # a config read from an earlier save
            logger.warning(f"{source} was saved again since its config was read: reading the new one")
            kwargs.pop("config")  # (by AutoModel*, say, just before the folder was replaced)
        weight_files.check_index_names(source, variant=kwargs.get("variant"), **hub_kwargs)
        try:
            return load(source, *args, **kwargs)
        except Exception:  # an unreadable weight file or shard index: one line naming it
            problem = weight_files.describe_unreadable(source, **hub_kwargs)
            if problem is None:
                raise
            raise OSError(problem) from None


__all__ = ["from_pretrained"]
