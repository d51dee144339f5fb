"""gptlab bench generate on a tiny model: both engines, identical greedy tokens, the bandwidth figures."""

import json

import pytest
import torch

from gptlab.bench.generate import BandwidthProbe, main, weight_bytes_per_token
from gptlab.packed import pack_linears


def test_bench_generate_writes_both_engines_and_the_bandwidth_shares(tmp_path, capsys):
    args = ["--preset", "gpt2-tiny", "--modes", "fp32", "--batch", "1", "--prompt-len", "5", "--new-tokens", "6",
            "--repeats", "1", "--probe-mib", "16", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    (path,) = tmp_path.glob("generate-*.json")
    results = json.loads(path.read_text())
    ours, theirs = results["rows"]
    assert (ours["engine"], theirs["engine"]) == ("gptlab", "transformers")
    assert ours["same_tokens_as_transformers"] is True
    assert ours["packed"] is torch.backends.mkldnn.is_available()
    for row in (ours, theirs):
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
        assert len(row["bandwidth_probes_gbs"]) == 2 and row["bandwidth_gbs"] == max(row["bandwidth_probes_gbs"])
        limit = row["bandwidth_gbs"] * 1e9 / row["weight_bytes_per_token"]
        assert row["bandwidth_share"] == pytest.approx(row["decode_tok_s"] / limit, abs=1e-3)
    assert 0 < ours["linears_only_share"] and ours["linears_only_ms"] > 0
    assert "machine" in results and results["summary"]["fp32_eager_decode_vs_transformers"] > 0
    assert "of limit" in capsys.readouterr().out


def test_probe_reports_its_best_reading():
    out = BandwidthProbe(8 * 2**20).measure(repeats=2)
    assert out["bandwidth_gbs"] == max(out["read_gbs"], out["gemv_gbs"]) > 0


def test_weight_bytes_count_a_packed_head_and_skip_lookup_tables():
    from conftest import tiny_model

    plain = tiny_model()
    C, P = plain.config.n_embd, plain.config.block_size
    total = 4 * plain.num_params()
    expected = total - 4 * (P - 1) * C  # the position table: one row per token
    assert weight_bytes_per_token(plain) == expected
    packed = pack_linears(tiny_model())
    # The packed head is read whole; the dense token table now serves lookups only, one row.
    assert weight_bytes_per_token(packed) == expected + 4 * C
