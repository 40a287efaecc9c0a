"""The DCFormer cache: keys, values and each key's composition factors, per layer, growing (`DCFormerCacheLayer`) or
in static buffers (`DCFormerStaticCacheLayer`); filled by `DCFormerCache.update_dcmha`, rolled back by `crop`."""

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from .configuration_dcformer import DCFormerConfig
from .dcmha_base import packed


def shares_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s storage holds more than it (a view of a bigger tensor, which it would keep alive)."""
    return tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()


class DCFormerLayerLength:
    """What both DCFormer cache layers share: they count the tokens seen, fill through `update_dcmha`, and select
    along the batch their key terms with their keys and values."""

    cumulative_length: int

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("DCFormer layers update their cache through DCFormerCache.update_dcmha")

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def key_start(self, keys: torch.Tensor) -> int:
        """The absolute index of the first of `keys` (what `update_dcmha` returned)."""
        return self.cumulative_length - keys.shape[-2]

    def _select(self, fn) -> None:
        """`fn` applied along the batch to the keys, values and key terms (beam search, batch expansion)."""
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)
            if self.key_terms is not None:
                self.key_terms = fn(self.key_terms)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices, ...])


class DCFormerCacheLayer(DCFormerLayerLength, DynamicLayer):
    """One layer's keys and values [B, N, S, Dh] and key composition factors [B, S, G, Ck, 2I+1, M] (never N x N
    matrices). A local layer keeps the last `window_size - 1` keys between steps; after `activate_past_recording()`
    also every key added since the last `crop` (assisted decoding), as transformers' `DynamicSlidingWindowLayer`."""

    def __init__(self, window_size: int | None = None):
        super().__init__()
        self.window_size = window_size
        self.is_sliding = window_size is not None
        self.record_past = False
        self.key_terms: torch.Tensor | None = None
        self.cumulative_length = 0
        self._grown: dict[str, weakref.ref] = {}  # what `_append` returned last, by name

    @property
    def is_croppable(self) -> bool:  # a global layer always; a local one while recording
        return self.window_size is None or self.record_past

    def activate_past_recording(self) -> None:  # keep every key added until the next `crop`
        self.record_past = True

    def update_dcmha(self, key, value, key_terms):
        if not self.is_initialized:  # the first tokens are appended to none (copied: a view would keep its base alive)
            self.lazy_initialization(key, value)
            self.keys, self.values = key[:, :, :0], value[:, :, :0]
            self.key_terms = None if key_terms is None else key_terms[:, :0]
        in_place = self.window_size is None and not (torch.compiler.is_compiling() or key.requires_grad)  # `_append`
        self.keys, self.values = self._append("keys", key, 2, in_place), self._append("values", value, 2, in_place)
        self.key_terms = None if key_terms is None else self._append("key_terms", key_terms, 1, in_place)
        self.cumulative_length += key.shape[-2]
        if self.window_size is None:
            return self.keys, self.values, self.key_terms
        visible = min(self.keys.shape[-2], self.window_size - 1 + key.shape[-2])  # what this step's queries see
        terms = None if self.key_terms is None else self.key_terms[:, -visible:]
        full = (self.keys[:, :, -visible:], self.values[:, :, -visible:], terms)
        if not self.record_past:
            stored = self.keys.shape[-2]
            self._keep(max(0, stored - self.window_size + 1), stored)
        return full

    def _append(self, name: str, new: torch.Tensor, dim: int, in_place: bool) -> torch.Tensor:
        """`name` + new along dim. In place on a global layer (untraced; no autograd, which saves versions): after the
        tokens, room for an eighth + 64 more (DynamicLayer copies all each step); first tokens, crop, move: copied."""
        stored, last, extra = getattr(self, name), self._grown.get(name), new.shape[dim]
        if not stored.shape[dim]:  # the first tokens: a copy where they are a view (of a bigger base)
            return packed(new) if torch.compiler.is_compiling() or shares_storage(new) else new.contiguous()
        if not in_place:
            return torch.cat([stored, new], dim=dim)
        size = [*stored.shape]
        if last is None or last() is not stored or size[dim] + extra > stored.stride(dim - 1) // stored.stride(dim):
            room = [*size[:dim], (size[dim] + extra) * 9 // 8 + 64, *size[dim + 1 :]]
            stored = stored.new_empty(room).narrow(dim, 0, size[dim]).copy_(stored)
        size[dim] += extra
        stored = stored.as_strided(size, stored.stride(), stored.storage_offset())
        stored.narrow(dim, size[dim] - extra, extra).copy_(new)
        self._grown[name] = weakref.ref(stored)
        return stored

    def _keep(self, start: int, end: int) -> None:
        """Keep the stored tokens start..end-1 (copied when most of the storage goes: a view would keep it alive)."""
        stored = self.keys.shape[-2]
        if start == 0 and end == stored:
            return
        compact = end - start < stored - (end - start)

        def keep(tensor, dim):
            kept = tensor.narrow(dim, start, end - start)
            return kept.clone(memory_format=torch.contiguous_format) if compact else kept

        self.keys, self.values = keep(self.keys, 2), keep(self.values, 2)
        if self.key_terms is not None:
            self.key_terms = keep(self.key_terms, 1)

    def reset(self) -> None:
        super().reset()
        self.key_terms = None
        self.cumulative_length = 0

    def get_max_length(self) -> int:
        return -1 if self.window_size is None else self.window_size - 1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens, or keep the first `tokens_to_remove` when positive; a local layer
        then goes back to its window, and can roll back only the keys it kept."""
        if not self.is_initialized:
            return
        length = self.cumulative_length
        remove = max(0, length - tokens_to_remove) if tokens_to_remove > 0 else min(-tokens_to_remove, length)
        stored = self.keys.shape[-2]
        if self.window_size is None:
            self._keep(0, stored - remove)
            self.cumulative_length = length - remove
            return
        # the next step needs the window - 1 keys before the new end; while nothing was dropped, all of them
        limit = length if stored == length else stored - (self.window_size - 1)
        if remove > limit:
            kept = ("the window_size - 1 keys before the last crop and every key added since" if self.record_past
                    else "the last window_size - 1 keys")
            raise ValueError(f"cannot crop {remove} of the {length} tokens of a local DCFormer cache layer "
                             f"(window_size={self.window_size}): it can roll back at most {limit}, as it keeps only "
                             f"{kept}. Call cache.activate_past_recording() before the steps to roll back (assisted "
                             "decoding does)")
        self._keep(stored - remove - min(self.window_size - 1, length - remove), stored - remove)
        self.cumulative_length = length - remove


class DCFormerStaticCacheLayer(DCFormerLayerLength, CacheLayerMixin):
    """One layer's cache in buffers of `max_cache_len` tokens written in place, built for torch.compile as
    transformers' `StaticLayer` is: `update_dcmha` returns the whole buffers (from key 0; a query does not see the
    keys after it), and the length is a 0-dim tensor on the buffers' device, advanced in place, so that every decode
    step has the same shapes and no Python number that changes (`is_compileable`: `generate()` compiles the step on
    an accelerator). The model reads the length once per eager call (`DCFormerModel.forward`), which attends to views
    of the filled part (`seen_from`); a traced call attends to the whole buffers, masked."""

    is_compileable = True
    is_sliding = False
    is_croppable = True  # every key stays in the buffers, a local layer's too: a crop loses nothing

    def __init__(self, max_cache_len: int, window_size: int | None = None):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.window_size = window_size
        self.key_terms: torch.Tensor | None = None
        self.cumulative_length = torch.tensor(0)  # moved to the buffers' device with them

    def lazy_initialization(self, key_states, value_states, key_terms=None) -> None:
        B, N, _, Dh = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = (t.new_zeros(B, N, self.max_cache_len, Dh) for t in (key_states, value_states))
        if key_terms is not None:
            self.key_terms = key_terms.new_zeros(B, self.max_cache_len, *key_terms.shape[2:])
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # fixed addresses for CUDA graphs (a traced call cannot mark them)
            for tensor in (self.keys, self.values, self.key_terms, self.cumulative_length):
                if tensor is not None:
                    torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def update_dcmha(self, key, value, key_terms):
        if not self.is_initialized:
            self.lazy_initialization(key, value, key_terms)
        T = key.shape[-2]  # that there is room for them: `DCFormerCache.check_room`
        positions = torch.arange(T, device=self.device) + self.cumulative_length
        self.keys.index_copy_(2, positions, key)
        self.values.index_copy_(2, positions, value)
        if key_terms is not None:
            self.key_terms.index_copy_(1, positions, key_terms)
        self.cumulative_length.add_(T)
        return self.keys, self.values, self.key_terms

    def key_start(self, keys: torch.Tensor) -> int:
        return 0  # the whole buffers

    def seen_from(self, query_start: int, new_tokens: int) -> tuple:
        """Views of the keys, values and key terms the queries query_start.. of a step can see (the filled part; on a
        local layer, its window) and the index of the first: what an eager call attends to."""
        end = query_start + new_tokens
        first = 0 if self.window_size is None else max(0, query_start - self.window_size + 1)
        terms = None if self.key_terms is None else self.key_terms[:, first:end]
        return self.keys[:, :, first:end], self.values[:, :, first:end], terms, first

    def get_seq_length(self) -> torch.Tensor:
        """The tokens cached, a 0-dim tensor (as transformers' static layers count them)."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        self.cumulative_length.zero_()  # the buffers stay: the next sequence overwrites them

    def crop(self, tokens_to_remove: int) -> None:
        """Keep the first `tokens_to_remove` tokens, or drop the last -`tokens_to_remove` (as `DynamicLayer.crop`);
        in place, without reading the length."""
        if tokens_to_remove <= 0:
            self.cumulative_length.add_(tokens_to_remove).clamp_(min=0)
        else:
            self.cumulative_length.clamp_(max=tokens_to_remove)


class DCFormerCache(Cache):
    """Cache of a DCFormer model: a growing `DCFormerCacheLayer` per layer, or with `max_cache_len` a
    `DCFormerStaticCacheLayer` (`generate(..., cache_implementation="static")`)."""

    def __init__(self, config: DCFormerConfig, max_cache_len: int | None = None):
        windows = [config.window_size if kind == "sliding_attention" else None for kind in config.layer_types]
        if max_cache_len is None:
            layers = [DCFormerCacheLayer(window) for window in windows]
        else:
            if not isinstance(max_cache_len, int) or max_cache_len < 1:
                raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
            layers = [DCFormerStaticCacheLayer(max_cache_len, window) for window in windows]
        super().__init__(layers=layers)
        # per layer, the dynamic-weight projection's half-precision input weight (DynamicWeightProjection's
        # `input_products`): made at the first step, reused by the later steps of the same generation
        self.projection_weights: dict[int, dict] = {}

    def update_dcmha(self, key, value, key_terms, layer_idx: int, query_start=None):
        """Append this step's keys, values and key terms; returns (keys, values, key_terms, key_start) to attend to.
        A static layer's are its whole buffers, or with `query_start` an int (an eager call) views of the keys the
        step's queries can see (`DCFormerStaticCacheLayer.seen_from`)."""
        layer = self.layers[layer_idx]
        keys, values, terms = layer.update_dcmha(key, value, key_terms)
        if isinstance(layer, DCFormerStaticCacheLayer) and isinstance(query_start, int):
            return layer.seen_from(query_start, key.shape[-2])
        return keys, values, terms, layer.key_start(keys)

    def check_room(self, length: int, new_tokens: int) -> None:
        """A clear error where a static cache of `length` tokens has no room for `new_tokens` more."""
        limit = self.max_cache_len
        if limit is not None and length + new_tokens > limit:
            raise ValueError(f"the static DCFormer cache holds max_cache_len={limit} tokens; this step would need "
                             f"{length + new_tokens}: make it longer (generate's max_cache_len, or max_new_tokens)")

    @property
    def max_cache_len(self) -> int | None:
        """The static layers' length (None: growing layers)."""
        layer = self.layers[0]
        return layer.max_cache_len if isinstance(layer, DCFormerStaticCacheLayer) else None

    def crop(self, tokens_to_remove: int) -> None:
        """Crop every layer, the local ones first: if one refuses, the first does, and nothing has changed."""
        for layer in sorted(self.layers, key=lambda layer: not layer.is_sliding):
            layer.crop(tokens_to_remove)


# generate()'s cache_implementation values DCFormer honours (besides None); transformers' others build caches of keys
# and values alone, which cannot hold the key composition factors ("hybrid" it would replace silently).
SUPPORTED_CACHE_IMPLEMENTATIONS = ("dynamic", "static")
CACHE_HINT = ("use DCFormerCache(model.config) (growing) or DCFormerCache(model.config, max_cache_len=N) (static "
              "buffers; from modeling_dcformer import DCFormerCache), or let generate() build it: "
              "cache_implementation=\"static\" or \"dynamic\" (the default)")


def check_cache_implementation(implementation) -> None:
    """Refuses a `cache_implementation` DCFormer does not support, with one line naming the value and what to use."""
    if implementation is not None and implementation not in SUPPORTED_CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation={implementation!r} is not supported by DCFormer: its cache also "
                         f"holds each key's composition factors, which transformers' {implementation!r} cache cannot; "
                         f"{CACHE_HINT}")


def check_cache(cache) -> "DCFormerCache | None":
    """The cache a forward pass may use: a `DCFormerCache` as it is; an empty plain `DynamicCache` (what generic
    transformers code creates) gives None (the model starts a growing `DCFormerCache`); anything else is a TypeError
    naming it and the cache to use (other caches store keys and values only)."""
    if cache is None or isinstance(cache, DCFormerCache):
        return cache
    name = type(cache).__name__
    if not isinstance(cache, Cache):
        raise TypeError(f"DCFormer's cache must be a DCFormerCache, got a {name}; {CACHE_HINT}")
    if type(cache) is DynamicCache and not getattr(cache, "offloading", False):
        if cache.get_seq_length() > 0:
            raise TypeError(f"DCFormer cannot continue from a filled DynamicCache ({cache.get_seq_length()} tokens): "
                            f"it lacks the keys' composition factors; {CACHE_HINT}")
        return None
    what = "an offloading DynamicCache" if type(cache) is DynamicCache else f"transformers' {name}"
    raise TypeError(f"DCFormer cannot use {what}: its cache also holds each key's composition factors, which that "
                    f"cache's layers cannot store; {CACHE_HINT}")


__all__ = ["DCFormerCache", "DCFormerCacheLayer", "DCFormerStaticCacheLayer", "check_cache",
           "check_cache_implementation"]
