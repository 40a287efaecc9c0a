"""Training FLOPs of the comparison's models, counted from their shapes (docs/evidence.md, "Three axes").

A pure function of a config dict (`config.to_dict()` of a GPTNeoXConfig or a DCFormerConfig, as the comparison's
results.json stores them), the sequence length and the number of training tokens, so that old results can be
re-counted without the models. One FLOP is one multiplication or one addition: a multiply-add is 2 FLOPs.

Per sequence of T tokens, forward pass, with L layers, hidden D, N heads, MLP width F, vocabulary V:

- dense: 2 T (L (3 D^2 + D^2 + m D F) + D V), m = 2 (3 for a gated MLP): the q/k/v, output, MLP and
  output-embedding matrix products (embedding lookups, biases and norms are not counted);
- attention: 4 D P per layer, P the (query, key) pairs a layer scores: 2 D P for q.k and 2 D P for p.v;
- DCMHA projections: 2 T (D G C K + G C K 2I M + D C N) per layer: dw1, qkw and the tanh diagonal's dd, with G
  head groups, M = N / G heads per group, C composition slots (4, or 2 when query-wise), K and I the dynamic
  hidden size and rank (absent in the `static` ablation, whose composition weights are constants);
- DCMHA Compose: P x 2 (pre- and post-softmax) x sides x (4 I + 2) N per layer, sides = 2 (query- and key-wise
  terms; 1 when query-wise): per pair and side, the rank-I hidden values sum_n A[n] w1[i, n] (I N multiply-adds),
  their spread back over the heads (I N multiply-adds) and the diagonal term (N multiply-adds).

P = T (T + 1) / 2 for a causal layer ("causal", the pairs a query can see; what a kernel that skips the masked
half computes), T^2 for the full square ("full", what a dense kernel computes), sum_t min(t + 1, W) for a local
layer of window W. Training is 3 x forward: the backward pass of a product costs two products. The recomputation
of the attention in DCFormer's backward pass (`attention_recompute`) and elementwise work (softmax, GELU, norms,
rotary) are not counted: these are the model's FLOPs, not the hardware's.
"""

from __future__ import annotations

BACKWARD_FACTOR = 2  # the backward pass of a matrix product: two products of the same size
ATTENTION_MODES = ("causal", "full")


def attention_pairs(seq_len: int, window: int | None = None, mode: str = "causal") -> int:
    """The (query, key) pairs one layer scores in a sequence of `seq_len` tokens."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode == "full":
        return seq_len * seq_len
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    # queries 0..W-1 see t + 1 keys, the later ones W
    return window * (window + 1) // 2 + (seq_len - window) * window


def layer_windows(config: dict) -> list[int | None]:
    """The window of each layer (None: global) of a config dict."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or ["full_attention"] * layers
    window = config.get("window_size")
    return [window if kind == "sliding_attention" else None for kind in types]


def forward_flops(config: dict, seq_len: int, kind: str = "auto", attention: str = "causal") -> dict[str, float]:
    """Forward FLOPs of one sequence of `seq_len` tokens, by term (dense, attention, dcmha_projection,
    dcmha_compose) and their "total". `kind`: "transformer" (plain attention), a DCFormer variant of the
    comparison ("dcformer", "static", "pre", "post", "query-wise"), or "auto" (from the config's model_type)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    D, N, L = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    F, V = config["intermediate_size"], config["vocab_size"]
    T = seq_len
    if kind == "auto":
        kind = "dcformer" if config.get("model_type") == "dcformer" and config.get("use_dcmha", True) else "transformer"
    mlp_mats = 3 if config.get("use_gated_mlp") else 2
    dense = 2 * T * (L * (4 * D * D + mlp_mats * D * F) + D * V)
    windows = layer_windows(config) if kind != "transformer" else [None] * L
    pairs = [attention_pairs(T, w, attention) for w in windows]
    terms = {"dense": float(dense), "attention": float(sum(4 * D * p for p in pairs))}
    projection = compose = 0
    if kind != "transformer":
        G, I, K = config.get("num_head_groups", 1), config["dynamic_rank"], config["dynamic_hidden_size"]
        M = N // G
        query_wise = config.get("query_wise", False)
        C, sides = (2, 1) if query_wise else (4, 2)
        if kind != "static":
            projection = 2 * T * L * (D * G * C * K + G * C * K * 2 * I * M + D * C * N)
        compose = sum(p * 2 * sides * (4 * I + 2) * N for p in pairs)
    terms["dcmha_projection"] = float(projection)
    terms["dcmha_compose"] = float(compose)
    terms["total"] = sum(terms.values())
    return terms


def training_flops(config: dict, tokens: float, seq_len: int, kind: str = "auto", attention: str = "causal") -> float:
    """FLOPs of training on `tokens` tokens in sequences of `seq_len`: (1 + BACKWARD_FACTOR) x forward."""
    per_token = forward_flops(config, seq_len, kind, attention)["total"] / seq_len
    return (1 + BACKWARD_FACTOR) * per_token * tokens


def flops_per_step(report: dict, kind: str) -> float | None:
    """Training FLOPs of one optimizer step of model `kind` in a comparison's results.json (None if the report
    lacks the model's config). Synthetic tasks: sequences of the mean training length (padding not counted)."""
    config = report.get("configs", {}).get(kind)
    setup = report["setup"]
    if config is None:
        return None
    if setup.get("task") == "lm":
        seq_len = setup["block_size"]
        tokens = setup["batch_size"] * seq_len
    else:
        tokens = setup["train_tokens"] / setup["steps"]
        seq_len = max(1, round(tokens / setup["batch_size"]))
    return training_flops(config, tokens, seq_len, kind)
