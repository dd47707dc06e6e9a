"""Load the policy and compute log-probs of packed rows in which attention never crosses samples.

Packing: a row holds several samples back to back and `position_ids` restart at 0 at every
sample. We pass those position ids WITHOUT an attention mask; transformers (>= 4.54, the `masking_utils`
path every modern decoder uses) then detects the restarts and builds a block-diagonal causal mask
for sdpa/eager/flex, flash-attention uses them as varlen boundaries, and Gyre's `varlen`
implementation gets `cu_seqlens` from the sample lengths (`attention.py` says which runs where).
The tests `test_packed_equals_each_sample_alone*` prove on the real model that a packed row's
log-probs equal each sample run alone. A model class whose layers bypass that path (hybrid state-space layers,
masks of its own) is found by a probe at its first forward and run one sample per row (`_packing_mixes_samples`).

Log-probs come from the last hidden states through `logprobs.next_token_logprobs`, a chunk of
tokens at a time, so a long row never holds its whole `[T, vocab]` logits (`logprobs.py`).

Alignment (docs/architecture.md): logprob[t] = log p(input_ids[t] | the tokens before t in the same
sample) at the given temperature, and exactly 0 at each sample's first token (nothing precedes it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from gyre.config.shared import ModelConfig
from torch import Tensor

from gyre_trainer.attention import resolve_attn_implementation, uses_varlen, varlen_kwargs
from gyre_trainer.logprobs import next_token_logprobs

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 2048
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = float32 on CPU (bf16 matmuls are slow there), bfloat16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_model(
    model_cfg: ModelConfig,
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    *,
    activation_checkpointing: bool = False,
    attn_implementation: str | None = None,
    compile: bool | None = None,
    dropout: bool = True,
):
    """The HF causal LM in `model_cfg.name`, on `device`, in training mode, without a KV cache.

    `dropout=False` builds it with every dropout of its config at 0 (`without_dropout`): RL's importance ratio
    compares the trainer's log-probs with the sampler's, which has no dropout.

    `dtype` overrides `model_cfg.dtype`; `attn_implementation` overrides the config's
    `attn_implementation` (`auto` when the config has none; see `attention.py`). With
    `activation_checkpointing`, every decoder layer's activations are recomputed in backward
    (non-reentrant checkpointing, which FSDP2 supports). `compile` (default: the config's) compiles
    each decoder layer in place (before any FSDP2 wrapping, as torchtitan does) and makes
    `packed_logprobs` use compiled log-prob kernels; the model remembers it as `gyre_compile`.
    """
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    dtype = dtype or resolve_dtype(model_cfg.dtype, device)
    attn_implementation = resolve_attn_implementation(
        attn_implementation or getattr(model_cfg, "attn_implementation", "auto"), device
    )
    path = Path(model_cfg.name)
    # A hub id is "org/name"; anything else that does not exist is a missing local folder.
    if not path.exists() and (path.is_absolute() or model_cfg.name.startswith(".") or model_cfg.name.count("/") > 1):
        raise FileNotFoundError(f"model folder {path} does not exist (create one with `gyre model init`)")
    extra = {} if dropout else {"config": without_dropout(model_cfg.name)}
    model = AutoModelForCausalLM.from_pretrained(
        model_cfg.name, dtype=dtype, attn_implementation=attn_implementation, **extra
    )
    if not dropout:  # the modules were built without it; the config keeps the model's own values (published as is)
        for key, value in model.config.gyre_dropout.items():
            part = model.config.get_text_config() if key.startswith("text_config.") else model.config
            setattr(part, key.removeprefix("text_config."), value)
        del model.config.gyre_dropout
    model.config.use_cache = False
    model.gyre_compile = bool(getattr(model_cfg, "compile", False) if compile is None else compile)
    if activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if model.gyre_compile:
        for layer in model.model.layers:
            layer.compile(dynamic=True)  # rows differ in length: one graph for all of them
    return model.to(device).train()


def _dropout_keys(config) -> dict[str, float]:
    """The dropout probabilities a config sets above 0 (`attention_dropout`, `hidden_dropout_prob`, GPT-2's
    `resid_pdrop`...)."""
    return {key: value for key, value in vars(config).items()
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0}  # fmt: skip


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def without_dropout(name: str):
    """`name`'s config with every dropout probability at 0, the values it had kept in `gyre_dropout`. A model with
    dropout (OPT, GPT-2, Phi-2: 0.1) trained in training mode drew a new mask per forward: the trainer's log-probs
    of the tokens the sampler drew were noisy, and so were the importance ratio and its clipping, which compare
    them with the sampler's (no dropout there)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name)
    found = _dropout_keys(config)
    parts = [("", config)]
    text = _text_config(config)
    if text is not config:
        parts.append(("text_config.", text))
    for prefix, part in parts:
        for key in _dropout_keys(part):
            found.setdefault(prefix + key, getattr(part, key))
            setattr(part, key, 0.0)
    if found:
        log.info("dropout off for RL (the sampler has none): %s set to 0 for training; the published config keeps "
                 "them", ", ".join(f"{k} = {v:g}" for k, v in sorted(found.items())))  # fmt: skip
    config.gyre_dropout = found
    return config


def load_tokenizer(model_cfg: ModelConfig):
    """The tokenizer saved next to the model (weights published by the trainer carry it along)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg.name)


def model_context(model_cfg: ModelConfig) -> int | None:
    """The positions the model was trained for (its config's `max_position_embeddings`, GPT-2's `n_positions`), None
    when its config names none. Never the tokenizer's `model_max_length`: 1e30 for a tokenizer that sets no limit."""
    from transformers import AutoConfig

    context = getattr(_text_config(AutoConfig.from_pretrained(model_cfg.name)), "max_position_embeddings", None)
    return int(context) if isinstance(context, int) and context > 0 else None


def _as_lengths(lengths, device: torch.device) -> Tensor:
    """A row's sample lengths as a 1-D tensor (a row of one sample may be given as its length alone)."""
    if isinstance(lengths, Tensor):
        return lengths.to(device=device, dtype=torch.long).reshape(-1)
    return torch.as_tensor(np.asarray(lengths, dtype=np.int64), device=device).reshape(-1)


def packed_logprobs(
    model,
    input_ids: Tensor,
    position_ids: Tensor,
    sample_lengths: Tensor | Sequence[Tensor] | Sequence[int],
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probs (with grad) and entropies (detached; with grad when `entropy_grad`, for the entropy bonus) of
    packed rows; shapes equal `input_ids`'s.

    `input_ids`/`position_ids`: (T,) for one row or (B, T) for B rows of equal length (pad a short
    row with an extra padding "sample" whose positions also restart at 0), on any device (they are
    moved to the model's). `sample_lengths`: the row's lengths, or a sequence of B per-row lengths;
    each row's lengths sum to T.
    logprob[t] = log softmax(logits[t−1] / temperature)[input_ids[t]] within a sample, 0 at every
    sample's first token; entropy[t] is the entropy of that same distribution (0 at first tokens).
    Log-probs are computed in float32 (float64 for a float64 model) whatever the model's dtype, from
    the LM head applied `chunk_tokens` tokens at a time (see `logprobs.py`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    single_row = input_ids.dim() == 1
    ids = (input_ids.unsqueeze(0) if single_row else input_ids).to(device)
    pos = (position_ids.unsqueeze(0) if single_row else position_ids).to(device)
    rows = [sample_lengths] if single_row else list(sample_lengths)
    if ids.shape != pos.shape or len(rows) != ids.shape[0]:
        raise ValueError(
            f"packed_logprobs: input_ids {tuple(ids.shape)}, position_ids {tuple(pos.shape)} "
            f"and {len(rows)} rows of sample_lengths disagree"
        )
    rows = [_as_lengths(lengths, torch.device("cpu")) for lengths in rows]
    for row, lengths in enumerate(rows):
        if int(lengths.sum()) != ids.shape[1]:
            total = int(lengths.sum())
            raise ValueError(f"packed_logprobs: row {row} sample_lengths sum to {total}, not {ids.shape[1]}")
    if _packing_mixes_samples(model, device):
        logprobs, entropy = _one_sample_per_row(model, ids, rows, temperature, chunk_tokens, entropy_grad)
    else:
        logprobs, entropy = _packed_forward(model, ids, pos, rows, temperature, chunk_tokens, entropy_grad)
    if single_row:
        return logprobs.squeeze(0), entropy.squeeze(0)
    return logprobs, entropy


def _packed_forward(
    model, ids: Tensor, pos: Tensor, rows: list[Tensor], temperature: float, chunk_tokens: int, entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    """`packed_logprobs` of (B, T) rows on the model's device, in one forward."""
    device = ids.device
    starts = torch.zeros(ids.shape, dtype=torch.bool)
    for row, lengths in enumerate(rows):
        starts[row, torch.cumsum(lengths, 0) - lengths] = True
    starts = starts.to(device, non_blocking=True)

    kwargs = varlen_kwargs(rows, device) if uses_varlen(model) else {}
    _check_head_output_is_the_logits(model, device)
    # Position t−1 predicts token t; at a sample's first token that "prediction" comes from the
    # previous sample and is discarded below.
    targets = ids[:, 1:]
    with _head_returns_logprobs(model, targets, temperature, chunk_tokens, entropy_grad) as result:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
    if result:
        next_lp, next_entropy = result
    else:  # a head this path cannot take over (bias, soft-capping): the whole row's logits
        next_lp, next_entropy = _logprobs_from_logits(logits, targets, temperature, entropy_grad)
    zero = next_lp.new_zeros((next_lp.shape[0], 1))  # (not zeros_like(next_lp[:, :1]): a 1-token row has no column)
    logprobs = torch.where(starts, 0.0, torch.cat([zero, next_lp], dim=1))
    entropy = torch.where(starts, 0.0, torch.cat([zero.detach(), next_entropy], dim=1))
    return logprobs, entropy


#: Model attribute: True when a packed row's samples see each other in this model's forward (`_packing_mixes_samples`).
_MIXES_SAMPLES = "gyre_packing_mixes_samples"
#: Largest change of a probe sample's log-probs that its packed neighbour may cause: none at all is expected (the same
#: computation on the same values), so this only absorbs rounding; a model that mixes samples moves them far more.
_PROBE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5}


def _packing_mixes_samples(model, device: torch.device) -> bool:
    """Decide once per model whether samples packed into one row influence each other's log-probs.

    Position ids without an attention mask keep packed samples apart only where transformers' mask code (or the
    varlen kernel) runs for every layer. Hybrid models' state-space and linear-attention layers (Qwen3.5, Qwen3-Next,
    Nemotron-H, Falcon-H1, Jamba...: docs/trainer.md) and models with masks of their own (AFMoE) carried one sample's
    state into the next: its log-probs and gradient depended on whatever was packed before it (0.01-0.4 nats on
    tiny random models), and no metric showed it. The probe: two rows, [A, C] and [B, C] (A ≠ B, same lengths), in
    one no-grad forward with the dropout layers off, the RNG left as it was; C must get the same log-probs in both.
    Every rank runs it.
    """
    mixes = getattr(model, _MIXES_SAMPLES, None)
    if mixes is not None:
        return mixes
    ids = torch.tensor([[1, 2, 3, 7, 8, 9, 10], [4, 5, 6, 7, 8, 9, 10]], device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2, device=device)
    rows = [torch.tensor([3, 4])] * 2
    kwargs = varlen_kwargs(rows, device) if uses_varlen(model) else {}
    # only the dropouts that drop anything are switched off: a module's training flag is part of a compiled layer's
    # guards, so switching every module to eval would compile each layer once more
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training]
    config = getattr(model, "config", None)
    if config is not None and model.training and (_dropout_keys(config) or _dropout_keys(_text_config(config))):
        # a dropout its layers apply themselves (attention_dropout: no module to switch off) differs per row: the
        # probe found such a Llama "mixing" its samples; these few models pay the compile of eval mode
        dropouts = [model]
    for module in dropouts:
        module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            logits = model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).logits
    finally:
        for module in dropouts:
            module.train()
    dtype = logits.dtype
    lp = torch.log_softmax(logits[:, 3:].double(), dim=-1)
    mixes = bool((lp[0] - lp[1]).abs().max() > _PROBE_TOLERANCE.get(dtype, 1e-3))
    setattr(model, _MIXES_SAMPLES, mixes)
    if mixes:
        log.warning(
            "%s mixes the samples of a packed row (its layers do not keep to the position ids%s): every sample is "
            "run in a row of its own, right-padded (exact, but slower on rows of many short samples)",
            type(model).__name__, " and cu_seq_lens" if kwargs else "",
        )  # fmt: skip
    return mixes


def _one_sample_per_row(
    model, ids: Tensor, rows: list[Tensor], temperature: float, chunk_tokens: int, entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    """`packed_logprobs` for a model that mixes packed samples: each sample alone at the start of a row of its own,
    right-padded (a causal model's sample never sees the padding after it), then put back in place.

    Samples go longest first into forwards of at most as many tokens as the packed rows hold, each padded to its
    own longest sample: padding to the micro-batch's longest sample (a row per sample) multiplied the activations
    by the number of samples where rows hold many short ones next to a long one."""
    where = []  # (row, start, length) of every sample
    for row, lengths in enumerate(rows):
        starts = (torch.cumsum(lengths, 0) - lengths).tolist()
        where += [(row, start, n) for start, n in zip(starts, lengths.tolist(), strict=True) if n]
    where.sort(key=lambda sample: -sample[2])
    groups: list[list[tuple[int, int, int]]] = []
    for sample in where:
        if not groups or (len(groups[-1]) + 1) * groups[-1][0][2] > ids.numel():
            groups.append([])
        groups[-1].append(sample)
    dest_rows, dest_cols, lps, entropies = [], [], [], []
    for group in groups:
        width = group[0][2]
        unpacked = torch.zeros((len(group), width), dtype=ids.dtype, device=ids.device)
        positions = torch.zeros((len(group), width), dtype=torch.long)
        sample_rows, src_rows, src_cols = [], [], []
        for k, (row, start, n) in enumerate(group):
            unpacked[k, :n] = ids[row, start : start + n]
            positions[k, :n] = torch.arange(n)
            positions[k, n:] = torch.arange(width - n)  # the padding: a segment of its own
            sample_rows.append(torch.tensor([n, width - n] if n < width else [n]))
            dest_rows.append(torch.full((n,), row))
            dest_cols.append(torch.arange(start, start + n))
            src_rows.append(torch.full((n,), k))
            src_cols.append(torch.arange(n))
        positions = positions.to(ids.device, non_blocking=True)
        lp, entropy = _packed_forward(model, unpacked, positions, sample_rows, temperature, chunk_tokens, entropy_grad)
        src = (torch.cat(src_rows).to(ids.device), torch.cat(src_cols).to(ids.device))
        lps.append(lp[src])
        entropies.append(entropy[src])
    dest = (torch.cat(dest_rows).to(ids.device), torch.cat(dest_cols).to(ids.device))
    lp, entropy = torch.cat(lps), torch.cat(entropies)
    return (torch.zeros(ids.shape, dtype=lp.dtype, device=ids.device).index_put(dest, lp),
            torch.zeros(ids.shape, dtype=entropy.dtype, device=ids.device).index_put(dest, entropy))  # fmt: skip


#: Model attribute: True when the model's forward changes its LM head's output before returning it as logits.
_LOGITS_CHANGED = "gyre_logits_post_processed"


def _check_head_output_is_the_logits(model, device: torch.device) -> None:
    """Decide once per model whether its forward returns the LM head's output untouched as the logits.

    The chunked log-probs compute softmax(head(hidden) / temperature) themselves, so a forward that changes
    the head's output (Granite and Granite MoE divide by `logits_scaling`, Cohere multiplies by `logit_scale`,
    Falcon-H1 and HyperCLOVA X scale too, under names of their own) must keep the plain head: taken over, their
    log-probs were those of unscaled logits (0.2-0.4 nats off on tiny random models; mismatch_kl said so, the
    loss did not). A no-grad forward of two tokens whose head returns a marker tensor finds out, whatever the
    attribute is called: the model's logits must be that very tensor. Every rank runs it at its first call,
    leaving the RNG as it was.
    """
    if getattr(model, _LOGITS_CHANGED, None) is not None:
        return
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        setattr(model, _LOGITS_CHANGED, True)
        return
    returned: list[Tensor] = []

    def forward(hidden: Tensor) -> Tensor:
        returned.append(hidden)
        return hidden

    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    kwargs = varlen_kwargs([torch.tensor([2])], device) if uses_varlen(model) else {}
    head.forward = forward
    # fork_rng: the probe's dropout (LoRA's, in training mode) must not move the RNG the steps draw from, or a
    # resumed run (which probes at its first step) and `gyre replay` would draw other masks than the original
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            logits = model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False,
                           **kwargs).logits  # fmt: skip
    finally:
        del head.forward
    setattr(model, _LOGITS_CHANGED, not returned or logits is not returned[-1])


@contextlib.contextmanager
def _head_returns_logprobs(model, targets: Tensor, temperature: float, chunk_tokens: int, entropy_grad: bool = False):
    """While active, the model's LM head computes next-token log-probs and entropies from its input
    hidden states (chunked) instead of the logits, and puts them in the yielded list.

    Why inside the head's forward rather than calling the decoder and the head separately: under
    FSDP2 the root module's parameters (embeddings, final norm, head) are gathered only while the
    root's forward runs, so this keeps the head inside it; the parameter names (checkpoints, weight
    publishing) do not change either. Models whose forward post-processes the logits (soft-capping,
    scaling: `_check_head_output_is_the_logits`) or whose head has a bias keep the plain head: the list
    stays empty.
    """
    head = model.get_output_embeddings()
    result: list[Tensor] = []
    plain = (
        not isinstance(head, torch.nn.Linear)
        or head.bias is not None
        or getattr(model.config, "final_logit_softcapping", None) is not None
        or getattr(model, _LOGITS_CHANGED, False)
    )
    if plain:
        yield result
        return

    def forward(hidden: Tensor) -> Tensor:
        compiled = getattr(model, "gyre_compile", False)
        lp, entropy = next_token_logprobs(hidden[:, :-1], head.weight, targets, temperature, chunk_tokens, compiled,
                                          entropy_grad)  # fmt: skip
        result.extend((lp, entropy))
        # "logits" nobody reads, outside the graph: the loss flows through `result`. A tensor with a gradient (a view
        # of `hidden`: transformers slices it) had FSDP2 warn at every forward of every rank that an in-place op on
        # the root's view output "can produce wrong gradients"; its backward hook there never ran anyway.
        return hidden.detach()

    head.forward = forward
    try:
        yield result
    finally:
        del head.forward


def _logprobs_from_logits(
    logits: Tensor, targets: Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    scaled = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    next_lp = scaled.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - log_norm
    # without a gradient unless asked: autograd would keep the softmax, a [T, vocab] float buffer, for it
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        next_entropy = log_norm - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return next_lp, next_entropy
