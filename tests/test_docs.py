"""The README and docs/measurements.md point at things that exist: every results file they name
(a figure's source, `NAME-YYYYmmdd-HHMMSS`) is in bench/results/, every relative link reaches
a file and, with `#anchor`, one of its headings, and every `--set KEY=VALUE` they show is one
TrainConfig setting as `gptlab train` reads it."""

import dataclasses
import re
from pathlib import Path

import pytest

from gptlab.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/measurements.md"]


def result_names(text: str) -> set[str]:
    """The full results-file names a text cites (abbreviated ones, `-171142`, are not checked)."""
    return set(re.findall(r"\b([a-z][a-z-]*-\d{8}-\d{6})(?:\.json)?\b", text))


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS)
def test_every_results_file_a_doc_cites_is_committed(doc):
    cited = result_names((ROOT / doc).read_text())
    assert len(cited) > 10  # the pattern still finds the citations
    committed = {p.stem for p in (ROOT / "bench" / "results").glob("*.json")}
    assert sorted(cited - committed) == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_reaches_its_file_and_heading(doc):
    path = ROOT / doc
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        file, _, anchor = link.partition("#")
        target = (path.parent / file) if file else path
        if not target.exists() or (
            anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text())
        ):
            broken.append(link)
    assert broken == []


def set_arguments(text: str) -> list[tuple[str, str]]:
    """(KEY, the word after KEY=VALUE) of each `--set KEY=VALUE` in a text, line breaks read as spaces."""
    return re.findall(r"--set\s+([A-Za-z_.]+)=\S*(?=\s+(\S*))", text)


@pytest.mark.parametrize("doc", DOCS)
def test_every_set_a_doc_shows_is_one_trainconfig_setting(doc):
    # `--set lora_rank=8 lora_alpha=16` (the README's adapters) failed: --set takes one KEY=VALUE
    shown = set_arguments((ROOT / doc).read_text())
    assert len(shown) > 5  # the pattern still finds them
    fields = {f.name for f in dataclasses.fields(TrainConfig)} | {"key"}  # `--set key=value`: the form itself
    assert sorted({key for key, _ in shown} - fields) == []
    assert [after for _, after in shown if re.match(r"[A-Za-z_]+=", after)] == []


def test_the_checks_catch_a_missing_file_a_wrong_anchor_and_a_bare_setting():
    assert result_names("see `generate-llamacpp-20991231-000000` and `-171142`") == {
        "generate-llamacpp-20991231-000000"
    }
    assert set_arguments("`--set lora_rank=8 lora_alpha=16 --set\ninit_from=DIR` (any") == [
        ("lora_rank", "lora_alpha=16"),
        ("init_from", "(any"),
    ]
    assert "the-speed-tables" in heading_anchors("## The speed tables\n") and "speed" not in heading_anchors(
        "## The speed tables\n"
    )
