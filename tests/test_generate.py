import logging

import pytest
import torch

from conftest import tiny_config, tiny_model
from gptlab import fused_step, generation
from gptlab.generation import TextDecoder, decode_step, generate, generate_text, new_cache, prefill, stream_text
from gptlab.model import GPT
from gptlab.sampling import SamplingParams
from gptlab.tokenizer import ByteTokenizer, get_tokenizer

POSITIONS = ["learned", "rope"]
NEG = float("-inf")


def full_last_logits(model, rows):
    """Reference: a full forward over each row alone, no cache; last position's logits (B, V)."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([r]))[0][:, -1] for r in rows])


# --- the KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "modules"])
def test_cached_decoding_matches_full_forward(pos, fused, monkeypatch):
    if not fused:  # the modules, each with its own kernels (as under hooks or past 8 rows)
        monkeypatch.setattr(fused_step, "applies", lambda *args: False)
    model = tiny_model(pos_embedding=pos)
    row = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = new_cache(model, 1, 20)
    logits = prefill(model, torch.tensor([row]), cache)
    for _ in range(13):
        torch.testing.assert_close(logits, full_last_logits(model, [row]), atol=1e-5, rtol=1e-5)
        token = logits.argmax(-1)
        row.append(int(token))
        logits = decode_step(model, token, cache)
    assert cache.pos == 20


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("tensor_pos", [False, True], ids=["int-pos", "tensor-pos"])
def test_left_padded_batch_matches_each_prompt_alone(pos, tensor_pos):
    from gptlab.generation import left_pad

    model = tiny_model(pos_embedding=pos)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 9, 6)]
    idx, positions, mask = left_pad(rows)
    cache = new_cache(model, 3, 24)
    key_mask = torch.ones(3, 24, dtype=torch.bool)
    key_mask[:, : idx.size(1)] = mask
    logits = prefill(model, idx, cache, positions=positions, key_mask=key_mask)
    if tensor_pos:  # the compiled-decoding mechanics (index_copy_, all slots masked), run eagerly
        cache.pos = torch.tensor(cache.pos)
    next_pos = positions[:, -1] + 1
    for _ in range(10):
        torch.testing.assert_close(logits, full_last_logits(model, rows), atol=1e-5, rtol=1e-5)
        tokens = logits.argmax(-1)
        for r, t in zip(rows, tokens.tolist(), strict=True):
            r.append(t)
        logits = decode_step(model, tokens, cache, positions=next_pos, key_mask=key_mask)
        next_pos = next_pos + 1


@pytest.mark.parametrize("tensor_pos", [False, True], ids=["int-pos", "tensor-pos"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "modules"])
def test_a_bf16_cache_decodes_as_keys_and_values_rounded_to_bf16(tensor_pos, fused, monkeypatch):
    """An fp32 model over a bf16 KV cache (a quantized model's default): each step's logits are the
    full forward's with every key and value rounded to bf16 (hook_k, hook_v), the query unrounded."""
    if not fused:
        monkeypatch.setattr(fused_step, "applies", lambda *args: False)
    model = tiny_model()
    model.kv_cache_dtype = torch.bfloat16
    rounded = [b.attn.hook_k for b in model.transformer.h] + [b.attn.hook_v for b in model.transformer.h]

    def reference(row):
        handles = [h.register_forward_hook(lambda m, i, out: out.bfloat16().float()) for h in rounded]
        try:
            return full_last_logits(model, [row])
        finally:
            for handle in handles:
                handle.remove()

    row = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = new_cache(model, 1, 20)
    logits = prefill(model, torch.tensor([row]), cache)
    if tensor_pos:  # the compiled-decoding mechanics (index_copy_, all slots masked), run eagerly
        cache.pos = torch.tensor(cache.pos)
    for _ in range(13):
        expected = reference(row)
        # measured: <= 1.2e-7 apart (logits up to 0.54); the fp32 keys give 4.6e-5 (a cache left fp32 fails)
        torch.testing.assert_close(logits, expected, atol=2e-6, rtol=0)
        token = logits.argmax(-1)
        row.append(int(token))
        logits = decode_step(model, token, cache)
    assert (logits - full_last_logits(model, [row])).abs().max() > 1e-5  # the rounding is real


@pytest.mark.parametrize("pos", POSITIONS)
def test_ragged_greedy_equals_each_prompt_alone(pos):
    model = tiny_model(pos_embedding=pos)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    together = generate(model, prompts, 12, temperature=0)
    alone = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    assert together == alone
    assert [len(r) for r in together] == [len(p) + 12 for p in prompts]


def test_cache_is_sized_to_the_request():
    from gptlab.generation import _Decoder

    model = tiny_model()  # block_size 32
    assert _Decoder(model, [[1] * 5], 7, 24).cache.max_len == 12
    assert _Decoder(model, [[1] * 5], 100, 24).cache.max_len == 32


@pytest.mark.parametrize("pos", POSITIONS)
def test_exact_sliding_window_equals_cropping_without_cache(pos):
    model = tiny_model(pos_embedding=pos)  # block_size 32
    row = list(range(1, 21))
    out = generate(model, torch.tensor([row]), 30, temperature=0, window_keep=32)
    ref = torch.tensor([row])
    with torch.no_grad():
        for _ in range(30):
            logits, _ = model(ref[:, -32:])
            ref = torch.cat([ref, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ref)
    # The default window re-encodes less often; output keeps the requested length.
    assert generate(model, torch.tensor([row]), 60, temperature=0).shape == (1, 80)


def test_long_prompt_is_cropped_with_a_warning(caplog):
    model = tiny_model()
    row = [i % 97 for i in range(40)]
    with caplog.at_level(logging.WARNING, logger="gptlab.generation"):
        out = generate(model, [row], 3, temperature=0)
    assert "longer than block_size" in caplog.text
    assert out[0][:40] == row
    assert out[0][40:] == generate(model, [row[-32:]], 3, temperature=0)[0][32:]


# --- sampling through generate (the pure functions: test_sampling.py) ------------------------------


def test_temperature_zero_is_greedy():
    model = tiny_model()
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = generate(model, prompt, 10, temperature=0, top_k=5, top_p=0.5, generator=0)
    ref = prompt
    with torch.no_grad():
        for _ in range(10):
            ref = torch.cat([ref, model(ref)[0][:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ref)


def test_seeds_and_the_sampling_object():
    model = tiny_model()
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(model, prompt, 20, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, generate(model, prompt, 20, seed=7))
    assert torch.equal(a, generate(model, prompt, 20, generator=7))  # the older spelling of seed
    assert not torch.equal(a, generate(model, prompt, 20, seed=8))
    # sampling= and keywords are one thing; keywords not at their default override its fields.
    params = SamplingParams(temperature=0.8, top_k=5, seed=3, max_new_tokens=20)
    b = generate(model, prompt, sampling=params)
    assert torch.equal(b, generate(model, prompt, 20, temperature=0.8, top_k=5, seed=3))
    reseeded = SamplingParams(temperature=0.8, top_k=5, seed=4, max_new_tokens=20)
    assert torch.equal(generate(model, prompt, sampling=params, seed=4), generate(model, prompt, sampling=reseeded))
    assert generate(model, prompt, 6, sampling=params).shape == (1, 9)  # max_new_tokens given: it wins
    assert generate(model, prompt, temperature=0).shape == (1, 3 + SamplingParams.max_new_tokens)
    with pytest.raises(ValueError, match="seed once"):
        generate(model, prompt, 3, seed=1, generator=2)
    with pytest.raises(ValueError, match="stop strings need text"):
        generate(model, prompt, 3, sampling=SamplingParams(stop="x"))


def test_repetition_penalty_in_generate_follows_the_context():
    """Greedy with a huge penalty never repeats a token of the prompt or of its own output
    (while the vocabulary lasts), and each row is penalised for its own context only."""
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5]]
    out = generate(model, prompts, 20, temperature=0, repetition_penalty=1e6)
    plain = generate(model, prompts, 20, temperature=0)
    for row in out:
        assert len(set(row)) == len(row)
    assert any(len(set(r)) < len(r) for r in plain), "the unpenalised model repeats itself (tune the test)"
    # The first new token of row 0 may be a token of row 1's prompt: rows do not share `seen`.
    alone = [generate(model, [p], 20, temperature=0, repetition_penalty=1e6)[0] for p in prompts]
    assert out == alone


def test_num_samples_and_unconditional_start():
    model = tiny_model()
    out = generate(model, torch.tensor([[1, 2], [3, 4]]), 5, num_samples=3, generator=0)
    assert out.shape == (6, 7)
    assert out[:3, :2].eq(torch.tensor([1, 2])).all() and out[3:, :2].eq(torch.tensor([3, 4])).all()
    assert len({tuple(r) for r in out[:3].tolist()}) > 1  # three different continuations
    start = generate(model, [[96]], 4, temperature=0)[0][1:]
    assert generate(model, [[]], 4, bos_id=96, temperature=0)[0] == start


def test_eos_stops_each_row():
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5]]
    free = generate(model, prompts, 10, temperature=0)
    eos = free[0][5]  # the third new token of row 0
    out = generate(model, prompts, 10, temperature=0, eos_id=eos)
    first = free[0][3:].index(eos)
    assert out[0] == free[0][: 3 + first + 1]  # stops at eos, eos included
    tensor_out = generate(model, torch.tensor([[1, 2, 3]]), 10, temperature=0, eos_id=eos)
    assert tensor_out[0].tolist() == out[0]  # one row: ends as soon as it has eos
    # Sampled, a row that has ended keeps producing eos (the draws after it would differ), and
    # masking draws nothing: the rows equal the eos-free run up to their eos.
    prompt = torch.tensor([[1, 2, 3]] * 4)
    free = generate(model, prompt, 12, seed=0)[:, 3:]
    end = int(free[0, 2])
    ended = generate(model, prompt, 12, seed=0, eos_id=end)[:, 3:]
    for row, ref in zip(ended.tolist(), free.tolist(), strict=True):
        cut = ref.index(end) + 1 if end in ref else len(ref)
        assert row[:cut] == ref[:cut] and row[cut:] == [end] * (len(row) - cut)
    assert any(t != end for t in free[0, 3:].tolist()), "the free run goes on past eos (tune the seed)"
    # In a batch, a row that has ended keeps producing eos while the others go on.
    batch = generate(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), 10, temperature=0, eos_id=eos)
    other = generate(model, [[4, 5, 6]], 10, temperature=0, eos_id=eos)[0]
    assert eos not in other[3:], "row 1 should outlive row 0 (tune the prompts)"
    assert batch[0].tolist() == out[0] + [eos] * (len(other) - len(out[0]))
    assert batch[1].tolist() == other


# --- text: stop strings, EOS, streaming, UTF-8 ------------------------------------------------

PATTERN = "日本語🙂 é! "


@pytest.fixture(scope="module")
def echo_model():
    """A byte-level model overfitted on a repeating text with multi-byte characters, so greedy
    decoding continues the pattern: a real model whose characters span several tokens."""
    tok = get_tokenizer("byte")
    ids = torch.tensor(tok.encode(PATTERN * 8))
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=257, block_size=48, n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add synchronisation
    for _ in range(150):
        start = torch.randint(0, len(ids) - 49, (8,))
        batch = torch.stack([ids[s : s + 49] for s in start.tolist()])
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    return model.eval(), tok


def test_streaming_equals_non_streaming_and_is_valid_utf8(echo_model):
    model, tok = echo_model
    pieces = list(stream_text(model, tok, PATTERN, 60, temperature=0))
    text = "".join(pieces)
    assert text == generate_text(model, tok, PATTERN, 60, temperature=0)
    assert text.startswith(PATTERN * 2)  # the model learned the pattern
    assert all("\ufffd" not in p and p.encode("utf-8").decode("utf-8") == p for p in pieces)
    assert len(pieces) < 60  # the 3- and 4-byte characters came out whole, not byte by byte
    sampled = "".join(stream_text(model, tok, "日本", 40, top_k=3, generator=5))
    assert sampled == generate_text(model, tok, "日本", 40, top_k=3, generator=5)


def test_stop_strings_split_across_tokens(echo_model):
    model, tok = echo_model
    full = generate_text(model, tok, PATTERN, 40, temperature=0)
    assert generate_text(model, tok, PATTERN, 40, temperature=0, stop="🙂 é") == full[: full.index("🙂 é")]
    pieces = list(stream_text(model, tok, PATTERN, 40, temperature=0, stop=["zz", "é! 日"]))
    assert "".join(pieces) == full[: full.index("é! 日")]
    assert generate_text(model, tok, PATTERN, 40, temperature=0, stop="not there") == full


def test_text_decoder_holds_back_split_characters_and_stop_prefixes():
    tok = get_tokenizer("byte")
    text = TextDecoder(tok)
    pieces = [text.add(b) for b in "日x".encode()]  # 3 bytes of one character, then one more
    assert pieces == ["", "", "日", "x"]
    cut = TextDecoder(tok)
    assert [cut.add(b) for b in "é".encode()[:1]] == [""] and cut.finish() == "\ufffd"  # cut off: U+FFFD
    stop = TextDecoder(tok, ["ab", "xyz"])
    assert [stop.add(b) for b in b"1xa"] == ["1", "", "x"]  # "x", then "a", could begin a stop string
    assert stop.add(ord("q")) == "aq" and not stop.stopped
    assert [stop.add(b) for b in b"xyzw"] == ["", "", "", ""] and stop.stopped  # w: ignored after the stop
    assert stop.text == "1xaq" and stop.finish() == ""


def test_long_stop_strings_cost_each_token_only_the_text_not_yet_shown(monkeypatch):
    """A server request's 16 stop strings of 60,000 characters that never match: each token's
    hold-back looked at the whole text decoded so far, slicing every stop at every length, so a
    continuation of 5,000 characters took 15 s of the server's event loop (every other client's
    stream stalled meanwhile), growing with the square of the text per token. Only the text not
    yet shown can begin a stop string; here it is one character after each token. The spy counts
    the characters each hold-back looks at, rather than timing it."""
    looked_at = []
    held_back = generation.held_back
    monkeypatch.setattr(
        generation, "held_back", lambda text, stops: looked_at.append(len(text)) or held_back(text, stops)
    )
    tok = get_tokenizer("byte")
    text = TextDecoder(tok, ["x" * 60_000 + str(i) for i in range(16)])
    for byte in b"hello world, " * 800:  # 10,400 characters, no x
        assert text.add(byte) == chr(byte)
    assert text.finish() == "" and not text.stopped
    assert len(looked_at) == 10_400 and max(looked_at) == 1  # was up to 10,400: the whole text


def test_empty_prompt_starts_from_end_of_text(echo_model):
    model, tok = echo_model
    ids = generate(model, [[tok.eot_token]], 20, temperature=0)[0][1:]
    assert generate_text(model, tok, "", 20, temperature=0, stop_at_eos=False) == tok.decode(ids)


def test_text_stops_at_the_tokenizers_end_of_text():
    tok = get_tokenizer("byte")
    model = tiny_model(vocab_size=257, tie_weights=False)
    with torch.no_grad():  # make <|endoftext|> (256) the most likely next token everywhere
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[256, 0] = 10.0
    assert generate_text(model, tok, "hi", 5, temperature=0) == ""
    assert generate_text(model, tok, "hi", 2, temperature=0, stop_at_eos=False) == "<|endoftext|>" * 2


# --- bad input -------------------------------------------------------------------------------------


def test_text_generation_samples_without_dropout_and_restores_the_mode():
    """generate_text/stream_text on a model in training (as a training loop samples) sampled
    through dropout: greedy text changed on every call. They run in eval mode, as generate does,
    and hand the model back in training mode."""
    byte = get_tokenizer("byte")
    model = tiny_model(vocab_size=257, dropout=0.5).train()
    texts = {generate_text(model, byte, "Hello", 12, temperature=0) for _ in range(3)}
    assert model.training and len(texts) == 1
    ids = generate(model, [byte.encode("Hello")], 12, temperature=0)[0][5:]
    assert texts == {byte.decode(t for t in ids if t != byte.eot_token)} or byte.eot_token in ids
    stream = stream_text(model, byte, "Hello", 12, temperature=0)
    next(stream)
    stream.close()  # a caller that stops reading early
    assert model.training


def test_an_id_past_the_tokenizers_vocabulary_is_shown_not_a_crash():
    """An id the tokenizer lacks (a padded head's: nanoGPT's 50,304 for GPT-2's 50,257) raised
    KeyError in tiktoken (the byte tokenizer a ValueError). It decodes as U+FFFD."""
    assert get_tokenizer("gpt2").decode([15496, 50300]) == "Hello\ufffd"
    assert get_tokenizer("byte").decode([72, 300]) == "H\ufffd"


def padded_head_model(**overrides):
    """A model over the byte tokenizer's 257 ids padded to 320 (vocab_multiple=64) whose logits
    are the same at every position, with the padded id 300 far the largest."""
    model = tiny_model(vocab_size=320, tie_weights=False, **overrides)
    with torch.no_grad():
        ln_f = model.transformer.ln_f
        ln_f.weight.zero_()
        ln_f.bias.copy_(torch.randn(ln_f.bias.shape, generator=torch.Generator().manual_seed(0)))
        model.lm_head.weight[300] = 50 * ln_f.bias
    return model


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(seed=1), dict(seed=1, top_p=0.9)], ids=str)
@pytest.mark.parametrize("speculating", ["plain", "prompt-lookup", "draft-model"])
def test_a_padded_heads_spare_ids_are_never_drawn(sampling, speculating):
    """A model trained with vocab_multiple has head rows past the tokenizer's vocabulary: text
    generation drew them (U+FFFD in the text), greedy every token here. Only the tokenizer's ids
    are drawn now, and the ids API takes the tokenizer's n_vocab; batch 1 (the fused C step's
    logits read in place) and a batch alike."""
    byte, model = get_tokenizer("byte"), padded_head_model()
    speculation = {"plain": {}, "prompt-lookup": dict(prompt_lookup=2),
                   "draft-model": dict(draft_model=padded_head_model(n_layer=1))}[speculating]  # fmt: skip
    assert generate(model, [[72, 105]], 4, temperature=0) == [[72, 105, 300, 300, 300, 300]]  # the model's argmax
    best = int(model.lm_head.weight[:257].mv(model.transformer.ln_f.bias).argmax())  # the tokenizer's
    decoded = []  # the ids text generation decoded

    class Recording(ByteTokenizer):
        def decode_bytes(self, ids):
            decoded.extend(ids)
            return super().decode_bytes(ids)

    text = generate_text(model, Recording(), "Hi", 6, stop_at_eos=False, **sampling, **speculation)
    assert len(decoded) == 6 and max(decoded) < 257
    if sampling.get("temperature") == 0:
        assert decoded == [best] * 6 and text == byte.decode(decoded)
    for prompts in ([[72, 105]], [[72, 105], [1], [9, 9, 9]]):
        out = generate(model, prompts, 8, n_vocab=257, **sampling, **speculation)
        assert all(t < 257 for row in out for t in row)
    with pytest.raises(ValueError, match="n_vocab must be an integer in \\[1, 320\\]"):
        generate(model, [[1]], 2, n_vocab=321)


@pytest.mark.parametrize("fast", [True, False])
def test_rows_or_slots_that_do_not_fit_the_cache_are_refused(fast, monkeypatch):
    """64 tokens into a 4-row cache: the C step wrote past the cache (the process died in malloc);
    a 1-row prompt into a 2-row cache filled row 0 alone; a prompt past max_len. ValueErrors now,
    before anything is written, with the kernels on and off."""
    from gptlab import kernels

    monkeypatch.setattr(kernels, "_enabled", fast)
    model = tiny_model()
    cache = new_cache(model, 4, 8)
    prefill(model, torch.tensor([[1, 2, 3]] * 4), cache)
    for bad, message in [(lambda: decode_step(model, torch.arange(64), cache), "64 rows for a KV cache of 4"),
                         (lambda: prefill(model, torch.tensor([[1, 2, 3]]), new_cache(model, 2, 8)), "1 rows"),
                         (lambda: prefill(model, torch.ones(4, 6, dtype=torch.long), cache), "overflow: 3 \\+ 6 > 8")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            bad()
    assert cache.pos == 3 and decode_step(model, torch.arange(4), cache).shape == (4, model.config.vocab_size)


def test_numpy_token_ids_are_ids():
    """np.int64(5) was refused as "outside the vocabulary" although 5 is in it."""
    import numpy as np

    model = tiny_model()
    assert (
        generate(model, [[np.int64(5), 6]], 3, temperature=0)[0][2:]
        == generate(model, [[5, 6]], 3, temperature=0)[0][2:]
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=None), "top_k=0 turns it off"),
        (dict(top_p=None), "top_p=1.0 turns it off"),
        (dict(sampling=dict(top_k=3)), "SamplingParams"),
        (dict(temperature=-0.5), "temperature"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(idx=torch.tensor([[1, 97]])), "outside the vocabulary"),
        (dict(idx=[[1, 2], [-1]]), "outside the vocabulary"),
        (dict(idx=[[]]), "empty prompt"),
        (dict(eos_id=97), "eos_id 97 outside the vocabulary"),  # was accepted, and never stopped anything
        (dict(idx=[[1.0]]), "token id 1.0 is not an integer"),
        (dict(idx="hi"), "idx is text"),  # was "token id 'h' outside the vocabulary"
        (dict(idx=["hi", "there"]), "generate_text"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    model = tiny_model()
    args = dict(idx=torch.tensor([[1, 2]]), max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(model, args.pop("idx"), args.pop("max_new_tokens"), **args)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_are_an_error_not_token_0(temperature):
    """Greedy decoding of NaN logits (a float16 overflow, a NaN weight) gave token 0 at every step,
    silently (the argmax of a NaN row is its first NaN); sampling already refused them."""
    model = tiny_model()
    with torch.no_grad():
        model.transformer.ln_f.weight[0] = float("nan")
    with pytest.raises(ValueError, match="the model's logits are not finite"):
        generate(model, torch.tensor([[1, 2]]), 3, temperature=temperature)


# --- command line ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def echo_dir(echo_model, tmp_path_factory):
    from gptlab.checkpoint import save_model

    directory = tmp_path_factory.mktemp("echo")
    save_model(echo_model[0], directory, tokenizer="byte")
    return str(directory)


def test_cli_generate_streams_the_continuation(echo_model, echo_dir, capsys, monkeypatch, tmp_path):
    import io

    from gptlab.cli import main

    model, tok = echo_model
    args = ["generate", "--model", echo_dir, "--prompt", PATTERN, "--temperature", "0", "--max-new-tokens", "30"]
    assert main([*args, "--stop", "é"]) == 0
    expected = generate_text(model, tok, PATTERN, 30, temperature=0, stop="é")
    assert capsys.readouterr().out == PATTERN + expected + "\n"
    sampled = ["generate", "--model", echo_dir, "--prompt", "日", "--max-new-tokens", "20", "--seed", "3"]
    outs = []
    for _ in range(2):
        assert main([*sampled, "--num-samples", "2"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].count("--- sample") == 2
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PATTERN, encoding="utf-8")
    greedy = ["generate", "--model", echo_dir, "--temperature", "0", "--max-new-tokens", "30"]
    assert main([*greedy, "--prompt-file", str(prompt_file)]) == 0
    assert capsys.readouterr().out == PATTERN + generate_text(model, tok, PATTERN, 30, temperature=0) + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(PATTERN))
    assert main(greedy) == 0
    assert capsys.readouterr().out == PATTERN + generate_text(model, tok, PATTERN, 30, temperature=0) + "\n"


def test_cli_generate_reads_endoftext_in_the_prompt_as_the_token(echo_model, echo_dir, capsys, monkeypatch):
    """--prompt "<|endoftext|>..." was 13 characters of text, where completions, the explorer and
    the inspect commands (next, lens, ...) read the token: the same prompt, other predictions."""
    from gptlab import generation
    from gptlab.cli import main

    model, tok = echo_model
    fed, stream = [], generation.stream_text
    monkeypatch.setattr(
        generation, "stream_text", lambda m, t, prompt, **kw: fed.append(prompt) or stream(m, t, prompt, **kw)
    )
    prompt = "<|endoftext|>" + PATTERN
    assert (
        main(["generate", "--model", echo_dir, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "9"]) == 0
    )
    assert fed == [[tok.eot_token, *tok.encode(PATTERN)]]
    assert capsys.readouterr().out == prompt + "".join(stream(model, tok, fed[0], 9, temperature=0)) + "\n"


def test_cli_interactive_keeps_the_conversation(echo_model, echo_dir, capsys, monkeypatch):
    import io

    from gptlab.cli import main

    model, tok = echo_model
    monkeypatch.setattr("sys.stdin", io.StringIO("日本語\n🙂\n"))
    args = ["generate", "--model", echo_dir, "-i", "--temperature", "0", "--max-new-tokens", "12"]
    assert main(args) == 0
    out = capsys.readouterr().out
    first = generate_text(model, tok, "日本語\n", 12, temperature=0)
    second = generate_text(model, tok, "日本語\n" + first + "\n🙂\n", 12, temperature=0)
    assert f"> {first}\n> {second}\n" in out


def test_cli_bad_sampling_value_is_one_line_error(echo_dir, capsys):
    from gptlab.cli import main

    assert main(["generate", "--model", echo_dir, "--prompt", "a", "--top-p", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and err.count("\n") == 1
    assert main(["generate", "--model", echo_dir, "--prompt", "a", "--top-k", "-1"]) == 2
    assert "top_k=0 turns it off" in capsys.readouterr().err
    # flags the run would ignore (it ran without them, saying nothing)
    ignored = {("-i", "--prompt", "a"): "drop --prompt", ("-i", "--num-samples", "2"): "drop --num-samples",
               ("--prompt", "a", "--num-draft-tokens", "7"): "add --draft-model or --prompt-lookup",
               ("--prompt", "a", "--prompt-lookup", "2", "--num-draft-tokens", "0"): "num_draft_tokens must be"}  # fmt: skip
    for flags, message in ignored.items():
        assert main(["generate", "--model", echo_dir, *flags]) == 2
        assert message in capsys.readouterr().err
    # refused before the prompt is printed (it printed "abc", then the error)
    assert main(["generate", "--model", echo_dir, "--prompt", "abc", "--compile", "--prompt-lookup", "2"]) == 2
    said = capsys.readouterr()
    assert "--compile compiles plain decoding" in said.err and said.out == ""


def test_cli_sampling_flags_are_the_sampling_params_fields():
    import argparse

    from gptlab.commands.generate import add_arguments, sampling_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert sampling_from_args(parser.parse_args(["--model", "m"])) == SamplingParams()  # the same defaults
    flags = "--temperature 0.5 --top-k 7 --top-p 0.9 --min-p 0.1 --repetition-penalty 1.2 --seed 3 --max-new-tokens 9 --num-samples 2 --stop ab --stop c"  # fmt: skip
    params = sampling_from_args(parser.parse_args(["--model", "m", *flags.split()]))
    assert params == SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, repetition_penalty=1.2, seed=3,
                                    max_new_tokens=9, num_samples=2, stop=("ab", "c"))  # fmt: skip
    # --stop "\n\n" (the README's example, as a shell passes it: backslash, n) is two newlines
    stops = parser.parse_args(["--model", "m", "--stop", r"\n\n", "--stop", r"a\tb\\n"]).stop
    assert stops == ["\n\n", "a\tb\\n"]


def test_compiled_decode_step_matches_eager():
    from gptlab.generation import compile_decode

    model = tiny_model(pos_embedding="rope")
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
    step = compile_decode(model)
    assert generate(model, prompts, 10, temperature=0, compiled_step=step) == generate(
        model, prompts, 10, temperature=0
    )
    with pytest.raises(ValueError, match="another model"):
        generate(tiny_model(), prompts, 3, compiled_step=step)
    # hooks are refused: the graph was traced without them, and decoded as if unhooked
    with model.hooks([("blocks.0.hook_resid_post", lambda x, hook: x + 1)]):
        with pytest.raises(ValueError, match="hooks registered"):
            generate(model, prompts, 10, temperature=0, compiled_step=step)
    handle = model.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: out + 1)  # torch's own
    with pytest.raises(ValueError, match="hooks registered"):
        generate(model, prompts, 10, temperature=0, compiled_step=step)
    handle.remove()


def test_a_model_with_a_context_of_one_token_generates():
    """block_size 1: the default window (3/4 of block_size) was 0 tokens, refused as 'window_keep
    must be in [1, block_size], got 0', so such a model generated nothing, not even one token. It
    keeps its one token; each step then sees the last token alone, as the model's forward does."""
    model = tiny_model(block_size=1)
    out = generate(model, torch.tensor([[5]]), 4, temperature=0)
    tokens = [5]
    for _ in range(4):
        tokens.append(int(model(torch.tensor([tokens[-1:]]))[0][0, -1].argmax()))
    assert out[0].tolist() == tokens


def test_cli_generate_reads_a_hugging_face_models_own_tokenizer(tmp_path, capsys):
    """A GPT-2 with its own tokenizer was prompted and decoded with GPT-2's: greedy text must be
    what transformers generates with the model's own tokenizer."""
    from conftest import own_bpe_model_dir
    from gptlab.cli import main

    model, ref_tok = own_bpe_model_dir(tmp_path / "m")
    prompt = "der die Brücke"
    ids = torch.tensor([ref_tok.encode(prompt)])  # (1, T)
    new = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    expected = ref_tok.decode([t for t in new if t != ref_tok.eos_token_id])
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]) == 0  # fmt: skip
    assert capsys.readouterr().out == prompt + expected + "\n"
