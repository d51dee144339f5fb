"""gptlab eval: perplexity / bits per byte, HellaSwag, LAMBADA, or any lm-evaluation-harness task
(--harness, through gptlab.harness); a table on screen and a JSON file."""

import contextlib
import json
import sys
import time

from gptlab.commands._model_args import add_json_argument, add_model_arguments, load, write_json

TASKS = ("perplexity", "hellaswag", "lambada", "classify")


def add_arguments(parser):
    add_model_arguments(parser, prompt=False)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--task", choices=TASKS, help="a built-in task")
    which.add_argument(
        "--harness",
        metavar="TASK[,TASK...]",
        help="lm-evaluation-harness tasks (needs lm-eval: pip install gptlab[harness])",
    )
    parser.add_argument("--include-path", default=None, help="--harness: a directory of lm-eval task YAML files")
    parser.add_argument(
        "--data",
        default=None,
        help="perplexity: a text file, a token file (val.bin) or a directory with val.bin; hellaswag/lambada: "
        "the official jsonl (downloaded to the cache when omitted); classify: JSONL/CSV records with text and label",
    )
    parser.add_argument("--stride", type=int, default=None, help="perplexity window stride (default block_size/2)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="windows (perplexity, default 4) or rows (default 16)"
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="only the first N examples (hellaswag, lambada, --harness)"
    )
    parser.add_argument(
        "--max-length", type=int, default=None, help="--harness: tokens per window (default block_size)"
    )
    add_json_argument(parser, help="the results as JSON (default eval-TASK.json, eval-harness.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args):
    from gptlab import evaluate

    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    check_flags(args)
    if args.harness:
        return run_harness(args)
    model, tokenizer = load(args, classifier=True)
    if model.config.num_labels and args.task != "classify":
        raise ValueError(f"{args.model} is a classifier: --task {args.task} scores a language model (use --task classify)")  # fmt: skip
    progress = not args.no_progress
    start = time.perf_counter()
    if args.task == "perplexity":
        if not args.data:
            raise ValueError("--task perplexity needs --data (a text file, a val.bin, or a directory holding one)")
        data = args.data
        tokens = evaluate.read_tokens(data, tokenizer)
        metrics = evaluate.perplexity(
            model, tokens, tokenizer, stride=args.stride, batch_size=args.batch_size or 4, progress=progress
        )
    elif args.task == "classify":
        metrics, data = classify_metrics(model, tokenizer, args), args.data
    else:
        data = evaluate.task_data(args.task, args.data)
        read = evaluate.hellaswag_examples if args.task == "hellaswag" else evaluate.lambada_examples
        score = evaluate.hellaswag if args.task == "hellaswag" else evaluate.lambada
        examples = read(data, args.limit)
        metrics = score(model, tokenizer, examples, batch_size=args.batch_size or 16, progress=progress)
    elapsed = time.perf_counter() - start
    result = {"task": args.task, "model": args.model, "data": str(data), "dtype": args.dtype, **metrics}
    result["seconds"] = round(elapsed, 2)
    print_table(result)
    out = args.json or f"eval-{args.task}.json"
    write_json(out, result)
    print(f"results written to {out}")


def check_flags(args) -> None:
    """Refuse a flag the chosen task would ignore (it ran without it, saying nothing), and a --json
    that cannot be written, before the evaluation rather than after it."""
    from pathlib import Path

    if args.json is not None:
        out = Path(args.json)
        if not args.json or out.is_dir() or any(p.exists() and not p.is_dir() for p in out.parents):
            raise ValueError(f"--json {args.json!r}: not a file that can be written")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ValueError(f"--include-path {args.include_path}: no such directory")
    task = "--harness" if args.harness else f"--task {args.task}"
    ignored = {"--include-path": args.include_path is not None and not args.harness,
               "--max-length": args.max_length is not None and not args.harness,
               "--limit": args.limit is not None and args.task == "perplexity",
               "--stride": args.stride is not None and args.task != "perplexity",
               "--data": args.data is not None and bool(args.harness)}  # fmt: skip
    for flag, unused in ignored.items():
        if unused:
            raise ValueError(f"{flag} does not apply to {task}")


def classify_metrics(model, tokenizer, args) -> dict:
    """Accuracy and the confusion matrix of a classifier over --data's text/label records."""
    from gptlab.classify_data import evaluate_classifier
    from gptlab.sft import read_records

    if not args.data:
        raise ValueError("--task classify needs --data (JSONL/JSON/CSV records with text and label)")
    if not model.config.num_labels:
        raise ValueError(f"--task classify: {args.model} is a language model, not a classifier")
    records = read_records(args.data)[: args.limit]
    metrics = evaluate_classifier(model, tokenizer, records, batch_size=args.batch_size or 16)
    names = metrics["labels"]
    width = max(len(n) for n in names)
    print("confusion (rows: true label, columns: predicted)")
    print(" " * width + "  " + "  ".join(f"{n:>{max(len(n), 5)}}" for n in names))
    for name, row in zip(names, metrics["confusion"], strict=True):
        print(f"{name:<{width}}  " + "  ".join(f"{c:>{max(len(n), 5)}}" for n, c in zip(names, row, strict=True)))
    return metrics


def run_harness(args):
    """lm-eval's tasks on args.model through gptlab's backend: lm-eval's table, and its results as JSON."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table

        from gptlab.harness import GptlabLM
    except ImportError as e:
        raise ValueError(
            f"--harness needs lm-evaluation-harness ({e.name} is missing): pip install 'gptlab[harness]'"
        ) from e
    from gptlab.commands._model_args import resolve_device

    tasks = [t.strip() for t in args.harness.split(",") if t.strip()]
    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" (nor in --include-path {args.include_path})" if args.include_path else ""
        raise ValueError(f"--harness: lm-eval has no task {', '.join(unknown)}{where}")
    lm = GptlabLM(pretrained=args.model, dtype=args.dtype, batch_size=args.batch_size or 16, max_length=args.max_length,
                  device=resolve_device(args.device), adapter=args.adapter)  # fmt: skip
    start = time.perf_counter()
    with bars_disabled(args.no_progress):  # lm-eval's bars and the backend's (they take no flag for it)
        out = simple_evaluate(model=lm, tasks=tasks, limit=args.limit, task_manager=manager, log_samples=False)
    print(make_table(out))
    result = {"model": args.model, "dtype": args.dtype, "tasks": tasks, "limit": args.limit,
              "results": out["results"], "n-samples": out.get("n-samples"), "versions": out.get("versions"),
              "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
    path = args.json or "eval-harness.json"
    write_json(path, json.loads(json.dumps(result, default=str)))  # lm-eval's values include numpy scalars
    print(f"results written to {path}")


@contextlib.contextmanager
def bars_disabled(disabled: bool):
    """No progress bars meanwhile, when `disabled`. lm-eval has no switch for its own, and tqdm
    reads TQDM_DISABLE only as it is imported: the `tqdm` of lm-eval's modules, of gptlab's
    backend and of the tqdm package (lm-eval's bootstrap imports it as it runs) is replaced
    meanwhile by a subclass that draws nothing; the datasets library has a switch."""
    if not disabled:
        yield
        return
    import tqdm as tqdm_package
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from tqdm import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    users = [m for name, m in list(sys.modules.items())
             if name.split(".")[0] == "lm_eval" or name == "gptlab.harness"]  # fmt: skip
    users = [m for m in users if getattr(m, "tqdm", None) is tqdm] + [tqdm_package]
    datasets_before = are_progress_bars_disabled()
    disable_progress_bars()
    for module in users:
        module.tqdm = Quiet
    try:
        yield
    finally:
        for module in users:
            module.tqdm = tqdm
        if not datasets_before:
            enable_progress_bars()


def print_table(result: dict) -> None:
    rows = [(k, v) for k, v in result.items() if k not in ("per_example", "confusion")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:.4f}" if abs(value) < 1000 else f"{value:,.1f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        print(f"{key:<{width}}  {value}")
