import subprocess
import sys

from gptlab.cli import COMMANDS, main


def test_help_lists_commands_without_importing_torch():
    code = "import sys; from gptlab.cli import main\ntry:\n main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")
    for name in COMMANDS:
        assert name in out


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
