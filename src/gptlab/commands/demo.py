"""gptlab demo: the main job. Prepare tiny-shakespeare, train a small GPT-2 on the CPU, generate.

Where the corpus comes from: --input; else ../shared/data/tinyshakespeare.txt beside the
repository (this workplace's offline machines); else a download from karpathy/char-rnn. Whatever
the source, its SHA-256 must be tiny-shakespeare's.

`--deadline T` (unix seconds; `make demo` passes its own start + 290 s, so the install counts)
shortens the training budget where the config's would end the demo after T: training stops
RESERVE_S before T for the last evaluation, the checkpoint and the sample. It never shortens
training below MIN_TRAIN_S; a deadline that leaves less is missed, saying so.
"""

import contextlib
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from gptlab.commands.train import add_set_argument

SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
RELATIVE = Path("..") / "shared" / "data" / "tinyshakespeare.txt"
PROMPT = "ROMEO:\n"
# Seconds after training: the last evaluation (the whole validation split), the checkpoint and the
# passage. Measured with the chunked loss's evaluation free of gradients: ~6.5 s on the Zen 5 held
# to AVX2 on one thread (the Zen 3's demo step time), ~3 s natively on two.
RESERVE_S = 10.0
MIN_TRAIN_S = 60.0


def add_arguments(parser):
    parser.add_argument("--input", help="tiny-shakespeare text file (default: ../shared/data/..., else download)")
    parser.add_argument("--out", default="runs/demo", help="run directory (data/, run/; default runs/demo)")
    parser.add_argument("--config", help="TOML training config (default: the packaged configs/demo.toml)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="length of the generated passage")
    parser.add_argument("--deadline", type=float, help="unix time to finish by: a shorter training budget where "
                        "the config's would end later (make demo: its start + 290 s)")  # fmt: skip
    add_set_argument(parser)


def find_corpus(explicit: str | None, out: Path) -> Path:
    """The corpus path: --input, the shared copy beside the repository, or a verified download
    (kept in `out`)."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ValueError(f"--input {path}: no such file")
        return check_hash(path)
    repo = Path(__file__).resolve().parents[3]  # src/gptlab/commands/demo.py -> repository root
    for base in (Path.cwd(), repo):
        candidate = base / RELATIVE
        if candidate.is_file():
            return check_hash(candidate)
    return download(out / "tinyshakespeare.txt")


def check_hash(path: Path) -> Path:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise ValueError(f"{path}: SHA-256 {digest} is not tiny-shakespeare's ({SHA256})")
    return path


def download(dest: Path) -> Path:
    """Fetch tiny-shakespeare once, check its hash, keep it at dest."""
    if dest.is_file():
        return check_hash(dest)
    import urllib.request

    from gptlab.atomic import atomic_write

    print(f"downloading tiny-shakespeare from {URL}")
    try:
        with urllib.request.urlopen(URL, timeout=60) as r:
            data = r.read()
    except OSError as e:
        raise ValueError(
            f"tiny-shakespeare is not at ../shared/data and cannot be downloaded ({e}); pass --input FILE"
        ) from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise ValueError(f"the download from {URL} has SHA-256 {digest}, expected {SHA256}")
    atomic_write(dest, lambda tmp: Path(tmp).write_bytes(data))
    return dest


def prepared(corpus: Path, data_dir: Path) -> Path:
    """Tokenize the corpus into data_dir unless a manifest for the same file is already there."""
    from gptlab.data import MANIFEST, prepare, read_manifest

    if (data_dir / MANIFEST).is_file():
        sources = read_manifest(data_dir).get("sources", [])
        if [s.get("sha256") for s in sources] == [SHA256]:
            return data_dir
    prepare(corpus, data_dir, val_fraction=0.1, progress=False)
    return data_dir


def run(args):
    from importlib import resources

    from gptlab.train import TrainConfig, train

    if args.max_new_tokens < 1:  # before minutes of training, not after
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_overrides(args.overrides)
    config_path = args.config or resources.files("gptlab") / "configs" / "demo.toml"
    cfg = TrainConfig.from_toml(config_path, args.overrides)
    check_config(cfg, config_path)
    t0 = time.perf_counter()
    out = Path(args.out)
    corpus = find_corpus(args.input, out)
    data_dir = prepared(corpus, out / OWN_SETTINGS["data_dir"])
    print(f"corpus: {corpus} -> {data_dir} ({time.perf_counter() - t0:.1f}s)")
    cfg = cfg.with_overrides({"data_dir": str(data_dir), "out_dir": str(out / OWN_SETTINGS["out_dir"])})
    if args.deadline is not None:
        cfg = fit_to_deadline(cfg, args.deadline, time.time())
    with over_previous_run(out / OWN_SETTINGS["out_dir"]):
        summary = train(cfg)
    t_train = time.perf_counter() - t0
    passage = generate_passage(summary["checkpoint"], args.max_new_tokens, cfg.seed)
    print("\n" + "=" * 72 + f"\n{passage}\n" + "=" * 72)
    print(f"validation loss: {summary['val_loss']:.4f} (last 10% of the text, never trained on)")
    print(f"training: {summary['step']} steps in {summary['seconds']:.0f}s, precision {summary['precision']}")
    print(
        f"time: {time.perf_counter() - t0:.0f}s total ({t_train:.0f}s preparing + training, {summary['tokens']:,} tokens)"
    )
    print(
        f"checkpoint: {summary['checkpoint']}   (try: gptlab next --model {out / 'run' / 'latest'} --prompt 'ROMEO:')"
    )
    print(f"metrics:    {summary['metrics']}")
    print(f"loss plot:  {summary['plot']}")
    sys.stdout.flush()


@contextlib.contextmanager
def over_previous_run(run_dir: Path):
    """Train into run_dir in the block, a previous demo run there put aside meanwhile: deleted once
    the new run has a checkpoint, put back where it fails before one (a bad --set, n_layer=0,
    deleted the trained model and then failed)."""
    from gptlab import run_files

    aside = run_dir.with_name(f".{run_dir.name}.previous")
    shutil.rmtree(aside, ignore_errors=True)  # left by a demo killed while it trained
    if run_dir.exists():
        print(f"replacing the previous demo run in {run_dir}")
        os.replace(run_dir, aside)
    try:
        yield
    finally:
        if aside.exists() and (run_dir / run_files.LATEST).is_symlink():
            shutil.rmtree(aside)
        elif aside.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            os.replace(aside, run_dir)
            print(f"the previous demo run is back in {run_dir}")


# TrainConfig settings the demo gives itself, under --out: a --set of them was silently replaced
OWN_SETTINGS = {"data_dir": "data", "out_dir": "run"}


def check_overrides(overrides: list[str]) -> None:
    """ValueError for a --set of a setting the demo gives itself (OWN_SETTINGS), pointing to --out."""
    from gptlab.train_config import split_override

    for text in overrides:
        key = split_override(text)[0]
        if key in OWN_SETTINGS:
            raise ValueError(f"--set {text}: the demo sets {key} itself, to {OWN_SETTINGS[key]}/ under --out; "
                             f"give --out DIR instead (default runs/demo)")  # fmt: skip


def check_config(cfg, path) -> None:
    """ValueError for a --config file that sets what the demo sets itself (OWN_SETTINGS): they were
    silently replaced, as a --set of them was."""
    from gptlab.train import TrainConfig

    default = TrainConfig()
    for key, under in OWN_SETTINGS.items():
        if getattr(cfg, key) != getattr(default, key):
            raise ValueError(f"--config {path} sets {key}: the demo sets it itself, to {under}/ under --out; "
                             f"remove it there and give --out DIR instead (default runs/demo)")  # fmt: skip


def fit_to_deadline(cfg, deadline: float, now: float):
    """cfg with max_time cut so that training ends RESERVE_S before `deadline` (unix seconds; `now`
    the time), never below MIN_TRAIN_S; unchanged where its own budget ends earlier."""
    from gptlab.train_config import parse_duration

    budget = parse_duration(cfg.max_time)
    left = deadline - now - RESERVE_S
    if budget is not None and budget <= left:
        return cfg
    seconds = max(left, MIN_TRAIN_S)
    late = "" if left >= MIN_TRAIN_S else f"; the deadline is {MIN_TRAIN_S - left:.0f} s too close to keep"
    print(f"training budget {seconds:.0f}s (configured: {cfg.max_time}) to finish by the deadline{late}")
    return cfg.with_overrides({"max_time": f"{seconds:.1f}s"})


def generate_passage(checkpoint: str, max_new_tokens: int, seed: int) -> str:
    import torch

    from gptlab.checkpoint import load_native
    from gptlab.generation import generate_text
    from gptlab.tokenizer import get_tokenizer

    model = load_native(checkpoint)
    tok = get_tokenizer("gpt2")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        text = generate_text(model, tok, PROMPT, max_new_tokens, temperature=0.8, top_k=200, generator=seed)
    return PROMPT + text
