import argparse
import errno
import logging
import os
import socket
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch

from gptlab import cli
from gptlab.cli import COMMANDS, command_parser, main


def test_help_lists_commands_without_importing_torch():
    code = "import sys; from gptlab.cli import main\ntry:\n main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")
    for name in COMMANDS:
        assert name in out


def test_version_is_the_packages(capsys):
    """`gptlab --version` (there was none) prints the version pyproject.toml gives the package."""
    import tomllib

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert exit_.value.code == 0 and capsys.readouterr().out == f"gptlab {project['version']}\n"


def test_a_reader_that_leaves_early_is_no_error():
    """`gptlab info gpt2 | head -1`: the command printed "gptlab info: error: [Errno 32] Broken
    pipe" and exited 2. Its output's reader closed before it wrote: quiet, 141 as for SIGPIPE."""
    child = subprocess.Popen([sys.executable, "-m", "gptlab", "info", "gpt2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)  # fmt: skip
    child.stdout.close()  # the reader leaves before the first line
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 141 and err == ""


def test_python_m_gptlab_info(capsys):
    assert main(["info", "gpt2"]) == 0
    assert "124,439,808" in capsys.readouterr().out


def test_bad_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["info", "--model", str(tmp_path)]) == 2
    assert "neither gptlab.json" in capsys.readouterr().err


def test_public_api_names_are_the_functions():
    import gptlab
    import gptlab.generation  # a submodule once shadowed the exported function of the same name

    assert gptlab.generate is gptlab.generation.generate
    assert callable(gptlab.GPT) and callable(gptlab.get_tokenizer) and callable(gptlab.load_model)


# --------------------------------------------------------------------------- the CLI conventions
# README "CLI conventions": --model/--device auto/--dtype wherever a model is loaded, --json FILE
# for machine output, dashes in flag names, global flags after the subcommand too, and every user
# error one line on stderr with exit code 2.

LOADS_A_MODEL = ("eval", "trace", "attention", "lens", "next", "patch", "classify", "generate", "serve", "export", "quantize")  # fmt: skip
WRITES_JSON = ("info", "eval", "trace", "lens", "next", "patch", "classify")


def parser_of(name):
    return command_parser(name, import_module(f"gptlab.commands.{name}"))


def options(parser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("name", LOADS_A_MODEL)
def test_model_loading_commands_share_model_device_dtype(name):
    found = options(parser_of(name))
    assert found["--model"].required
    assert found["--device"].default == "auto"  # serve, export and quantize included
    assert set(found["--dtype"].choices) == {"float32", "bfloat16", "float16"}


@pytest.mark.parametrize("name", WRITES_JSON)
def test_machine_output_is_json_file(name):
    found = options(parser_of(name))
    assert found["--json"].metavar == "FILE"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_flag_names_use_dashes(name):
    assert [s for s in options(parser_of(name)) if "_" in s] == []


@pytest.mark.parametrize("name", ["train", "demo"])
def test_training_settings_are_set_key_value(name):
    args = parser_of(name).parse_args(["--set", "max_steps=3", "--set", "lr=1e-3"])
    assert args.overrides == ["max_steps=3", "lr=1e-3"]


def test_serve_parses_to_the_shared_defaults():
    args = parser_of("serve").parse_args(["--model", "m"])
    assert (args.device, args.dtype) == ("auto", "float32")


@pytest.mark.parametrize(
    "argv", [["-v", "info", "gpt2-tiny"], ["info", "gpt2-tiny", "-v"], ["info", "--verbose", "gpt2-tiny"]]
)
def test_global_flags_before_or_after_the_subcommand(monkeypatch, capsys, argv):
    levels = []
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    assert main(argv) == 0
    assert main(["info", "gpt2-tiny"]) == 0
    assert levels == [logging.DEBUG, logging.INFO]


def one_line_error(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(prefix), err
    assert "Traceback" not in err
    return err


def test_unwritable_json_path_is_a_one_line_error(tmp_path, capsys):
    """The message is OSError's reason, without str()'s "[Errno 17]" before it."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "x.json"
    assert main(["trace", "--model", "gpt2-tiny", "--prompt", "hi", "--json", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"gptlab trace: error: cannot write {out}: {tmp_path / 'file'} is a file, not a directory"
    assert main(["info", "gpt2-tiny", "--json", str(out)]) == 2
    assert str(tmp_path / "file") in one_line_error(capsys, "gptlab info: error: cannot write ")


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (OSError(errno.ENOTDIR, "cannot write x/y: Not a directory"), "cannot write x/y: Not a directory"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "x.bin"), "x.bin: No such file or directory"),
        (OSError(errno.EXDEV, "Invalid cross-device link", "a", None, "b"), "a -> b: Invalid cross-device link"),
        (OSError("no errno"), "no errno"),
    ],
)
def test_os_errors_are_their_reason_without_the_errno(monkeypatch, capsys, error, message):
    failing(monkeypatch, error)
    assert main(["info", "gpt2"]) == 2
    assert capsys.readouterr().err == f"gptlab info: error: {message}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--set", "data_dir={d}", "--set", "out_dir={d}/out", "--set", "max_steps=1"],
         "{d}: no readable manifest.json (No such file or directory); run `gptlab prepare` first"),
        (["generate", "--model", "gpt2-tiny", "--adapter", "{d}", "--prompt", "x"],
         "{d}: not a PEFT adapter directory (adapter_config.json: No such file or directory)"),
    ],
)  # fmt: skip
def test_a_missing_file_in_a_directory_is_named_without_the_errno(tmp_path, capsys, argv, message):
    """The library's ValueErrors that wrap an OSError quoted str(e): "([Errno 2] No such file or
    directory: '.../manifest.json')", the path twice and the errno."""
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    assert one_line_error(capsys, "gptlab ") == f"gptlab {argv[0]}: error: {message.format(d=tmp_path)}\n"


def test_an_unreadable_prompt_file_names_it_without_the_errno(tmp_path, capsys):
    missing = tmp_path / "prompt.txt"
    assert main(["generate", "--model", "gpt2-tiny", "--prompt-file", str(missing), "--max-new-tokens", "1"]) == 2
    err = one_line_error(capsys, "gptlab generate: error: ")
    assert err == f"gptlab generate: error: cannot read --prompt-file {missing}: No such file or directory\n"


def test_serve_on_a_port_in_use_is_a_one_line_error_before_loading(monkeypatch, capsys):
    from gptlab.commands import serve

    loaded = []
    monkeypatch.setattr(serve, "load", lambda args: loaded.append(args))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "gpt2-tiny", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in one_line_error(
        capsys, "gptlab serve: error: "
    )
    assert loaded == []
    assert main(["serve", "--model", "gpt2-tiny", "--host", "192.0.2.1"]) == 2  # not this machine's address
    assert "cannot listen on 192.0.2.1:8000" in one_line_error(capsys, "gptlab serve: error: ")
    assert main(["serve", "--model", "gpt2-tiny", "--port", "99999"]) == 2  # was an OverflowError's traceback
    assert "cannot listen on 127.0.0.1:99999: bind(): port must be 0-65535" in one_line_error(
        capsys, "gptlab serve: error: "
    )


def test_demo_refuses_a_passage_of_no_tokens_before_training(tmp_path, capsys):
    """--max-new-tokens 0 failed after the whole training budget (minutes), at the sample."""
    assert main(["demo", "--out", str(tmp_path / "demo"), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be at least 1, got 0" in one_line_error(capsys, "gptlab demo: error: ")
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize(
    "setting, key", [("out_dir=elsewhere", "out_dir"), ("data_dir=elsewhere", "data_dir"), ("out-dir = x", "out_dir")]
)
def test_demo_refuses_to_set_the_directories_it_sets_itself(setting, key, tmp_path, capsys):
    """--set out_dir=... and --set data_dir=... were silently replaced by the demo's own, under --out."""
    assert main(["demo", "--out", str(tmp_path / "demo"), "--set", "max_steps=1", "--set", setting]) == 2
    err = one_line_error(capsys, "gptlab demo: error: ")
    assert f"the demo sets {key} itself" in err and "give --out DIR instead" in err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("key", ["out_dir", "data_dir"])
def test_demo_refuses_a_config_that_sets_the_directories_it_sets_itself(key, tmp_path, capsys):
    """A --config file's out_dir and data_dir were silently replaced by the demo's own (a --set of
    them is refused): the run went to runs/demo/run, not where the file said."""
    config = tmp_path / "my.toml"
    config.write_text(f'[train]\nmax_steps = 1\n{key} = "{tmp_path / "mine"}"\n')
    assert main(["demo", "--out", str(tmp_path / "demo"), "--config", str(config)]) == 2
    err = one_line_error(capsys, "gptlab demo: error: ")
    assert f"--config {config} sets {key}: the demo sets it itself" in err
    assert not (tmp_path / "demo").exists() and not (tmp_path / "mine").exists()


@pytest.mark.parametrize(
    "argv, env, threads", [([], {}, None), (["--threads", "2"], {}, 2), ([], {"OMP_NUM_THREADS": "4"}, None)]
)
def test_serve_decodes_on_every_core_unless_told(monkeypatch, capsys, argv, env, threads):
    """Decoding threads: --threads, else torch's count (OMP_NUM_THREADS, else every core)."""
    import uvicorn

    import gptlab.serve.app
    from gptlab.commands import serve

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    asked = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    monkeypatch.setattr(serve, "load", lambda args: (None, None))
    monkeypatch.setattr(gptlab.serve.app, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    assert main(["serve", "--model", "gpt2-tiny", "--port", "0", *argv]) == 0
    assert asked == ([] if threads is None else [threads])
    assert "4 decoding threads" in capsys.readouterr().out  # torch's count, here the patched one


def test_missing_file_is_a_one_line_error(tmp_path, capsys):
    argv = ["eval", "--model", "gpt2-tiny", "--device", "cpu", "--task", "perplexity", "--data", str(tmp_path / "no")]
    assert main(argv) == 2
    assert "no" in one_line_error(capsys, "gptlab eval: error: ")


def test_unknown_device_is_a_one_line_error(capsys):
    assert main(["next", "--model", "gpt2-tiny", "--prompt", "x", "--device", "warp9"]) == 2
    assert "--device warp9" in one_line_error(capsys, "gptlab next: error: ")


def test_a_kernel_variant_this_cpu_cannot_run_is_a_one_line_error(monkeypatch, capsys):
    """GPTLAB_KERNELS forcing a variant the CPU lacks the instructions for was a RuntimeError from
    inside the first forward: a 49-line traceback from every command."""
    from gptlab import kernels

    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))  # AMD Zen 3's
    monkeypatch.setenv("GPTLAB_KERNELS", "avx512" if kernels.kernel_build.is_x86() else "avx2")
    assert main(["generate", "--model", "gpt2-tiny", "--prompt", "Hello", "--max-new-tokens", "2"]) == 2
    assert "this CPU" in one_line_error(capsys, "gptlab generate: error: GPTLAB_KERNELS=")


def test_bad_flag_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["eval", "--model", "m", "--task", "perplexity", "--out", "x.json"])  # --out is --json now
    assert exit.value.code == 2
    assert "--out" in one_line_error(capsys, "gptlab eval: error: unrecognized arguments")


def failing(monkeypatch, error: BaseException):
    """`gptlab info` with its run() raising `error`."""
    from gptlab.commands import info

    def run(args):
        raise error

    monkeypatch.setattr(info, "run", run)


def test_missing_optional_package_names_the_extra(monkeypatch, capsys):
    failing(monkeypatch, ModuleNotFoundError("No module named 'transformers'", name="transformers"))
    assert main(["info", "gpt2"]) == 2
    assert "pip install 'gptlab[dev]'" in one_line_error(capsys, "gptlab info: error: ")
    failing(monkeypatch, ModuleNotFoundError("No module named 'datasets'", name="datasets"))
    assert main(["info", "gpt2"]) == 2
    assert "pip install datasets" in one_line_error(capsys, "gptlab info: error: ")


def test_gptlabs_own_import_error_keeps_its_traceback(monkeypatch):
    failing(monkeypatch, ImportError("cannot import name 'x' from 'gptlab.model'", name="gptlab.model"))
    with pytest.raises(ImportError):
        main(["info", "gpt2"])


def test_multi_line_value_error_is_one_line(monkeypatch, capsys):
    failing(monkeypatch, ValueError("first\nsecond"))
    assert main(["info", "gpt2"]) == 2
    assert one_line_error(capsys, "gptlab info: error: ") == "gptlab info: error: first second\n"


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    failing(monkeypatch, KeyboardInterrupt())
    assert main(["info", "gpt2"]) == 130
    one_line_error(capsys, "gptlab info: interrupted")


def test_other_exceptions_are_bugs_with_a_traceback(monkeypatch):
    failing(monkeypatch, RuntimeError("an internal invariant"))
    with pytest.raises(RuntimeError):
        main(["info", "gpt2"])


def test_a_real_missing_package_through_the_command_line(tmp_path):
    """`transformers` shadowed by a package that fails as a missing one does: the benchmark that
    needs it ends with the pip command, exit code 2, no traceback."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n"
    )
    (tmp_path / "text.txt").write_text("hello world " * 20)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src)])}
    argv = ["bench", "quantize", "--data", str(tmp_path / "text.txt"), "--out", "", "--tokens", "8"]
    done = subprocess.run([sys.executable, "-m", "gptlab", *argv], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "gptlab bench: error: this needs the package 'transformers', which is not installed: pip install 'gptlab[dev]'\n"
    )


@pytest.mark.parametrize("command", [["quantize", "--mode", "int8"], ["export"], ["export", "--format", "llmc"]])
def test_writing_over_the_model_read_is_refused_and_keeps_it(tmp_path, capsys, monkeypatch, command):
    """--out naming the --model it reads (through a checkpoint's `latest` link, or the run directory
    that resolves to it), a directory around it or a path already inside it, or another training checkpoint, is refused
    before anything is written: `gptlab quantize` replaced a training checkpoint's fp32 weights with
    int8 ones."""
    from conftest import tiny_model
    from gptlab.checkpoint import save_model

    save_model(tiny_model(), tmp_path / "ckpt-000010", tokenizer="byte")
    (tmp_path / "ckpt-000010" / "train_state.json").write_text("{}")  # a training checkpoint's own file
    (tmp_path / "latest").symlink_to("ckpt-000010")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt-000010").iterdir()}
    (tmp_path / "ckpt-000005").mkdir()
    (tmp_path / "ckpt-000005" / "train_state.json").write_text("{}")
    read = {"ckpt-000010": "is (or holds) the --model", "latest": "is (or holds) the --model", ".": "is (or holds)",
            "ckpt-000010/model.safetensors": "is a file of the --model", "ckpt-000005": "is a training checkpoint or run"}  # fmt: skip
    for model in ("latest", "."):  # the checkpoint itself, and the run directory that resolves to it
        for out, message in read.items():
            argv = [command[0], "--model", str(tmp_path / model), "--out", str(tmp_path / out), *command[1:]]
            assert main(argv) == 2, (model, out)
            assert message in capsys.readouterr().err
            assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt-000010").iterdir()} == before
    assert main([*argv[:3], "--out", str(tmp_path / "copy"), *command[1:]]) == 0  # anywhere else is written
    beside = tmp_path / "ckpt-000010" / ("m.gguf" if "gguf" in command else "new")  # a new path in its folder
    assert main([*argv[:3], "--out", str(beside), *command[1:]]) == 0
    monkeypatch.setenv("HOME", str(tmp_path))  # --out=~/x, a ~ no shell expands: under home, not ./~
    assert main([*argv[:3], "--out=~/home-copy", *command[1:]]) == 0 and (tmp_path / "home-copy").exists()


@pytest.mark.parametrize(
    ("command", "directory"),
    [(["quantize", "--mode", "int8"], True), (["export"], True), (["export", "--format", "llmc"], False)],
)
def test_an_out_that_cannot_be_written_is_refused_before_loading(tmp_path, capsys, monkeypatch, command, directory):
    """A directory's --out that is a file, a file's --out that is a directory, or one under a file
    was refused only as the result was written: after loading (and quantizing) the model."""
    from conftest import tiny_model
    from gptlab import loading
    from gptlab.checkpoint import save_model

    save_model(tiny_model(), tmp_path / "model", tokenizer="byte")
    (tmp_path / "afile").write_text("kept")
    (tmp_path / "adir").mkdir()
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    cases = {"afile/sub": "afile is a file, not a directory"}
    cases.update(
        {"afile": "afile is a file, not a directory"}
        if directory
        else {"adir": "adir is a directory; name the file to write"}
    )
    for out, message in cases.items():
        argv = [command[0], "--model", str(tmp_path / "model"), "--out", str(tmp_path / out), *command[1:]]
        assert main(argv) == 2, out
        assert capsys.readouterr().err == f"gptlab {command[0]}: error: --out {tmp_path / out}: {tmp_path}/{message}\n"
    assert (tmp_path / "afile").read_text() == "kept" and not any((tmp_path / "adir").iterdir())


@pytest.mark.parametrize(
    ("command", "other", "message"),
    [(["export"], "gptlab", "holds a gptlab model (gptlab.json)"),
     (["quantize", "--mode", "int8"], "hf", "holds a Hugging Face model (config.json)")],
)  # fmt: skip
def test_an_out_holding_a_model_of_the_other_layout_is_refused(tmp_path, capsys, command, other, message):
    """Both layouts keep their weights in model.safetensors: `gptlab export --out D` into a gptlab
    model's directory replaced its weights and left its gptlab.json, which gptlab then read (the
    load failed: "is torch.float32, the model expects torch.int8" for a quantized one); `quantize
    --out D` into a Hugging Face directory replaced the weights config.json describes."""
    from conftest import tiny_model
    from gptlab.checkpoint import save_model
    from gptlab.hf import save_pretrained

    save_model(tiny_model(), tmp_path / "model", tokenizer="byte")
    (save_model if other == "gptlab" else save_pretrained)(tiny_model(seed=1), tmp_path / "other", tokenizer="byte")
    before = {p.name: p.read_bytes() for p in (tmp_path / "other").iterdir()}
    argv = [command[0], "--model", str(tmp_path / "model"), "--out", str(tmp_path / "other"), *command[1:]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "other").iterdir()} == before
    assert main([*argv[:4], str(tmp_path / "new"), *command[1:]]) == 0  # a fresh directory is written


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_writing_over_a_file_of_another_training_checkpoint_is_refused(tmp_path, capsys, name):
    """--out naming a file of a training checkpoint other than the --model read is refused and the
    file kept: `gptlab export --out runs/b/latest/model.safetensors --format gguf` replaced run b's
    weights with the export of another model."""
    from conftest import tiny_model
    from gptlab.checkpoint import save_model

    save_model(tiny_model(), tmp_path / "model", tokenizer="byte")
    other = tmp_path / "run" / "ckpt-000005"
    save_model(tiny_model(), other, tokenizer="byte")
    (other / "train_state.json").write_text("{}")
    (other / "optimizer.pt").write_bytes(b"optimizer state")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    argv = ["export", "--model", str(tmp_path / "model"), "--format", "llmc", "--out", str(other / name)]
    assert main(argv) == 2
    assert "is a file of a training checkpoint" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert main([*argv[:-1], str(other / "new.bin")]) == 0  # a new file in its folder is written


def test_train_under_torchrun_warns_about_the_config_on_rank_0_alone(tmp_path, monkeypatch, caplog):
    """README: under torchrun the ranks other than 0 print errors only. The config's warnings (the
    old key `dtype`) came from every rank, as they were logged before the rank was consulted."""
    import logging

    import gptlab.train

    monkeypatch.setattr(gptlab.train, "train", lambda cfg: {})
    argv = ["train", "--set", "dtype=float32", "--set", f"out_dir={tmp_path / 'run'}"]
    root = logging.getLogger()
    level = root.level
    try:
        for rank, warned in (("1", False), ("0", True)):
            monkeypatch.setenv("RANK", rank)
            root.setLevel(logging.INFO)
            caplog.clear()
            assert main(argv) == 0
            assert any("'dtype' is deprecated" in r.getMessage() for r in caplog.records) == warned, rank
    finally:
        root.setLevel(level)
