"""gptlab classify: label probabilities of a text under a sequence-classification model."""

from gptlab.commands._model_args import add_json_argument, add_model_arguments, load, write_json


def add_arguments(parser):
    add_model_arguments(parser, prompt=False)
    parser.add_argument("--text", required=True, nargs="+", help="the text(s) to classify")
    add_json_argument(parser, help='the result as JSON: {"labels": [...], "probabilities": [...]}, in label order')


def run(args):
    model, tokenizer = load(args, classifier=True)
    if not model.config.num_labels:
        raise ValueError(f"{args.model} is a language model, not a classifier (it has no num_labels)")
    names = model.label_names()
    probs = model.classify(tokenizer, args.text).tolist()  # (texts, labels)
    width = max(len(n) for n in names)
    for text, row in zip(args.text, probs, strict=True):
        if len(args.text) > 1:
            print(f"{text!r}:")
        best = max(range(len(names)), key=row.__getitem__)
        for i, (name, p) in enumerate(zip(names, row, strict=True)):
            print(f"{'*' if i == best else ' '} {name:<{width}}  {p:.4f}")
    if args.json is not None:  # "" (an unset shell variable) is refused, not taken as no file
        result = {"labels": names, "probabilities": probs[0] if len(args.text) == 1 else probs}
        write_json(args.json, result)
