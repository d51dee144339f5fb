"""Speculative decoding: propose several tokens cheaply, check them all in one forward of the
model, keep what the model agrees with (Leviathan et al. 2023; Chen et al. 2023; issue 14).

Batch-1 decoding reads every weight once per token; a forward over k+1 tokens reads them once
too, so each accepted proposal is a token almost for free. Two proposers:

- **prompt lookup** (apoorvumang/prompt-lookup-decoding, transformers' `prompt_lookup_num_tokens`):
  the tokens that followed the latest earlier occurrence of the context's last n-gram, longest
  n <= N first. Grounded text (quotes, summaries, code edits) repeats its context.
- **a draft model**: a smaller gptlab model over the same vocabulary (`gpt2` for `gpt2-xl`),
  decoding k tokens with its own KV cache.

Exact. Row b's target distributions p_0..p_k come from one forward over its last token and k
proposals d_1..d_k, drawn from the proposer's q_0..q_{k-1}. Proposal i is accepted with
probability min(1, p_i(d)/q_i(d)); at the first rejection the token is drawn from
norm(max(0, p_i - q_i)), and when all k pass, from p_k. The tokens then follow p exactly
(Leviathan et al., Theorem 1). Prompt lookup is the case of a one-hot q. p and q are
`sampling.probabilities`, the distribution plain sampling draws from (one-hot at temperature 0,
where the rule reduces to "accept while the proposal is the argmax"), with the repetition
penalty seeing the proposals before each position.

Greedy identity holds up to floating point: a verification forward over k+1 rows and a one-token
decode step compute the same sums through different kernels (SDPA vs the C decode-attention,
another GEMM past kernels.MAX_ROWS rows), so logits differ in the last bits (~1e-6 relative,
measured in tests/test_speculative.py), which flips an argmax only on a near-exact tie.

Caches. `RowCache` lets rows of a batch advance by different numbers of tokens: one shared write
position, per-row position ids and a key mask (the left-padded batch's mechanism). Rejected
slots are rolled back by moving the write position back as far as every row allows and masking
the rest as holes; a batch of one never has holes. When the cache is full the rows are encoded
again from slot 0 (their last `window_keep` tokens past block_size, as generation does), which
also drops the holes.

Never much slower. `DraftLength` picks k from the recent acceptance rate with a cost model
(tokens per step over the step's cost); when no k > 0 pays it proposes nothing (plain decoding)
and probes k=1 again after 8, 16, ... 128 steps. On a CPU, k stays where the verification's rows
fit gptlab's kernels (`most_draft_tokens`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from gptlab import kernels
from gptlab.config import GPTConfig
from gptlab.kv_cache import KVCache, model_device_dtype
from gptlab.kv_cache import window_keep as window_keep_of
from gptlab.sampling import SamplingParams, draw, probabilities, sample_next, seen_tokens

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Proposers


class PromptLookup:
    """Proposes continuations of one row from its own history (prompt lookup decoding).

    Keeps an index token -> positions, so a proposal looks only at earlier occurrences of the
    last token (the latest `max_candidates` of them), not at the whole context.
    """

    def __init__(self, tokens: Sequence[int], max_ngram: int, max_candidates: int = 64):
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}
        self.max_ngram, self.max_candidates = max_ngram, max_candidates
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.where.setdefault(t, []).append(len(self.tokens))
            self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens: what followed the latest earlier occurrence of the longest matching
        suffix (n <= max_ngram tokens), continued periodically when that occurrence overlaps the
        end (a repeating loop); [] when the last token never occurred before."""
        toks, L = self.tokens, len(self.tokens)
        if k < 1 or L < 2:
            return []
        best_j, best_n = -1, 0
        for j in reversed(self.where.get(toks[-1], [])[:-1][-self.max_candidates :]):
            n = 1
            while n < self.max_ngram and j - n >= 0 and toks[j - n] == toks[L - 1 - n]:
                n += 1
            if n > best_n:
                best_j, best_n = j, n
                if n == self.max_ngram:
                    break
        if best_j < 0:
            return []
        out = toks[best_j + 1 : best_j + 1 + k]
        period = L - 1 - best_j
        while len(out) < k:  # the occurrence runs into the end: the text repeats with this period
            out.append(out[len(out) - period])
        return out


# ---------------------------------------------------------------------------------------------
# A KV cache whose rows advance by different numbers of tokens


class RowCache:
    """A model's KVCache for B rows that each feed and roll back their own number of tokens.

    `lengths[b]` is how many of row b's tokens the cache holds (also its next position id).
    Slots hold keys in feeding order; a slot no row-b query may see (left padding of a chunk,
    a rolled-back proposal under the shared write position) is False in `key_mask` (B, max_len).
    """

    def __init__(self, model, batch_size: int, max_len: int):
        device, _ = model_device_dtype(model)
        self.model, self.device = model, device
        self.cache = KVCache.for_model(model, batch_size, max_len)
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # (B, max_len)
        self.lengths = [0] * batch_size
        self.holes = False  # whether key_mask has a False slot below the write position

    @property
    def pos(self) -> int:
        return self.cache.pos

    @property
    def room(self) -> int:
        """Slots left to write before the cache is full."""
        return self.cache.max_len - self.cache.pos

    def reset(self) -> None:
        """Forget everything: the next feed writes from slot 0 at position 0."""
        self.cache.pos = 0
        self.key_mask.zero_()
        self.lengths = [0] * len(self.lengths)
        self.holes = False

    @torch.no_grad()
    def feed(self, chunks: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        """Append chunks[b] (lists of ids, lengths may differ, some may be empty) to row b.

        Returns logits (B, T, V), T = the longest chunk, each row's chunk right-aligned (row b's
        last token at -1), or (B, 1, V) for the last position only unless all_logits."""
        T = max(len(c) for c in chunks)
        pads = [T - len(c) for c in chunks]
        start = self.cache.pos
        ids = [[0] * p + list(c) for p, c in zip(pads, chunks, strict=True)]
        positions = [[0] * p + list(range(n, n + len(c))) for p, n, c in zip(pads, self.lengths, chunks, strict=True)]
        self.key_mask[:, start : start + T] = True
        for b, p in enumerate(pads):
            if p:
                self.key_mask[b, start : start + p] = False
                self.holes = True
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)  # (B, T)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # (B, T)
        key_mask = self.key_mask if self.holes else None  # None: the same kernels as plain decoding
        logits, _ = self.model(idx, kv_cache=self.cache, positions=pos, key_mask=key_mask, last_only=not all_logits)
        self.cache.advance(T)
        self.lengths = [n + len(c) for n, c in zip(self.lengths, chunks, strict=True)]
        return logits

    def rollback(self, rejected: Sequence[int]) -> None:
        """Drop the last rejected[b] tokens of each row b: the write position moves back by the
        smallest count; the rest of each row's rejected slots become holes."""
        back = min(rejected)
        self.cache.pos -= back
        top = self.cache.pos
        for b, r in enumerate(rejected):
            self.lengths[b] -= r
            if r > back:
                self.key_mask[b, top - (r - back) : top] = False
                self.holes = True


def encode_rows(cache: RowCache, rows: Sequence[Sequence[int]], window_keep: int, fits: int | None = None):
    """Encode each row but its last token into the emptied cache and return those last tokens
    ([[id], ...]), the chunks still to feed. When a row is longer than `fits` (default: the
    cache's length), every row keeps its last window_keep tokens (generation's sliding window)."""
    if max(len(r) for r in rows) > (fits or cache.cache.max_len):
        rows = [r[-window_keep:] for r in rows]
    cache.reset()
    if max(len(r) for r in rows) > 1:
        cache.feed([r[:-1] for r in rows])
    return [list(r[-1:]) for r in rows]


# ---------------------------------------------------------------------------------------------
# How many tokens to propose


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification yields when each proposal is accepted with probability alpha:
    1 + alpha + ... + alpha^k (Leviathan et al., eq. 1)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class DraftLength:
    """Chooses k, the tokens to propose next, from the recent acceptance rate.

    `cost` is the price of one more proposed token relative to a plain decode step (the extra
    row in the verification forward plus, for a draft model, its own step); k maximises
    expected_tokens(alpha, k) / (1 + cost * k). When k = 0 wins, decoding is plain and k=1 is
    probed again after `wait` steps, a wait that doubles (8 -> 128) while probes keep failing.
    """

    max_k: int
    cost: float = 0.1
    decay: float = 0.8  # weight of the past in the acceptance estimate, per verification
    hits: float = 2.0  # prior: about 2 of 3 accepted, so decoding starts by proposing
    trials: float = 3.0
    k: int = field(init=False)
    wait: int = 0
    backoff: int = 8

    def __post_init__(self):
        self.k = self.max_k

    @property
    def alpha(self) -> float:
        return self.hits / self.trials

    def next_k(self) -> int:
        if self.k > 0:
            return self.k
        if self.wait > 0:
            self.wait -= 1
            return 0
        return 1  # probe

    def update(self, proposed: list[int], accepted: list[int]) -> None:
        """Record one verification: per row, how many tokens were proposed and accepted."""
        if not any(proposed):
            return
        hits = sum(accepted)
        trials = sum(a + (a < p) for p, a in zip(proposed, accepted, strict=True) if p)
        self.hits = self.decay * self.hits + hits
        self.trials = self.decay * self.trials + trials
        best = max(range(self.max_k + 1), key=lambda k: expected_tokens(self.alpha, k) / (1 + self.cost * k))
        if best == 0:
            self.backoff = min(2 * self.backoff, 128) if self.k == 0 else 8
            self.wait = self.backoff
        self.k = best


# ---------------------------------------------------------------------------------------------
# Verification: the acceptance rule


def _seen_per_position(seen: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor | None:
    """seen (B, V) -> (B, k+1, V): position i also sees drafts[:, :i] (the repetition penalty)."""
    if seen is None:
        return None
    B, k = drafts.shape
    out = seen[:, None].repeat(1, k + 1, 1)  # (B, k+1, V)
    for i in range(k):
        out[:, i + 1 :].scatter_(2, drafts[:, i].view(B, 1, 1).expand(B, k - i, 1), True)
    return out


def accept_greedy(best: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule at temperature 0 (p one-hot): keep drafts while each is the target's argmax.

    best (B, k+1): the target's argmax after the last token and after each draft; drafts (B, k).
    Returns (accepted (B,) in 0..k, next token (B,)), as `accept`."""
    k = drafts.size(1)
    accepted = (drafts == best[:, :k]).long().cumprod(1).sum(1)  # (B,)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def accept(
    p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule over a batch (Leviathan et al. 2023, Algorithm 1).

    p (B, k+1, V): the target's distributions after the last token and after each draft; drafts
    (B, k); q (B, k, V): the distributions the drafts were drawn from, or None for deterministic
    proposals (a one-hot q: prompt lookup). Returns (accepted (B,) in 0..k, next token (B,)):
    the first accepted[b] drafts stand and the next token follows them.
    """
    B, k = drafts.shape
    rows = torch.arange(B, device=p.device)
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]  # (B, k)
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, drafts[..., None])[..., 0]  # (B, k)
    u = torch.rand(B, k, device=p.device, generator=generator)
    ok = u * q_d < p_d  # u < p/q without dividing (q_d > 0: the draft was drawn from q)
    accepted = ok.long().cumprod(1).sum(1)  # (B,)
    p_next = p[rows, accepted]  # (B, V)
    if q is None:  # norm(max(0, p - onehot(d))): p without the rejected draft
        residual = p_next.clone()
        stop = accepted < k
        residual[rows[stop], drafts[stop, accepted[stop]]] = 0.0
    else:
        q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, accepted]  # (B, V); all accepted: p itself
        residual = (p_next - q_next).clamp_(min=0.0)
    mass = residual.sum(-1, keepdim=True)  # (B, 1)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)  # p == q: any draw from p is right
    return accepted, draw(residual, generator)


def verify(logits, drafts, q, params: SamplingParams, seen, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted counts (B,) and next tokens (B,) from the target's logits (B, k+1, V) over each
    row's last token and its drafts (B, k)."""
    B, T, V = logits.shape
    seen = _seen_per_position(seen, drafts)  # (B, k+1, V) or None
    flat_seen = None if seen is None else seen.flatten(0, 1)
    if params.greedy:  # the argmax of plain decoding's own sample_next, no one-hot needed
        return accept_greedy(sample_next(logits.flatten(0, 1), params, seen=flat_seen).view(B, T), drafts)
    return accept(probabilities(logits.flatten(0, 1), params, flat_seen).view(B, T, V), drafts, q, generator)


# ---------------------------------------------------------------------------------------------
# The decoding loop


@dataclass
class SpeculationStats:
    """What a run did: verification forwards, tokens proposed and accepted, tokens produced."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0
    ks: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def record(self, k: int, proposed: list[int], accepted: list[int], new: list[list[int]]) -> None:
        self.steps += 1
        self.ks.append(k)
        self.proposed += sum(proposed)
        self.accepted += sum(accepted)
        self.tokens += sum(map(len, new))


class _Draft:
    """A draft model, its cache and its view of the rows: proposes k tokens per row."""

    def __init__(self, model, batch_size: int, max_len: int, n_vocab: int):
        self.model, self.n_vocab = model, n_vocab  # ids it may propose: [0, n_vocab)
        self.cache = RowCache(model, batch_size, max_len)
        self.keep = max_len * 3 // 4
        self.dropped = [0] * batch_size  # each row's tokens before the cache's window (cut at a re-encode)

    def propose(self, rows, k, params, seen, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts (B, k) and, when sampling, the distributions they were drawn from, q (B, k, V)."""
        cache = self.cache
        # What the cache lacks of each row: counted from the window's start, not the row's (from
        # the row's, once the window slid, every step's chunk outgrew the room and re-encoded)
        chunks = [r[d + n :] for r, d, n in zip(rows, self.dropped, cache.lengths, strict=True)]
        if max(map(len, chunks)) + k - 1 > cache.room:  # encode again; leave room for k - 1 more
            fits = cache.cache.max_len - k + 1
            chunks = encode_rows(cache, rows, min(self.keep, fits), fits)
            self.dropped = [len(r) - n - len(c) for r, n, c in zip(rows, cache.lengths, chunks, strict=True)]
        logits = cache.feed(chunks)[:, -1, : self.n_vocab]  # (B, n_vocab)
        seen = None if seen is None else seen.clone()
        drafts, qs = [], []
        for i in range(k):
            if params.greedy:
                d = sample_next(logits, params, seen=seen)  # (B,)
            else:
                qs.append(probabilities(logits, params, seen))  # (B, V)
                d = draw(qs[-1], generator)
            drafts.append(d)
            if seen is not None:
                seen.scatter_(1, d[:, None], True)
            if i < k - 1:
                logits = cache.feed([[t] for t in d.tolist()])[:, -1, : self.n_vocab]
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None

    def settle(self, kept: list[int], k: int) -> None:
        """Keep each row's first kept[b] drafts (-1: not even its last token) of the k - 1 the cache holds."""
        self.cache.rollback([k - 1 - min(n, k - 1) for n in kept])


def check_speculation(model, draft_model, prompt_lookup: int, num_draft_tokens: int) -> None:
    """Raise ValueError naming the first speculative-decoding setting that cannot work."""
    if isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) or prompt_lookup < 0:
        raise ValueError(f"prompt_lookup must be an integer >= 0 (0: off), got {prompt_lookup!r}")
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not 1 <= num_draft_tokens <= 32:
        raise ValueError(f"num_draft_tokens must be an integer in [1, 32], got {num_draft_tokens!r}")
    if draft_model is not None and prompt_lookup:
        raise ValueError("choose one proposer: draft_model or prompt_lookup, not both")
    if draft_model is None:
        return
    if not isinstance(getattr(draft_model, "config", None), GPTConfig):  # a spec string was an AttributeError
        raise ValueError(f"draft_model must be a loaded model (gptlab.load_model(spec)), got {type(draft_model).__name__}")  # fmt: skip
    if draft_model.config.num_labels:  # its head scores labels: it proposes no next token
        raise ValueError("the draft model is a sequence classifier, not a language model: it cannot propose tokens")
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_model.config.vocab_size}) differs from the model's "
            f"({model.config.vocab_size}): speculative decoding needs the same tokenizer"
        )
    if draft_model.config.block_size < 2 * (num_draft_tokens + 1):
        raise ValueError("the draft model's block_size must be at least 2 * (num_draft_tokens + 1)")


def proposal_cost(model, draft_model) -> float:
    """The price of one proposed token relative to a plain decode step: ~0.1 for its row in the
    verification forward (an estimate: the CPU kernels read each weight once for up to
    kernels.MAX_ROWS rows, so a row adds its arithmetic, 5-10% of a gpt2 step), plus a draft
    step, priced by the draft's share of the weights to read."""
    if draft_model is None:
        return 0.1
    return 0.1 + draft_model.num_params() / max(model.num_params(), 1)


def most_draft_tokens(num_draft_tokens: int, batch_size: int, device) -> int:
    """The adaptive k's ceiling: num_draft_tokens, lowered on a CPU with gptlab's kernels so the
    verification's B * (k+1) rows stay within kernels.MAX_ROWS, the fused step's limit; past
    them the modules run (a gpt2 forward of 9 rows took ~2.2x one of 8 when their linear layers
    went to torch's GEMM, measured under load). Left alone when even k=1 would not fit."""
    fits = kernels.MAX_ROWS // batch_size - 1
    if torch.device(device).type != "cpu" or fits < 1 or not kernels.available()[0]:
        return num_draft_tokens
    return min(num_draft_tokens, fits)


def decode(
    model,
    rows: list[list[int]],
    params: SamplingParams,
    *,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    window_keep: int | None = None,
    draft_model=None,
    prompt_lookup: int = 0,
    num_draft_tokens: int = 4,
    adaptive: bool = True,
    stats: SpeculationStats | None = None,
    n_vocab: int | None = None,
) -> Iterator[list[list[int]]]:
    """Speculative decoding of prompts `rows` (id lists; not modified; one longer than block_size
    keeps its last block_size tokens, as in generation), params.max_new_tokens new tokens each.

    Yields, per verification, each row's new tokens (1 to k+1 of them; [] once a row has ended
    at eos_id or max_new_tokens). `generator` draws (default: one seeded with params.seed);
    `window_keep` as in generation. `adaptive=False` always proposes
    num_draft_tokens (tests, benchmarks); `stats`, if given, is filled in as decoding goes.
    Only ids below `n_vocab` (the tokenizer's; default: all) are proposed and drawn, as in
    gptlab.generation.TokenSampler.
    """
    check_speculation(model, draft_model, prompt_lookup, num_draft_tokens)
    B, V, block = len(rows), model.config.vocab_size, model.config.block_size
    max_new, rows = params.max_new_tokens, [list(r[-block:]) for r in rows]  # generation's _prepare_prompts
    keep = window_keep_of(block, window_keep)  # as in generation (0 was taken as the default)
    stats = stats if stats is not None else SpeculationStats()
    target = RowCache(model, B, min(block, max(map(len, rows)) + max_new))
    generator = generator if generator is not None else params.generator(target.device)
    draft, lookups = None, None
    if draft_model is not None:
        draft_len = min(draft_model.config.block_size, max(map(len, rows)) + max_new + num_draft_tokens)
        draft = _Draft(draft_model, B, draft_len, n_vocab)
    if prompt_lookup:
        lookups = [PromptLookup(r, prompt_lookup) for r in rows]
    control = DraftLength(most_draft_tokens(num_draft_tokens, B, target.device), cost=proposal_cost(model, draft_model))
    seen = seen_tokens(rows, V, target.device) if params.repetition_penalty != 1.0 else None
    n_vocab = V if n_vocab is None else min(n_vocab, V)
    real_seen = None if seen is None else seen[:, :n_vocab]  # (B, n_vocab): a view, updated with seen
    produced, done = [0] * B, [False] * B
    chunks = encode_rows(target, rows, keep)  # each row's last token, still to feed
    while not all(done):
        if target.room == 0:
            chunks = encode_rows(target, rows, keep)
        left = max(max_new - n for n, d in zip(produced, done, strict=True) if not d)
        k = max(0, min(control.next_k() if adaptive else num_draft_tokens, left - 1, target.room - 1))
        drafts, q, real = _propose(rows, k, lookups, draft, params, real_seen, generator, target.device)
        k = drafts.size(1)
        logits = target.feed([c + d for c, d in zip(chunks, drafts.tolist(), strict=True)], all_logits=True)
        accepted, extra = verify(logits[..., :n_vocab], drafts, q, params, real_seen, generator)
        new = _new_tokens(drafts, accepted, extra, produced, done, max_new, eos_id)
        target.rollback([k + 1 - len(t) for t in new])
        if draft is not None and k:
            draft.settle([len(t) - 1 for t in new], k)
        kept = [min(int(a), r) for a, r in zip(accepted, real, strict=True)]
        control.update(real, kept)
        for b, t in enumerate(new):
            rows[b] += t
            produced[b] += len(t)
            if lookups is not None:
                lookups[b].extend(t)
            if seen is not None and t:
                seen[b, t] = True
        chunks = [r[-1:] if t else c for r, t, c in zip(rows, new, chunks, strict=True)]
        stats.record(k, real, kept, new)
        yield new


def _propose(rows, k, lookups, draft, params, seen, generator, device):
    """drafts (B, k') long, q (B, k', V) or None, and each row's count of real proposals, k' <= k:
    0 when no row has one; a lookup row with fewer repeats its last proposal (it is verified
    like any other: any deterministic proposal keeps decoding exact)."""
    B = len(rows)
    if k == 0:
        return torch.zeros(B, 0, dtype=torch.long, device=device), None, [0] * B
    if draft is not None:
        drafts, q = draft.propose(rows, k, params, seen, generator)
        return drafts, q, [k] * B
    found = [lookup.propose(k) for lookup in lookups]
    width = max(map(len, found))
    padded = [f + [f[-1] if f else r[-1]] * (width - len(f)) for f, r in zip(found, rows, strict=True)]
    return torch.tensor(padded, dtype=torch.long, device=device).view(B, width), None, [len(f) for f in found]


def _new_tokens(drafts, accepted, extra, produced, done, max_new_tokens, eos_id) -> list[list[int]]:
    """Each row's accepted drafts plus the next token, cut after eos_id and at max_new_tokens;
    rows that end are marked in `done`, rows that had ended get []."""
    new = []
    for b, (d, a, x) in enumerate(zip(drafts.tolist(), accepted.tolist(), extra.tolist(), strict=True)):
        if done[b]:
            new.append([])
            continue
        t = (d[:a] + [x])[: max_new_tokens - produced[b]]
        if eos_id is not None and eos_id in t:
            t = t[: t.index(eos_id) + 1]
            done[b] = True
        done[b] = done[b] or produced[b] + len(t) >= max_new_tokens
        new.append(t)
    return new


def generate_tokens(
    model, rows: list[list[int]], params: SamplingParams, *, eos_id=None, **kwargs
) -> Iterator[torch.Tensor]:
    """`decode` regrouped as plain decoding yields: every row's next token, (B,), one position at
    a time; rows that ended at eos_id keep yielding eos_id. Keywords as `decode`."""
    B, device = len(rows), model_device_dtype(model)[0]
    queued: list[list[int]] = [[] for _ in range(B)]
    ended = [False] * B
    for new in decode(model, rows, params, eos_id=eos_id, **kwargs):
        for b, t in enumerate(new):
            queued[b] += t
        while not all(ended) and all(q or e for q, e in zip(queued, ended, strict=True)):
            step = [q.pop(0) if q else eos_id for q in queued]
            ended = [e or t == eos_id for e, t in zip(ended, step, strict=True)]
            yield torch.tensor(step, dtype=torch.long, device=device)
    while any(queued):  # rows that ended at eos wait for the others
        yield torch.tensor([q.pop(0) if q else eos_id for q in queued], dtype=torch.long, device=device)
