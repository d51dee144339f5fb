"""Dynamic batching: requests join and leave a shared decode batch between steps.

One worker thread owns the model's decode loop. A request is a *group* of `num_samples` rows
that is admitted, decoded and retired as a unit, sampled by its own `gptlab.generation.TokenSampler`
(the sampling step `generate` runs, with the request's own generator); so its tokens equal
`generate(model, [prompt], sampling=params, eos_id=...)` whatever else is in the batch (up to
float32 noise in the logits).

The KV cache (`BatchCache`) has one write position `pos` shared by all rows, as `gptlab.kv_cache.KVCache`
wants. Every row's keys are right-aligned: row r occupies slots [pos - length_r, pos), and
`key_mask` is True exactly there, so rows of different lengths decode together with per-row
position ids. A joining prompt of T tokens is prefilled straight into its slots [pos - T, pos)
(the cache is shifted right first when pos < T); when pos reaches the end, the cache is shifted
left over the slots no row uses. Rows of active groups stay packed at the front, so a step runs
exactly as many rows as are active.

Speculative requests (a per-request `prompt_lookup`, or every request a server with a draft model
can speculate on) do not join the shared batch: each runs `gptlab.speculative` over its own rows
and caches, one position per worker iteration, taking turns with the batch's steps. Rows that
accept different numbers of tokens need their own cache positions, which the right-aligned
shared cache does not have; within one request they have them (speculative.RowCache).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from gptlab import speculative
from gptlab.generation import TokenSampler, decode_step, model_device_dtype
from gptlab.kv_cache import KVCache
from gptlab.sampling import NonFiniteProbabilities, SamplingParams, check_finite

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The scheduler's waiting queue is at its bound (the server answers 429)."""


@dataclass
class GenerationRequest:
    """One prompt, how to decode it (`params`: its num_samples rows, max_new_tokens, ...), what to
    report, and the channel its events go back on.

    Events (tuples) are put on `events` from the worker thread through `loop`:
    ("prompt", index, [(logprob|None, top|None) per prompt token]),
    ("tokens", index, [(token, logprob|None, top|None) or None per row]) for each step (None for
    a row that already ended), and finally ("done", index, reason) with reason "length" (all
    max_new_tokens produced), "stop" (every row ended), "cancelled" or "error: ...".
    `top` is a list of (token, logprob).
    """

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    index: int = 0
    eos_id: int | None = None  # a row ends when it produces this token
    logprobs: int | None = None  # also report this many top alternatives per token (0: the chosen one only)
    prompt_logprobs: bool = False  # also score the prompt's own tokens (echo with logprobs)
    prompt_only: bool = False  # score the prompt and generate nothing (echo with max_tokens 0)
    prompt_lookup: int = 0  # speculative decoding by prompt lookup with n-grams of up to this many tokens
    cancelled: bool = False
    stopped_rows: set = field(default_factory=set)

    def cancel(self) -> None:
        """Stop generating (client gone, or an error); safe to call from any thread, any time."""
        self.cancelled = True

    def stop_row(self, row: int) -> None:
        """Row `row` needs no more tokens (a stop string was found); the group retires once all rows are stopped."""
        self.stopped_rows.add(row)

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


@dataclass
class _Group:
    """A request admitted to the batch: rows [start, start + n) of the cache."""

    request: GenerationRequest
    start: int
    sampler: TokenSampler  # the request's sampling state: seen tokens, finished rows, steps
    last: torch.Tensor  # (n,) the tokens to feed next
    error: str | None = None  # why its rows cannot go on (their logits were not finite): retired with it

    @property
    def n(self) -> int:
        return self.request.params.num_samples


@dataclass
class _Speculating:
    """A speculative request: its own decoding (gptlab.speculative), one position per worker iteration."""

    request: GenerationRequest
    steps: object  # speculative.generate_tokens: (n,) tokens per position
    finished: list[bool]  # per row: produced eos_id

    @property
    def n(self) -> int:
        return self.request.params.num_samples


def cache_view(cache: KVCache, rows: slice, pos: int) -> KVCache:
    """A KVCache over some rows of `cache`, sharing its storage, with its own write position."""
    view = KVCache.__new__(KVCache)
    view.layers = [(k[rows], v[rows]) for k, v in cache.layers]
    view.max_len = cache.max_len
    view.pos = pos
    return view


class BatchCache:
    """A (max_batch, nh, cache_len, hs) KV cache whose active rows are packed at the front and
    right-aligned at the shared write position `pos` (see the module docstring)."""

    def __init__(self, model, max_batch: int, cache_len: int):
        if cache_len < model.config.block_size:
            raise ValueError(f"cache_len {cache_len} must be at least block_size {model.config.block_size}")
        device, _ = model_device_dtype(model)
        self.model = model
        self.cache = KVCache.for_model(model, max_batch, cache_len)
        self.key_mask = torch.zeros(max_batch, cache_len, dtype=torch.bool, device=device)  # (B, L)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)  # (B,) tokens held per row
        self.rows = 0  # active rows, packed at [0, rows)
        self.pos = 0
        self.max_batch, self.cache_len = max_batch, cache_len
        self._step_views: dict[int, KVCache] = {}  # rows -> the view `step` runs on (see there)

    def _longest(self) -> int:
        return int(self.lengths[: self.rows].max()) if self.rows else 0

    def _shift(self, delta: int) -> None:
        """Move every active row's slots by delta (>0: right, <0: left); pos moves with them."""
        lo, hi, b = self.pos - self._longest(), self.pos, self.rows
        for k, v in self.cache.layers:
            for t in (k, v):
                t[:b, :, lo + delta : hi + delta] = t[:b, :, lo:hi].clone()  # (b, nh, span, hs)
        mask = self.key_mask[:b, lo:hi].clone()  # (b, span)
        self.key_mask[:b] = False
        self.key_mask[:b, lo + delta : hi + delta] = mask
        self.pos += delta

    def prefill(self, prompt: list[int], n: int, all_logits: bool) -> tuple[int, torch.Tensor]:
        """Place `prompt` in n new rows at the back of the batch; returns (first row, logits).

        logits: (T, V) for every prompt position when all_logits, else (1, V) for the last one."""
        T = len(prompt)
        if self.rows + n > self.max_batch:
            raise ValueError(f"no room for {n} rows: {self.rows} of {self.max_batch} in use")
        if self.rows == 0:
            self.pos = T
        elif self.pos < T:
            self._shift(T - self.pos)
        r = self.rows
        device = self.key_mask.device
        self.key_mask[r : r + n] = False
        self.key_mask[r : r + n, self.pos - T : self.pos] = True
        idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
        positions = torch.arange(T, device=device)[None]  # (1, T)
        view = cache_view(self.cache, slice(r, r + 1), self.pos - T)
        logits, _ = self.model(
            idx, positions=positions, kv_cache=view, key_mask=self.key_mask[r : r + 1], last_only=not all_logits
        )  # (1, T|1, V)
        for k, v in self.cache.layers:  # the other samples share the prompt's keys and values
            for t in (k, v):
                t[r + 1 : r + n, :, self.pos - T : self.pos] = t[r : r + 1, :, self.pos - T : self.pos]
        self.lengths[r : r + n] = T
        self.rows += n
        return r, logits[0]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per active row, tokens (rows,); returns the next logits (rows, V)."""
        b = self.rows
        if self.pos >= self.cache_len:  # full: drop the slots left of the longest row
            self._shift(self._longest() - self.pos)
        self.key_mask[:b, self.pos] = True
        # One view per row count, so the C step keeps its pointers and trusts the model's plan as
        # checked at its first step, until a prefill checks it again (gptlab.fused_step): a new view
        # each step checked both, ~0.2 ms of a 1.8 ms token (int4 GPT-2, AMD EPYC Zen 5).
        view = self._step_views.get(b)
        if view is None:
            view = self._step_views[b] = cache_view(self.cache, slice(0, b), self.pos)
        view.pos = self.pos
        positions = self.lengths[:b]  # (b,): each row's next position id
        logits = decode_step(self.model, tokens, view, positions=positions, key_mask=self.key_mask[:b])  # (b, V)
        self.pos += 1
        self.lengths[:b] += 1
        return logits

    def release(self, start: int, n: int) -> None:
        """Free rows [start, start + n), moving the rows after them down to keep the batch packed."""
        b = self.rows
        if start + n < b:
            lo = self.pos - int(self.lengths[start + n : b].max())
            for k, v in self.cache.layers:
                for t in (k, v):
                    t[start : b - n, :, lo : self.pos] = t[start + n : b, :, lo : self.pos].clone()
            self.key_mask[start : b - n] = self.key_mask[start + n : b].clone()
            self.lengths[start : b - n] = self.lengths[start + n : b].clone()
        self.key_mask[b - n : b] = False
        self.lengths[b - n : b] = 0
        self.rows -= n


class Scheduler:
    """Runs the decode loop in a worker thread; `submit` requests from the event loop.

    max_batch: rows decoded together (a request with n samples takes n rows); max_queue: requests
    waiting for rows, beyond which `submit` raises QueueFull; n_vocab: the tokenizer's vocabulary,
    the only ids drawn (default: the model's vocab_size).
    """

    def __init__(
        self, model, *, max_batch: int = 16, max_queue: int = 64, cache_len: int | None = None, draft_model=None,
        num_draft_tokens: int = 4, n_vocab: int | None = None,
    ):  # fmt: skip
        block = model.config.block_size
        self.model, self.n_vocab = model, n_vocab  # the tokenizer's ids: a padded head's others are never drawn
        speculative.check_speculation(model, draft_model, 0, num_draft_tokens)
        self.draft_model, self.num_draft_tokens = draft_model, num_draft_tokens
        self.speculating: list[_Speculating] = []
        self.max_batch, self.max_queue = max_batch, max_queue
        self.cache = BatchCache(model, max_batch, cache_len or block + max(16, block // 4))
        self.device, _ = model_device_dtype(model)
        self.waiting: deque[GenerationRequest] = deque()
        self.groups: list[_Group] = []
        self.stats = dict(completed=0, cancelled=0, steps=0, tokens=0, max_rows=0, speculative=0)
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- the event loop's side

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gptlab-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises QueueFull when max_queue requests already wait."""
        p, block = request.params, self.model.config.block_size
        # What is fed must fit: the last new token is never fed, nor a scored prompt's last token
        # (only a target), so either may sit one past the context.
        new = 0 if request.prompt_only else p.max_new_tokens
        fed = len(request.prompt) + new - 1
        if p.num_samples > self.max_batch:
            raise ValueError(f"num_samples={p.num_samples} exceeds the batch size {self.max_batch}")
        if not request.prompt or fed > block:
            raise ValueError(f"prompt of {len(request.prompt)} tokens + {new} new ones feeds {fed}, past the context {block}")  # fmt: skip
        with self._cond:
            if len(self.waiting) >= self.max_queue:  # first drop requests whose clients left
                for dropped in [r for r in self.waiting if r.cancelled]:
                    self._drop(dropped)
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_queue={self.max_queue})")
            self.waiting.append(request)
            self._cond.notify()

    def load(self) -> dict:
        """Active and waiting request counts, and running totals."""
        active = len(self.groups) + len(self.speculating)
        return dict(active=active, queued=len(self.waiting), rows=self._rows(), **self.stats)

    def speculates(self, request: GenerationRequest) -> bool:
        """Whether `request` runs speculatively: it asks for prompt lookup, or this server has a draft
        model and the request wants no logprobs (those come from the shared batch's plain steps)."""
        if request.prompt_lookup:
            return True
        wants_scores = request.logprobs is not None or request.prompt_logprobs or request.prompt_only
        return self.draft_model is not None and not wants_scores

    def _rows(self) -> int:
        return self.cache.rows + sum(s.n for s in self.speculating)

    # -- the worker thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._closing and not self.waiting and not self.groups and not self.speculating:
                    self._cond.wait()
                if self._closing:
                    break
            try:
                self._admit()
                if self.groups:
                    self._step()
                if self.speculating:
                    self._speculate()
            except Exception as e:  # never let one bad step kill the server: fail the batch, go on
                log.exception("decode step failed")
                for g in self.groups + self.speculating:
                    g.request.emit("done", g.request.index, f"error: {e}")
                self.groups, self.speculating = [], []
                self.cache = BatchCache(self.model, self.max_batch, self.cache.cache_len)
        with self._cond:  # shutting down: release everyone still waiting for events
            waiting, self.waiting = list(self.waiting), deque()
        for request in [g.request for g in self.groups + self.speculating] + waiting:
            request.emit("done", request.index, "cancelled")

    def _next_waiting(self) -> GenerationRequest | None:
        with self._cond:
            while self.waiting and self.waiting[0].cancelled:
                self._drop(self.waiting[0])
            if self.waiting and self._rows() + self.waiting[0].params.num_samples <= self.max_batch:
                return self.waiting.popleft()
        return None

    def _drop(self, request: GenerationRequest) -> None:
        """Take a cancelled request out of the queue (under _cond); it ends "cancelled", as one
        decoding does: its handler awaits that event (forever, had it none)."""
        self.waiting.remove(request)
        self.stats["cancelled"] += 1
        request.emit("done", request.index, "cancelled")

    def _admit(self) -> None:
        """Prefill waiting requests while there are free rows (first come, first served)."""
        while (request := self._next_waiting()) is not None:
            try:
                self._admit_one(request)
            except Exception as e:
                log.exception("prefill failed")
                request.emit("done", request.index, f"error: {e}")

    def _admit_one(self, request: GenerationRequest) -> None:
        if self.speculates(request):
            return self._admit_speculative(request)
        n, scored = request.params.num_samples, request.prompt_logprobs
        # Scoring only: the last token's logits would predict nothing asked for, so it is not fed.
        fed = request.prompt[:-1] if request.prompt_only and len(request.prompt) > 1 else request.prompt
        start, logits = self.cache.prefill(fed, n, all_logits=scored)  # (len(fed)|1, V)
        if scored:
            request.emit("prompt", request.index, self._prompt_scores(request.prompt, logits[: len(request.prompt) - 1], request.logprobs or 0))  # fmt: skip
        vocab = self.model.config.vocab_size
        generator = request.params.generator(self.device, fresh=True)  # unseeded: random, not the global RNG
        sampler = TokenSampler(request.params, [request.prompt] * n, vocab, self.device, eos_id=request.eos_id,
                               generator=generator, n_vocab=self.n_vocab)  # fmt: skip
        placeholder = torch.zeros(n, dtype=torch.long, device=self.device)
        group = _Group(request, start, sampler, last=placeholder)
        self.groups.append(group)
        if not request.prompt_only:
            self._sample_or_fail(group, logits[-1:].expand(n, -1))
        self.stats["max_rows"] = max(self.stats["max_rows"], self.cache.rows)
        self._retire_done()

    def _admit_speculative(self, request: GenerationRequest) -> None:
        if request.logprobs is not None or request.prompt_logprobs:
            raise ValueError("logprobs are not available with prompt_lookup (speculative decoding)")
        n = request.params.num_samples
        proposer = dict(prompt_lookup=request.prompt_lookup) if request.prompt_lookup else dict(draft_model=self.draft_model)  # fmt: skip
        steps = speculative.generate_tokens(
            self.model, [request.prompt] * n, request.params, eos_id=request.eos_id, num_draft_tokens=self.num_draft_tokens,
            generator=request.params.generator(self.device, fresh=True), n_vocab=self.n_vocab, **proposer,
        )  # fmt: skip
        self.speculating.append(_Speculating(request, steps, [False] * n))
        self.stats["speculative"] += 1

    def _speculate(self) -> None:
        """One position of every speculative request (a verification when its accepted run is used up)."""
        keep = []
        for s in self.speculating:
            request = s.request
            tokens = None if request.cancelled else next(s.steps, None)
            if tokens is not None:
                rows = []
                for i, t in enumerate(tokens.tolist()):
                    ended = s.finished[i] or i in request.stopped_rows
                    rows.append(None if ended else (t, None, None))
                    s.finished[i] = s.finished[i] or t == request.eos_id
                self.stats["tokens"] += sum(r is not None for r in rows)
                request.emit("tokens", request.index, rows)
            reason = self._end(request, s.finished, exhausted=tokens is None)
            if reason is None:
                keep.append(s)
        self.speculating = keep

    def _step(self) -> None:
        tokens = torch.cat([g.last for g in self.groups])  # (rows,)
        logits = self.cache.step(tokens)  # (rows, V)
        self.stats["steps"] += 1
        for g in self.groups:
            self._sample_or_fail(g, logits[g.start : g.start + g.n])
        self._retire_done()

    def _sample_or_fail(self, g: _Group, logits: torch.Tensor) -> None:
        """_sample, or the group's error where its logits are not finite: its own rows' (a float16
        overflow of one prompt), so the batch's other requests go on (all of them failed)."""
        try:
            self._sample(g, logits)
        except NonFiniteProbabilities as e:
            g.error = f"error: {e}"

    def _sample(self, g: _Group, logits: torch.Tensor) -> None:
        """Draw the group's next tokens from logits (n, V) with its TokenSampler; emit them."""
        request = g.request
        was_finished = g.sampler.finished.tolist()
        tokens = g.sampler.next_tokens(logits)  # (n,)
        g.last = tokens
        self.stats["tokens"] += was_finished.count(False)
        scores = self._token_scores(logits, tokens, request.logprobs) if request.logprobs is not None else None
        rows = []
        for i, t in enumerate(tokens.tolist()):
            if was_finished[i] or i in request.stopped_rows:
                rows.append(None)
            else:
                rows.append((t, *(scores[i] if scores else (None, None))))
        request.emit("tokens", request.index, rows)

    def _retire_done(self) -> None:
        keep = []
        for g in self.groups:
            request = g.request
            exhausted = request.prompt_only or g.sampler.steps >= request.params.max_new_tokens
            if g.error is not None:
                request.emit("done", request.index, g.error)
            elif self._end(request, g.sampler.finished.tolist(), exhausted=exhausted) is None:
                keep.append(g)
                continue
            self.cache.release(g.start, g.n)
            for other in self.groups:
                if other.start > g.start:
                    other.start -= g.n
        self.groups = keep

    def _end(self, request: GenerationRequest, finished: list[bool], *, exhausted: bool) -> str | None:
        """End `request` if it is over (emit "done", count it) and say why: "cancelled", "stop"
        (every row produced eos or hit a stop string) or "length" (`exhausted`); None if not over."""
        if request.cancelled:
            reason = "cancelled"
        elif all(f or i in request.stopped_rows for i, f in enumerate(finished)):
            reason = "stop"
        elif exhausted:
            reason = "length"
        else:
            return None
        self.stats["cancelled" if reason == "cancelled" else "completed"] += 1
        request.emit("done", request.index, reason)
        return reason

    @staticmethod
    def _token_scores(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[tuple[float, list]]:
        """(logprob of the chosen token, top-k [(token, logprob)]) per row, from the model's raw
        distribution (before temperature and the sampling filters, as OpenAI reports it)."""
        check_finite(logits)  # NaN logprobs are not JSON: the response failed as "internal error: ValueError"
        logp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
        chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
        if k:
            top_v, top_i = torch.topk(logp, k, dim=-1)  # (n, k)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(), top_v.tolist(), strict=True)]
        else:
            tops = [[] for _ in chosen]
        return list(zip(chosen, tops, strict=True))

    @staticmethod
    def _prompt_scores(prompt: list[int], logits: torch.Tensor, k: int) -> list[tuple]:
        """Scores of prompt tokens 1..T-1 given their prefixes, logits (T-1, V); token 0 has none."""
        if len(prompt) < 2:
            return [(None, None)]
        targets = torch.tensor(prompt[1:], device=logits.device)
        return [(None, None), *Scheduler._token_scores(logits, targets, k)]
