"""Text generation: a KV cache filled by one prefill, one-token decode steps, sampling as pure
functions over logits, and streaming text that never splits a UTF-8 character.

The pieces a serving loop needs are public and independent: `validate_sampling`, the masks
(`top_k_mask`, `top_p_mask`, `min_p_mask`), `apply_repetition_penalty`, `sample_next`, and
`new_cache`/`prefill`/`decode_step` over a `KVCache`. `generate` (token ids) and
`generate_text`/`stream_text` (strings) are built from them.

Context longer than `block_size` (a sliding window): once the cache is full, the last
`window_keep` tokens (3/4 of `block_size` by default) are encoded again into the cache from slot 0
and decoding continues, so each new token sees between `window_keep` and `block_size` tokens of
context, at the cost of one prefill per `block_size - window_keep + 1` tokens. With learned
positions the re-encoded tokens get new positions, which is why the cache cannot simply be
shifted. `window_keep=block_size` re-encodes the last `block_size` tokens at every step: exactly
what cropping the context to `block_size` tokens does without a cache, and as slow. A prompt longer
than `block_size` is cropped from the left, with a warning.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from gptlab import kernels
from gptlab.model import KVCache

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Sampling: pure functions over logits (B, V)


def validate_sampling(
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    max_new_tokens: int | None = None,
    num_samples: int = 1,
) -> None:
    """Raise ValueError naming the first sampling setting that is out of range."""
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1] or None, got {min_p!r}")
    if not isinstance(repetition_penalty, (int, float)) or not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 means off), got {repetition_penalty!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept); the rest -> -inf."""
    if k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability sums to at least p; the rest -> -inf. The most likely token is always kept."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = F.softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    drop_sorted = mass_before >= p  # (B, V); position 0 has mass_before 0 < p, always kept
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_mask(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """min-p (Nguyen et al. 2024): keep tokens whose probability is at least min_p times the top one."""
    if not min_p:
        return logits
    probs = F.softmax(logits.float(), dim=-1)  # (B, V)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def seen_tokens(token_ids, vocab_size: int, device=None) -> torch.Tensor:
    """(B, V) bool: which ids occur in each row of `token_ids` (a list of id lists, or (B, S)
    LongTensor in which negative ids are padding)."""
    if not isinstance(token_ids, torch.Tensor):
        width = max((len(r) for r in token_ids), default=0)
        token_ids = torch.tensor(
            [list(r) + [-1] * (width - len(r)) for r in token_ids], dtype=torch.long, device=device
        )
        token_ids = token_ids.view(len(token_ids) if len(token_ids) else 0, width)
    B = token_ids.size(0)
    seen = torch.zeros(B, vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    ids = token_ids.masked_fill(token_ids < 0, vocab_size)  # padding -> a spare column, dropped below
    seen.scatter_(1, ids, True)
    return seen[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019), as transformers applies it: for tokens already
    in the context, a positive logit is divided by `penalty`, a negative one multiplied by it.

    `seen` is a (B, V) bool mask (see `seen_tokens`) or a (B, S) LongTensor of context ids
    (negative ids are padding)."""
    if penalty == 1.0:
        return logits
    if seen.dtype != torch.bool:
        seen = seen_tokens(seen, logits.size(-1))
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): greedy when temperature is 0, else temperature,
    then top-k, top-p and min-p (the order transformers uses), then a draw from what is left."""
    if temperature == 0:
        return kernels.argmax(logits)
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None:
        logits = top_k_mask(logits, top_k)
    if top_p is not None:
        logits = top_p_mask(logits, top_p)
    if min_p:
        logits = min_p_mask(logits, min_p)
    probs = F.softmax(logits, dim=-1)  # (B, V)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)  # (B,)


# ---------------------------------------------------------------------------------------------
# The cache: prefill and one-token decode steps


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    """Where activations live and their dtype: those of the token embedding (float32 if it is not float)."""
    weight = model.transformer.wte.weight
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    return weight.device, dtype


def new_cache(model, batch_size: int, max_len: int) -> KVCache:
    """A KV cache for `batch_size` rows of up to `max_len` tokens, in the model's device and dtype."""
    if max_len > model.config.block_size:
        raise ValueError(f"cache length {max_len} exceeds block_size {model.config.block_size}")
    device, dtype = model_device_dtype(model)
    return KVCache(model.config, batch_size, max_len, device=device, dtype=dtype)


@torch.no_grad()
def prefill(model, idx: torch.Tensor, cache: KVCache, *, positions=None, key_mask=None) -> torch.Tensor:
    """Run the prompt idx (B, T) through the model into `cache` from slot cache.pos; returns the
    last position's logits (B, V). `positions` (B, T) and `key_mask` (B, max_len) describe left padding."""
    logits, _ = model(idx, kv_cache=cache, positions=positions, key_mask=key_mask, last_only=True)
    cache.advance(idx.size(1))
    return logits[:, -1]  # (B, V)


def _next_logits(model, tokens, cache, positions, key_mask):
    """One decode forward: tokens (B,) at slot cache.pos -> logits (B, V); does not advance the cache."""
    pos = positions[:, None] if positions is not None else None  # (B, 1)
    logits, _ = model(tokens[:, None], kv_cache=cache, positions=pos, key_mask=key_mask, last_only=True)
    return logits[:, -1]  # (B, V)


@torch.no_grad()
def decode_step(model, tokens: torch.Tensor, cache: KVCache, *, positions=None, key_mask=None) -> torch.Tensor:
    """Feed one new token per row, tokens (B,), at slot cache.pos; returns the next logits (B, V).
    `positions` (B,) are the rows' position ids (needed with left padding)."""
    logits = _next_logits(model, tokens, cache, positions, key_mask)
    cache.advance(1)
    return logits


def compile_decode(model, *, freezing: bool = True, mode: str | None = None):
    """A drop-in `decode_step` for `model`, its forward compiled by torch.compile (inductor), for
    `generate(..., compiled_step=...)` or a serving loop.

    The cache position becomes a 0-dim tensor, so one graph serves every position (writes go
    through index_copy_, attention spans the whole cache with unwritten slots masked). `freezing`
    lets inductor treat the weights as constants and prepack them for the CPU's matmul kernels
    (oneDNN/MKL); that needs the model bound here rather than passed per call. The first call
    per batch size compiles (tens of seconds); later calls reuse the graph.
    """

    def forward(tokens, cache, positions, key_mask):
        return _next_logits(model, tokens, cache, positions, key_mask)

    compiled = torch.compile(forward, fullgraph=True, dynamic=None, mode=mode)

    @torch.no_grad()
    def step(step_model, tokens, cache, *, positions=None, key_mask=None):
        if step_model is not model:
            raise ValueError("this compiled decode step was built for another model")
        if not isinstance(cache.pos, torch.Tensor):
            cache.pos = torch.tensor(cache.pos, device=tokens.device)
        # Freezing is read when the graph compiles, which is on a call; options= does not reach it.
        with torch._inductor.config.patch(freezing=freezing):
            logits = compiled(tokens, cache, positions, key_mask)
        cache.advance(1)
        return logits

    return step


def left_pad(rows: Sequence[Sequence[int]], device=None, pad_id: int = 0):
    """Left-pad id lists into idx (B, T), positions (B, T) (0 at the first real token) and
    key_mask (B, T) (False at padding), or key_mask None when no row is padded."""
    T = max(len(r) for r in rows)
    idx = torch.tensor([[pad_id] * (T - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    lengths = torch.tensor([len(r) for r in rows], device=device)  # (B,)
    slots = torch.arange(T, device=device)  # (T,)
    key_mask = slots[None, :] >= (T - lengths)[:, None]  # (B, T)
    positions = (slots[None, :] - (T - lengths)[:, None]).clamp(min=0)  # (B, T)
    if bool(key_mask.all()):
        return idx, positions, None
    return idx, positions, key_mask


# ---------------------------------------------------------------------------------------------
# The decoding loop


class _Decoder:
    """Holds one batch's cache, positions and padding mask; refills the cache when it is full."""

    def __init__(self, model, rows: list[list[int]], max_new_tokens: int, window_keep: int, compiled_step=None):
        self.model, self.rows, self.window_keep = model, rows, window_keep
        self.block_size = model.config.block_size
        longest = max(len(r) for r in rows)
        self.cache = new_cache(model, len(rows), min(self.block_size, longest + max_new_tokens))
        self.step_fn = compiled_step or decode_step

    def start(self, rows: list[list[int]]) -> torch.Tensor:
        """Encode rows (already fitting the cache) from slot 0; returns the next logits (B, V)."""
        device, _ = model_device_dtype(self.model)
        idx, positions, mask = left_pad(rows, device)
        self.cache.pos = 0
        self.key_mask = None
        if mask is not None:
            self.key_mask = torch.ones(len(rows), self.cache.max_len, dtype=torch.bool, device=device)
            self.key_mask[:, : idx.size(1)] = mask  # (B, max_len): False at padding slots
        self.next_positions = positions[:, -1] + 1  # (B,)
        return prefill(self.model, idx, self.cache, positions=positions, key_mask=self.key_mask)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens (B,) (already added to self.rows) and return the next logits (B, V)."""
        if self.cache.pos >= self.cache.max_len:  # full: keep the last window_keep tokens
            return self.start([r[-self.window_keep :] for r in self.rows])
        logits = self.step_fn(self.model, tokens, self.cache, positions=self.next_positions, key_mask=self.key_mask)
        self.next_positions = self.next_positions + 1
        return logits


def _prepare_prompts(idx, num_samples: int, bos_id: int | None, vocab_size: int, block_size: int):
    """Validate prompts; return them as id lists, each repeated num_samples times, cropped to block_size."""
    if isinstance(idx, torch.Tensor):
        if idx.dim() == 1:
            idx = idx[None]
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be a (B, T) integer tensor, got {tuple(idx.shape)} {idx.dtype}")
        rows = idx.tolist()
    elif isinstance(idx, Sequence) and all(isinstance(r, Sequence) for r in idx) and len(idx) > 0:
        rows = [list(r) for r in idx]
    else:
        raise ValueError("idx must be a (B, T) LongTensor or a non-empty list of token id lists")
    if not rows:
        raise ValueError("idx holds no prompts")
    for r in rows:
        for t in r:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"token id {t!r} outside the vocabulary [0, {vocab_size})")
    if any(not r for r in rows):
        if bos_id is None:
            raise ValueError("an empty prompt needs bos_id (or eos_id), e.g. <|endoftext|>, to start from")
        rows = [r or [bos_id] for r in rows]
    if any(len(r) > block_size for r in rows):
        log.warning("prompt of %d tokens is longer than block_size %d: keeping its last %d tokens",
                    max(len(r) for r in rows), block_size, block_size)  # fmt: skip
        rows = [r[-block_size:] for r in rows]
    return [list(r) for r in rows for _ in range(num_samples)]


def generate_tokens(
    model,
    idx,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_id: int | None = None,
    bos_id: int | None = None,
    generator: torch.Generator | int | None = None,
    num_samples: int = 1,
    window_keep: int | None = None,
    compiled_step=None,
) -> Iterator[torch.Tensor]:
    """Yield the new token of every row, (B * num_samples,), one step at a time; rows that have
    produced `eos_id` keep yielding `eos_id`, and the iterator ends once all have (or at max_new_tokens).
    Arguments as in `generate`."""
    validate_sampling(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens, num_samples=num_samples,
    )  # fmt: skip
    config = model.config
    bos_id = eos_id if bos_id is None else bos_id
    rows = _prepare_prompts(idx, num_samples, bos_id, config.vocab_size, config.block_size)
    keep = config.block_size * 3 // 4 if window_keep is None else window_keep
    if not 1 <= keep <= config.block_size:
        raise ValueError(f"window_keep must be in [1, block_size], got {keep}")
    device, _ = model_device_dtype(model)
    if isinstance(generator, int):
        generator = torch.Generator(device=device).manual_seed(generator)
    decoder = _Decoder(model, rows, max_new_tokens, keep, compiled_step)
    seen = seen_tokens(rows, config.vocab_size, device) if repetition_penalty != 1.0 else None
    finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
    logits = decoder.start(rows)
    for step in range(max_new_tokens):
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, repetition_penalty)
        tokens = sample_next(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=generator
        )
        if eos_id is not None:
            tokens = tokens.masked_fill(finished, eos_id)
            finished |= tokens == eos_id
        yield tokens
        if step == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
            return
        if seen is not None:
            seen.scatter_(1, tokens[:, None], True)
        for r, t in zip(rows, tokens.tolist(), strict=True):
            r.append(t)
        logits = decoder.step(tokens)


@torch.no_grad()
def generate(
    model,
    idx,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_id: int | None = None,
    bos_id: int | None = None,
    generator: torch.Generator | int | None = None,
    num_samples: int = 1,
    window_keep: int | None = None,
    compiled_step=None,
):
    """Continue token-id prompts with a KV cache.

    idx: a (B, T) LongTensor, or a list of id lists of different lengths (left-padded inside,
    with per-row position ids and padding masked out of attention). An empty prompt starts from
    `bos_id` (default: eos_id), e.g. <|endoftext|>. `temperature=0` is greedy; top_k, top_p
    (nucleus), min_p and repetition_penalty are off by default. `generator` (a torch.Generator
    or an int seed) makes sampling reproducible. Each prompt gets `num_samples` continuations
    (rows prompt-major). Stops early only when every row has produced `eos_id`.

    Returns the prompts plus the new tokens: a (B * num_samples, T + new) LongTensor for tensor
    input (rows that ended early are filled with eos_id), a list of id lists for list input
    (each ending at its eos_id, included). See the module docstring for contexts longer than
    block_size and `compiled_step` (a compiled `decode_step`).
    """
    was_training = model.training
    model.eval()
    try:
        steps = list(
            generate_tokens(
                model, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, eos_id=eos_id, bos_id=bos_id, generator=generator,
                num_samples=num_samples, window_keep=window_keep, compiled_step=compiled_step,
            )
        )  # fmt: skip
    finally:
        model.train(was_training)
    new = torch.stack(steps, dim=1)  # (B * num_samples, new)
    if isinstance(idx, torch.Tensor):
        prompt = idx if idx.dim() == 2 else idx[None]
        prompt = prompt.repeat_interleave(num_samples, dim=0)
        return torch.cat([prompt, new.to(prompt.device, prompt.dtype)], dim=1)
    out = []
    for i, row in enumerate(new.tolist()):
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        out.append(list(idx[i // num_samples]) + row)
    return out


# ---------------------------------------------------------------------------------------------
# Text


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text could be the start of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def stream_text(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    stop: str | Sequence[str] | None = None,
    stop_at_eos: bool = True,
    **sampling,
) -> Iterator[str]:
    """Yield the continuation of `prompt` piece by piece as it is generated.

    Every piece is valid UTF-8 text: bytes of a character split across tokens are held until the
    character is complete. Generation ends at the tokenizer's end-of-text token (unless
    stop_at_eos=False), at the first of the `stop` strings (not included in the output), or at
    max_new_tokens. `sampling` takes generate's keywords (temperature, top_k, top_p, min_p,
    repetition_penalty, generator, window_keep, compiled_step).
    """
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    if "num_samples" in sampling or "eos_id" in sampling:
        raise ValueError("stream_text makes one continuation and takes the end-of-text token from the tokenizer")
    ids = tokenizer.encode(prompt)
    eos_id = tokenizer.eot_token if stop_at_eos else None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, emitted = "", 0
    tokens = generate_tokens(model, [ids], max_new_tokens, eos_id=eos_id, bos_id=tokenizer.eot_token, **sampling)
    for step in tokens:
        token = int(step[0])
        if token == eos_id:
            break
        text += decoder.decode(tokenizer.decode_bytes([token]))
        hits = [i for i in (text.find(s, emitted) for s in stops) if i >= 0]
        if hits:
            if min(hits) > emitted:
                yield text[emitted : min(hits)]
            return
        safe = len(text) - held_back(text, stops)
        if safe > emitted:
            yield text[emitted:safe]
            emitted = safe
    text += decoder.decode(b"", final=True)
    if len(text) > emitted:
        yield text[emitted:]


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, *, stop=None, **kwargs) -> str:
    """The continuation of `prompt` as one string (see `stream_text` for the arguments)."""
    return "".join(stream_text(model, tokenizer, prompt, max_new_tokens, stop=stop, **kwargs))
