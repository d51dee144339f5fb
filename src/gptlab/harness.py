"""An lm-evaluation-harness backend: `import gptlab.harness` registers the model name `gptlab`
in this process (lm-eval's own `lm_eval` command does not import it: from a shell, use
`gptlab eval --harness TASKS`).

    import gptlab.harness, lm_eval
    lm_eval.simple_evaluate(model="gptlab", tasks=["lambada_openai"],
                            model_args="pretrained=SPEC,dtype=float32,batch_size=8,max_length=1024")

`pretrained` is any `--model` spec (with `adapter=DIR`, a PEFT LoRA directory on top) (`gptlab.loading.load_model`: gptlab checkpoints, quantized
models, Hugging Face directories or Hub ids, nanoGPT and llm.c files). Scoring follows lm-eval's
Hugging Face backend token for token, so the two agree on the same weights:
- loglikelihood: lm-eval splits context and continuation (TemplateLM._encode_pair; an empty
  context becomes the tokenizer's bos, <|endoftext|> for GPT-2's); each request is (context + continuation) left-truncated to
  max_length + 1 tokens, its last token dropped, scored in batches, longest first;
- loglikelihood_rolling: lm-eval's disjoint windows of max_length tokens after that bos;
- generate_until: greedy (or sampled with `do_sample`/`temperature`) through gptlab's one decode
  engine (`generation.generate_tokens`, so the C kernels), in batches of requests that share
  their settings, longest first, each stopping at <|endoftext|> or its first `until` string.

Text is tokenized as lm-eval's HF backend does with GPT-2's tokenizer: `<|endoftext|>` in the
text is the special token.
"""

from __future__ import annotations

import json

import lm_eval.models  # noqa: F401  (lm-eval's own backends first: it loads them only into an empty registry)
import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from tqdm import tqdm

from gptlab.chunked_loss import token_logprobs
from gptlab.generation import SamplingParams, TextDecoder, generate_tokens, sampling_params
from gptlab.loading import load_model, tokenizer_name
from gptlab.quantize import quantize_model
from gptlab.tokenizer import get_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default, where a task names no max_gen_toks
SAMPLING_KWARGS = ("top_k", "top_p", "min_p", "repetition_penalty", "seed")  # generation_kwargs taken as they are
# model_args lm-eval itself may add that mean nothing here: max_batch_size (simple_evaluate passes it;
# it bounds only an `auto` batch size, refused below) and trust_remote_code (its CLI's flag; no code is run)
UNUSED_MODEL_ARGS = ("max_batch_size", "trust_remote_code")


def _batch_size(value: int | str) -> int:
    """lm-eval's batch_size (an int, or a string from model_args or its CLI) as a count >= 1: 0
    failed inside range() and a negative one scored nothing (every result None)."""
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or isinstance(value, bool):
        raise ValueError(f"batch_size must be an integer >= 1, got {value!r} (--model gptlab does not search for "
                         "one as `auto` does: give it, e.g. 16)")  # fmt: skip
    return size


@register_model("gptlab")
class GptlabLM(TemplateLM):
    """lm-eval's view of one gptlab model (see the module docstring). `pretrained` is a `--model`
    spec or a GPT already loaded (moved to `device`, converted to `dtype` unless auto: in place);
    `quantize` (int8, int4) quantizes it after loading."""

    def __init__(self, pretrained, dtype: str = "auto", batch_size: int | str = 1, max_length: int | None = None,
                 device: str | None = None, quantize: str | None = None, adapter: str | None = None, **kwargs):  # fmt: skip
        super().__init__()
        unused = sorted(set(kwargs) - set(UNUSED_MODEL_ARGS))
        if unused:  # a typo, or another backend's name (hf's peft=): refused, not run without it
            raise ValueError(f"model_args {', '.join(unused)} not supported by --model gptlab (it takes pretrained, "
                             "dtype, batch_size, max_length, device, quantize, adapter)")  # fmt: skip
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if isinstance(pretrained, str):
            self.model = load_model(pretrained, device=device or "cpu", dtype=DTYPES[dtype], adapter=adapter)
            self.tok = get_tokenizer(tokenizer_name(pretrained))
        else:  # a GPT already made: dtype and device apply to it as to a spec's (no device: where it is)
            self.model, self.tok = pretrained.to(device=device, dtype=DTYPES[dtype]), get_tokenizer("gpt2")
            if adapter:
                from gptlab.lora import load_adapter

                load_adapter(self.model, adapter)
        if quantize:
            self.model = quantize_model(self.model, quantize)
        if self.model.config.num_labels:
            raise ValueError(f"{pretrained} is a classifier: lm-eval's tasks score a language model")
        self.model.eval()
        self.batch_size = _batch_size(batch_size)
        self.max_length = int(self.model.config.block_size if max_length is None else max_length)  # 0 is refused
        if not 1 <= self.max_length <= self.model.config.block_size:
            raise ValueError(f"max_length must be in [1, {self.model.config.block_size}], got {self.max_length}")
        self._device = next(self.model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_token

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and each rolling window start with: bos, as lm-eval's hf backend."""
        return self.tok.bos_token

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, allowed_special="all")

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether it is the greedy continuation) per request.

        Each batch runs the model without its head; the head runs only on the positions that
        predict a continuation token (gptlab.chunked_loss.token_logprobs, no (B, T, V) logits)."""
        rows = []
        for _, context, continuation in requests:
            inp = (context + continuation)[-(self.max_length + 1) :][:-1]  # fed; predicts what follows each
            if len(continuation) > len(inp):
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens does not fit max_length {self.max_length}"
                )
            rows.append((inp, continuation))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm):
            batch = order[start : start + self.batch_size]
            longest = len(rows[batch[0]][0])
            idx = torch.full((len(batch), longest), self.eot_token_id, dtype=torch.long)  # right-padded
            for b, i in enumerate(batch):
                idx[b, : len(rows[i][0])] = torch.tensor(rows[i][0])
            hidden, _ = self.model(idx.to(self._device), head=False)  # (B, T, C): padding only follows real tokens
            spans = [(b, len(rows[i][0]), len(rows[i][1])) for b, i in enumerate(batch)]  # (row, fed, scored)
            b_idx = torch.cat([torch.full((n,), b) for b, _, n in spans])  # (N,)
            t_idx = torch.cat([torch.arange(fed - n, fed) for _, fed, n in spans])  # (N,) predicting each target
            targets = torch.tensor([t for i in batch for t in rows[i][1]], device=hidden.device)  # (N,)
            logprob, greedy = token_logprobs(hidden[b_idx, t_idx], self.model.lm_head, targets)
            lengths = [n for _, _, n in spans]
            for i, lp, g in zip(batch, logprob.split(lengths), greedy.split(lengths), strict=True):
                out[i] = (lp.sum().item(), bool(g.all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total logprob over lm-eval's disjoint windows of max_length tokens (the
        windows of all texts batched together)."""
        windows, owner = [], []
        for n, (text,) in enumerate(r.args for r in requests):
            for w in utils.get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                     max_seq_len=self.max_length, context_len=1):  # fmt: skip
                windows.append((None, *utils.make_disjoint_window(w)))
                owner.append(n)
        scores = [0.0] * len(requests)
        for n, (score, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm), strict=True):
            scores[n] += score
        return scores

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to the first `until` string (not included), as lm-eval's
        HF backend makes it: requests grouped by their generation settings, batched longest first
        (left-padded), each context cut to its last max_length - max_gen_toks tokens."""
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(r.args for r in requests):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm)
        for members in groups.values():
            params, until = self._generation_settings(requests[members[0]].args[1])
            keep = self.max_length - params.max_new_tokens
            rows = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in members}
            order = sorted(members, key=lambda i: -len(rows[i]))
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                for i, text in zip(batch, self._generate([rows[i] for i in batch], params, until), strict=True):
                    out[i] = text
                progress.update(len(batch))
        progress.close()
        return out

    def _generation_settings(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str]]:
        """lm-eval's generation_kwargs as (SamplingParams, stop strings), read as lm-eval's own
        backends read them (normalize_gen_kwargs): max_gen_toks or its aliases (max_new_tokens,
        max_tokens, ...), sampling when do_sample or, without it, a temperature above 0; top_k,
        top_p, min_p, repetition_penalty and seed as gptlab's sampling settings. Any other key is
        refused rather than ignored."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS))
        until = [s for s in kwargs.pop("until") if s is not None]  # until: null is [None] there
        max_new = int(kwargs.pop("max_gen_toks"))
        if not 1 <= max_new < self.max_length:
            raise ValueError(f"max_gen_toks must be in [1, max_length {self.max_length}), got {max_new}")
        do_sample, temperature = kwargs.pop("do_sample"), float(kwargs.pop("temperature", 1.0))
        fields = {name: kwargs.pop(name) for name in SAMPLING_KWARGS if name in kwargs}
        if kwargs.get("num_beams", 1) == 1:  # one beam is plain decoding (some tasks spell it out)
            kwargs.pop("num_beams", None)
        if kwargs:
            raise ValueError(f"generation_kwargs {', '.join(sorted(kwargs))} not supported by --model gptlab "
                             f"(it takes until, max_gen_toks, do_sample, temperature, {', '.join(SAMPLING_KWARGS)})")  # fmt: skip
        return sampling_params(None, max_new, temperature=temperature if do_sample else 0.0, **fields), until

    def _generate(self, rows: list[list[int]], params: SamplingParams, until: list[str]) -> list[str]:
        """The continuations of token rows (one batch through gptlab's decode engine), each cut at
        <|endoftext|> or the first `until` string."""
        texts = [TextDecoder(self.tok, until) for _ in rows]
        done = [False] * len(rows)
        steps = generate_tokens(self.model, [list(r) for r in rows], params, eos_id=self.eot_token_id,
                                bos_id=self.eot_token_id, n_vocab=self.tok.n_vocab)  # fmt: skip
        for step in steps:
            for b, token in enumerate(step.tolist()):
                if done[b]:
                    continue
                if token == self.eot_token_id:
                    done[b] = True
                else:
                    texts[b].add(token)
                    done[b] = texts[b].stopped
            if all(done):
                break
        for text in texts:
            if not text.stopped:
                text.finish()
        return [text.text for text in texts]
