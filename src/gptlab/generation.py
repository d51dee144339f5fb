"""Text generation: a KV cache filled by one prefill, one-token decode steps, the decode engine's
sampling step, and streaming text that never splits a UTF-8 character.

The pieces a serving loop needs are public and independent: `new_cache`/`prefill`/`decode_step`
over a `KVCache`, `TokenSampler` (one decode step's sampling for rows that share a
`SamplingParams`: repetition penalty, the draw, end-of-text) and `TextDecoder` (token ids to
text: UTF-8 hold-back and stop strings). `generate` (token ids) and `generate_text`/`stream_text`
(strings) run them over one batch to completion; the server's scheduler
(`gptlab.serve.scheduler`) runs the same two over a batch that requests join and leave.

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
import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence

import torch

from gptlab import compile_cache, fused_step, hooks, speculative
from gptlab.kv_cache import KVCache, model_device_dtype
from gptlab.kv_cache import window_keep as window_keep_of
from gptlab.sampling import SamplingParams, sample_next, seen_tokens

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The cache: prefill and one-token decode steps


def new_cache(model, batch_size: int, max_len: int) -> KVCache:
    """A KV cache for `batch_size` rows of up to `max_len` tokens, on the model's device, in
    gptlab.kv_cache.cache_dtype(model)."""
    if max_len > model.config.block_size:
        raise ValueError(f"cache length {max_len} exceeds block_size {model.config.block_size}")
    return KVCache.for_model(model, batch_size, max_len)


@torch.no_grad()
def prefill(model, idx: torch.Tensor, cache: KVCache, *, positions=None, key_mask=None) -> torch.Tensor:
    """Run the prompt idx (B, T) through the model into `cache` from slot cache.pos; returns the
    last position's logits (B, V). `positions` (B, T) and `key_mask` (B, max_len) describe left padding."""
    cache.check_room(idx.size(0), idx.size(1))
    logits, _ = model(idx, kv_cache=cache, positions=positions, key_mask=key_mask, last_only=True)
    cache.advance(idx.size(1))
    return logits[:, -1]  # (B, V)


def _next_logits(model, tokens, cache, positions, key_mask):
    """One decode forward: tokens (B,) at slot cache.pos -> logits (B, V); does not advance the cache."""
    pos = positions[:, None] if positions is not None else None  # (B, 1)
    logits, _ = model(tokens[:, None], kv_cache=cache, positions=pos, key_mask=key_mask, last_only=True)
    return logits[:, -1]  # (B, V)


def decode_step(model, tokens: torch.Tensor, cache: KVCache, *, positions=None, key_mask=None) -> torch.Tensor:
    """Feed one new token per row, tokens (B,), at slot cache.pos; returns the next logits (B, V),
    without autograd. `positions` (B,) are the rows' position ids (needed with left padding)."""
    cache.check_room(tokens.size(0), 1)
    logits = fused_step.decode(model, tokens, positions, cache, key_mask)  # (B, V): one C call, or None
    if logits is None:
        with torch.no_grad():
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
    per batch size compiles (tens of seconds); later calls reuse the graph. A step with forward
    hooks registered on the model's modules (gptlab's hook points, or torch's own) is a ValueError:
    the graph was traced without them and would skip them (or fail to trace them); decode without
    `compiled_step` to run hooks.
    """

    def forward(tokens, cache, positions, key_mask):
        return _next_logits(model, tokens, cache, positions, key_mask)

    compile_cache.use()  # this CPU's own builds (see there)
    compiled = torch.compile(forward, fullgraph=True, dynamic=None, mode=mode)
    # every module's hook dicts, read each step (~350 for GPT-2 small, without walking the modules)
    hook_dicts = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]

    @torch.no_grad()
    def step(step_model, tokens, cache, *, positions=None, key_mask=None):
        if step_model is not model:
            raise ValueError("this compiled decode step was built for another model")
        if any(hook_dicts):
            raise ValueError("the model has forward hooks registered: a compiled decode step runs without them; decode without compiled_step")  # fmt: skip
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
# The decode engine: sampling settings, the sampling step, the loop


def sampling_params(
    sampling: SamplingParams | None = None, max_new_tokens: int | None = None, **fields
) -> SamplingParams:
    """The SamplingParams of a call: `sampling` (default: SamplingParams()) with every keyword
    field that is not at its default (and max_new_tokens unless None) put in its place."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(
            f"unknown sampling setting(s) {', '.join(unknown)}; SamplingParams has {', '.join(sorted(names))}"
        )
    changed = {k: v for k, v in fields.items() if not _is_default(k, v)}
    if max_new_tokens is not None:
        changed["max_new_tokens"] = max_new_tokens
    if sampling is None:
        return SamplingParams(**changed)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    return dataclasses.replace(sampling, **changed) if changed else sampling


def _is_default(name: str, value) -> bool:
    default = getattr(SamplingParams, name)
    return value is default or (type(value) is type(default) and value == default)


class TokenSampler:
    """The sampling half of a decode step, for rows that share one SamplingParams.

    Each step draws the rows' next tokens from their logits (repetition penalty over the tokens
    each row has seen, temperature, filters), keeps a row that produced `eos_id` on `eos_id`, and
    counts steps. `n_vocab` (the tokenizer's vocabulary; default: every id of `vocab_size`) keeps
    the draws to real tokens: a head padded to a multiple (`vocab_multiple`, nanoGPT's 50,304 rows
    for GPT-2's 50,257) has rows no tokenizer can decode. `generate` runs one over its whole batch;
    the server's scheduler one per request, so a request's tokens are the same whatever else is in
    the batch.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompts: list[list[int]],
        vocab_size: int,
        device,
        *,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        n_vocab: int | None = None,
    ):
        self.params, self.eos_id = params, eos_id
        self.n_vocab = vocab_size if n_vocab is None else min(n_vocab, vocab_size)
        self.generator = generator if generator is not None else params.generator(device)
        penalised = params.repetition_penalty != 1.0
        self.seen = seen_tokens(prompts, vocab_size, device) if penalised else None  # (n, V)
        self.finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)  # (n,) produced eos_id
        self.steps = 0

    def next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows' next tokens (n,) from their logits (n, V)."""
        seen = self.seen
        if self.n_vocab < logits.size(-1):  # a padded head: (n, n_vocab) views, one row's contiguous (no copy)
            logits, seen = logits[:, : self.n_vocab], None if seen is None else seen[:, : self.n_vocab]
        tokens = sample_next(logits, self.params, seen=seen, generator=self.generator)  # (n,)
        if self.eos_id is not None:
            tokens = tokens.masked_fill(self.finished, self.eos_id)
            self.finished |= tokens == self.eos_id
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)
        self.steps += 1
        return tokens

    @property
    def done(self) -> bool:
        """max_new_tokens steps taken, or every row has produced eos_id."""
        if self.steps >= self.params.max_new_tokens:
            return True
        return self.eos_id is not None and bool(self.finished.all())


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
        self.next_positions = None if mask is None else positions[:, -1] + 1  # (B,); None: the slots
        return prefill(self.model, idx, self.cache, positions=positions, key_mask=self.key_mask)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens (B,) (already added to self.rows) and return the next logits (B, V)."""
        if self.cache.pos >= self.cache.max_len:  # full: keep the last window_keep tokens
            return self.start([r[-self.window_keep :] for r in self.rows])
        logits = self.step_fn(self.model, tokens, self.cache, positions=self.next_positions, key_mask=self.key_mask)
        if self.next_positions is not None:
            self.next_positions = self.next_positions + 1
        return logits


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_id(t, vocab_size: int, what: str) -> int:
    """t as an int id of the vocabulary (numpy's integers included), else a ValueError."""
    if isinstance(t, bool) or not hasattr(t, "__index__") or isinstance(t, torch.Tensor | float):
        raise ValueError(f"{what} {t!r} is not an integer")
    if not 0 <= int(t) < vocab_size:
        raise ValueError(f"{what} {int(t)} outside the vocabulary [0, {vocab_size})")
    return int(t)


def _prepare_prompts(idx, num_samples: int, bos_id: int | None, vocab_size: int, block_size: int):
    """Validate prompts; return them as id lists, each repeated num_samples times, cropped to block_size."""
    if isinstance(idx, torch.Tensor):
        if idx.dim() == 1:
            idx = idx[None]
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be a (B, T) integer tensor, got {tuple(idx.shape)} {idx.dtype}")
        rows = idx.tolist()
    elif isinstance(idx, str) or (isinstance(idx, Sequence) and any(isinstance(r, str) for r in idx)):
        raise ValueError("idx is text, and generate takes token ids: encode it first (tokenizer.encode), "
                         "or call generate_text(model, tokenizer, prompt, ...)")  # fmt: skip
    elif isinstance(idx, Sequence) and all(isinstance(r, Sequence) for r in idx) and len(idx) > 0:
        rows = [list(r) for r in idx]
    else:
        raise ValueError("idx must be a (B, T) LongTensor or a non-empty list of token id lists")
    if not rows:
        raise ValueError("idx holds no prompts")
    rows = [[_token_id(t, vocab_size, "token id") for t in r] for r in rows]  # numpy integers as ints
    if bos_id is not None:
        _token_id(bos_id, vocab_size, "bos_id")
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
    params: SamplingParams,
    *,
    eos_id: int | None = None,
    bos_id: int | None = None,
    generator: torch.Generator | None = None,
    window_keep: int | None = None,
    compiled_step=None,
    draft_model=None,
    prompt_lookup: int = 0,
    num_draft_tokens: int = 4,
    feed_last: bool = False,
    n_vocab: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the new token of every row, (B * num_samples,), one step at a time; rows that have
    produced `eos_id` keep yielding `eos_id`, and the iterator ends once all have (or after
    params.max_new_tokens steps). Arguments as in `generate`; `feed_last` also runs the model on
    the last tokens (for hooks that read their activations: generate's cache_names)."""
    config = model.config
    if eos_id is not None:  # one past the vocabulary never stops anything
        _token_id(eos_id, model.config.vocab_size, "eos_id")
    bos_id = eos_id if bos_id is None else bos_id
    if n_vocab is not None and not (_is_int(n_vocab) and 1 <= n_vocab <= config.vocab_size):
        raise ValueError(f"n_vocab must be an integer in [1, {config.vocab_size}], got {n_vocab!r}")
    vocab = config.vocab_size if n_vocab is None else n_vocab  # prompt ids, too, are the tokenizer's
    rows = _prepare_prompts(idx, params.num_samples, bos_id, vocab, config.block_size)
    keep = window_keep_of(config.block_size, window_keep)
    if draft_model is not None or prompt_lookup:  # speculative decoding: gptlab.speculative
        if compiled_step is not None:
            raise ValueError("compiled_step does not apply to speculative decoding (draft_model, prompt_lookup)")
        yield from speculative.generate_tokens(model, rows, params, eos_id=eos_id, generator=generator, window_keep=keep,
                                               draft_model=draft_model, prompt_lookup=prompt_lookup,
                                               num_draft_tokens=num_draft_tokens, n_vocab=n_vocab)  # fmt: skip
        return
    device, _ = model_device_dtype(model)
    decoder = _Decoder(model, rows, params.max_new_tokens + feed_last, keep, compiled_step)
    sampler = TokenSampler(params, rows, config.vocab_size, device, eos_id=eos_id, generator=generator, n_vocab=n_vocab)
    logits = decoder.start(rows)
    while True:
        tokens = sampler.next_tokens(logits)
        yield tokens
        if sampler.done:
            if feed_last:
                decoder.step(tokens)
            return
        for r, t in zip(rows, tokens.tolist(), strict=True):
            r.append(t)
        logits = decoder.step(tokens)


def _generator_and_seed(generator, seed):
    """generate's `generator` may be an int seed (the older spelling of `seed`)."""
    if isinstance(generator, int) and not isinstance(generator, bool):
        if seed is not None:
            raise ValueError("give the seed once: seed=... (generator= takes a torch.Generator)")
        return None, generator
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return generator, seed


@torch.no_grad()
def generate(
    model,
    idx,
    max_new_tokens: int | None = None,
    *,
    sampling: SamplingParams | None = None,
    temperature: float = SamplingParams.temperature,
    top_k: int = SamplingParams.top_k,
    top_p: float = SamplingParams.top_p,
    min_p: float = SamplingParams.min_p,
    repetition_penalty: float = SamplingParams.repetition_penalty,
    seed: int | None = SamplingParams.seed,
    num_samples: int = SamplingParams.num_samples,
    eos_id: int | None = None,
    bos_id: int | None = None,
    generator: torch.Generator | None = None,
    window_keep: int | None = None,
    compiled_step=None,
    draft_model=None,
    prompt_lookup: int = 0,
    num_draft_tokens: int = 4,
    cache_names=None,
    n_vocab: int | None = None,
):
    """Continue token-id prompts with a KV cache.

    idx: a (B, T) LongTensor, or a list of id lists of different lengths (left-padded inside,
    with per-row position ids and padding masked out of attention). An empty prompt starts from
    `bos_id` (default: eos_id), e.g. <|endoftext|>. Stops early only when every row has produced
    `eos_id`.

    How to sample is a `SamplingParams`: pass `sampling=`, or its fields as keywords
    (max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, num_samples:
    their defaults are SamplingParams' own, all filters off); keywords not at their default
    override sampling's fields. `temperature=0` is greedy; `seed` makes sampling reproducible, as
    does `generator`, a torch.Generator to draw with (it replaces the seed's). Each prompt gets
    `num_samples` continuations (rows prompt-major). Stop strings need text: see `stream_text`.
    `n_vocab` (the tokenizer's `n_vocab`; default: the model's `vocab_size`) draws only ids below
    it: a model trained with `vocab_multiple` has head rows past the tokenizer's vocabulary.

    Returns the prompts plus the new tokens: a (B * num_samples, T + new) LongTensor for tensor
    input (rows that ended early are filled with eos_id), a list of id lists for list input
    (each ending at its eos_id, included). See the module docstring for contexts longer than
    block_size and `compiled_step` (a compiled `decode_step`).

    Speculative decoding (gptlab.speculative; same tokens at temperature 0, same distribution
    when sampling): `prompt_lookup=N` proposes what followed the last n-gram (n <= N) earlier in
    the context; `draft_model`, a smaller model over the same vocabulary, proposes by decoding;
    up to `num_draft_tokens` per verification, fewer when they are rejected.

    `cache_names` (hook point names or a predicate, gptlab.hooks) also returns, per row, the
    activations at every token of the returned sequence: (output, [{name: tensor}]), each tensor
    (T_row, ...) (attention patterns (heads, T_row, T_row)), padding removed, as a full forward
    over the row would give them.
    """
    generator, seed = _generator_and_seed(generator, seed)
    params = sampling_params(sampling, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, num_samples=num_samples)  # fmt: skip
    if params.stop:
        raise ValueError("stop strings need text: use generate_text or stream_text with a tokenizer")
    recorder = contextlib.nullcontext({})
    if cache_names is not None:
        if draft_model is not None or prompt_lookup or compiled_step is not None:
            raise ValueError("cache_names runs plain decoding: no draft_model, prompt_lookup or compiled_step")
        bos = eos_id if bos_id is None else bos_id
        fed = _prepare_prompts(idx, params.num_samples, bos, model.config.vocab_size, model.config.block_size)  # as fed
        longest = max(len(r) for r in fed)
        if longest + params.max_new_tokens > model.config.block_size:
            raise ValueError(f"cache_names needs prompt + max_new_tokens <= block_size {model.config.block_size} "
                             f"(got {longest} + {params.max_new_tokens}): a refilled cache would repeat positions")  # fmt: skip
        recorder = hooks.recording(model, cache_names)
    with evaluating(model), recorder as records:
        steps = list(generate_tokens(model, idx, params, eos_id=eos_id, bos_id=bos_id, generator=generator,
                                     window_keep=window_keep, compiled_step=compiled_step,
                                     draft_model=draft_model, prompt_lookup=prompt_lookup,
                                     num_draft_tokens=num_draft_tokens, feed_last=cache_names is not None,
                                     n_vocab=n_vocab))  # fmt: skip
    new = torch.stack(steps, dim=1)  # (B * num_samples, new)
    out = _with_prompts(idx, new, params.num_samples, eos_id)
    if cache_names is None:
        return out
    n = params.num_samples
    added = (
        [len(o) - len(idx[i // n]) for i, o in enumerate(out)] if isinstance(out, list) else [new.size(1)] * len(fed)
    )
    return out, hooks.per_row(records, [len(p) for p in fed], [len(p) + k for p, k in zip(fed, added, strict=True)])


def _with_prompts(idx, new: torch.Tensor, n: int, eos_id: int | None):
    """generate's output: the prompts (each repeated n times) followed by their new tokens."""
    if isinstance(idx, torch.Tensor):
        prompt = idx if idx.dim() == 2 else idx[None]
        prompt = prompt.repeat_interleave(n, dim=0)
        return torch.cat([prompt, new.to(prompt.device, prompt.dtype)], dim=1)
    out = []
    for i, row in enumerate(new.tolist()):
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        out.append(list(idx[i // n]) + row)
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


@contextlib.contextmanager
def evaluating(model):
    """The model in eval mode (no dropout) inside, its own mode restored after: generating from a
    model in training, as a training loop samples, must not sample through dropout."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class TextDecoder:
    """Token ids in, text out, piece by piece, for one continuation.

    Bytes of a UTF-8 character split across tokens are held until the character is complete, and
    so is any tail that could begin a stop string; the first stop string found ends the text
    (`stopped`), without it. `stream_text` and the server's completions both decode with it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stop)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # decoded so far; cut before the stop string once one is found
        self.emitted = 0  # characters of text already returned
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one generated token; returns the text now safe to show (often '')."""
        if self.stopped:
            return ""
        self.text += self._utf8.decode(self.tokenizer.decode_bytes([token]))
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._take(len(self.text))
        # Only text not yet shown can begin a stop string (what was shown could begin none), so
        # the hold-back looks at that alone: over the whole text, long stop strings cost each
        # token the square of the text's length.
        return self._take(len(self.text) - held_back(self.text[self.emitted :], self.stops))

    def finish(self) -> str:
        """Generation ended (no stop string found): the rest, a cut-off character as U+FFFD."""
        if not self.stopped:
            self.text += self._utf8.decode(b"", final=True)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        piece = self.text[self.emitted : max(upto, self.emitted)]
        self.emitted = max(upto, self.emitted)
        return piece


def stream_text(
    model,
    tokenizer,
    prompt: str | list[int],
    max_new_tokens: int | None = None,
    *,
    sampling: SamplingParams | None = None,
    stop_at_eos: bool = True,
    generator: torch.Generator | None = None,
    window_keep: int | None = None,
    compiled_step=None,
    draft_model=None,
    prompt_lookup: int = 0,
    num_draft_tokens: int = 4,
    **fields,
) -> Iterator[str]:
    """Yield the continuation of `prompt` (text, `<|endoftext|>` in it plain text as the
    tokenizer reads it, or token ids) piece by piece as it is generated.

    Every piece is valid UTF-8 text: bytes of a character split across tokens are held until the
    character is complete. Generation ends at the tokenizer's end-of-text token (unless
    stop_at_eos=False), at the first of the stop strings (not included in the output), or at
    max_new_tokens. Only the tokenizer's ids are drawn (a padded head's spare rows never are).
    `sampling` and the keyword `fields` (temperature, top_k, top_p, min_p,
    repetition_penalty, seed, stop) are as in `generate`, and so are `generator`, `window_keep`,
    `compiled_step` and speculative decoding's `draft_model`, `prompt_lookup` and
    `num_draft_tokens`; one continuation (num_samples 1).
    """
    generator, seed = _generator_and_seed(generator, fields.pop("seed", None))
    params = sampling_params(sampling, max_new_tokens, seed=seed, **fields)
    if params.num_samples != 1:
        raise ValueError("stream_text makes one continuation (num_samples=1); call it again for more")
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    eos_id = tokenizer.eot_token if stop_at_eos else None
    text = TextDecoder(tokenizer, params.stop)
    steps = generate_tokens(model, [ids], params, eos_id=eos_id, bos_id=tokenizer.eot_token, generator=generator,
                            window_keep=window_keep, compiled_step=compiled_step, draft_model=draft_model,
                            prompt_lookup=prompt_lookup, num_draft_tokens=num_draft_tokens,
                            n_vocab=tokenizer.n_vocab)  # fmt: skip
    with evaluating(model):  # until the last piece, or the caller stops reading
        for step in steps:
            token = int(step[0])
            if token == eos_id:
                break
            piece = text.add(token)
            if piece:
                yield piece
            if text.stopped:
                return
    piece = text.finish()
    if piece:
        yield piece


def generate_text(model, tokenizer, prompt: str | list[int], max_new_tokens: int | None = None, **kwargs) -> str:
    """The continuation of `prompt` as one string (see `stream_text` for the arguments)."""
    return "".join(stream_text(model, tokenizer, prompt, max_new_tokens, **kwargs))
