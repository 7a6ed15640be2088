"""Model-name resolution (models directory, Hugging Face cache) and the `hybridjit` command."""

import argparse
import os
import re
from pathlib import Path

import pytest
from checkpoint_factory import tiny_config, write_checkpoint

import hybridjit
from hybridjit import cli
from hybridjit.resolve import ModelNotFoundError, default_model_dir, resolve_model

GREEDY_FIBONACCI = '\n    """\n    Create a string representation of the file.\n'  # the embedded model's completion


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), tiny_config("v3"), seed=9, weight_format="fp8")


@pytest.fixture
def isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDJIT_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return tmp_path


def test_no_name_is_the_embedded_model():
    assert (resolve_model(None) / "config.json").is_file()
    assert resolve_model(None) == default_model_dir()


def test_name_in_models_dir(isolated_dirs):
    target = isolated_dirs / "models" / "DeepSeek-V3"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert resolve_model("deepseek-v3") == target


def test_name_in_hub_cache(isolated_dirs):
    repo = isolated_dirs / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V2-Lite"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model("deepseek-v2-lite") == snapshot
    assert resolve_model("deepseek-ai/DeepSeek-V2-Lite") == snapshot


def test_not_found_says_where_it_looked_and_what_to_do(isolated_dirs):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("deepseek-v3")
    message = str(e.value)
    assert str(isolated_dirs / "models" / "DeepSeek-V3") in message
    assert "models--deepseek-ai--DeepSeek-V3/snapshots" in message
    assert "huggingface-cli download deepseek-ai/DeepSeek-V3" in message
    assert "HYBRIDJIT_MODELS" in message


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(tmp_path)


def test_cli_info(checkpoint, capsys):
    assert cli.main(["info", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "deepseek_v3" in out
    assert "4 (1 dense, 3 MoE)" in out
    assert "16 routed (top-4, noaux_tc, 4 groups keep 2), 1 shared" in out
    assert "fp8 e4m3, block 128x128" in out
    assert "F8_E4M3" in out


def test_cli_generate_on_the_embedded_model(capsys):
    assert cli.main(["generate", "--max-new-tokens", "8", "def main("]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # some text was generated
    assert "loading weights" in captured.err and "100.0%" in captured.err


def test_cli_error_is_one_clear_line(isolated_dirs, capsys):
    assert cli.main(["info", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridjit: error: no checkpoint for 'no-such-model'")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", str(2**64), "x"], "argument --seed: 18446744073709551616 is not in [0, 2**64)"),
        (["--seed", "-1", "x"], "argument --seed: -1 is not in [0, 2**64)"),
        (["--seed", "1.5", "x"], "argument --seed: '1.5' is not an integer"),
        (["--dtype", "float16", "x"], "argument --dtype: invalid choice: 'float16'"),
        (["--dtype", "fp32", "x"], "argument --dtype: invalid choice: 'fp32'"),
        ([os.fsdecode(b"caf\xe9")], "argument prompt: not valid UTF-8 text"),  # as argv brings such bytes
        (["--stop", os.fsdecode(b"\xff"), "x"], "argument --stop: not valid UTF-8 text"),
    ],
)
def test_bad_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"hybridjit generate: error: {message}")


@pytest.mark.parametrize("command", [["info"], ["generate", "x", "--model"]])
def test_a_config_that_is_a_json_list_is_one_error_line(tmp_path, capsys, command):
    (tmp_path / "config.json").write_text("[1, 2]")
    assert cli.main([*command, str(tmp_path)]) != 0  # 2 once ModelConfig raises ConfigError for it
    err = capsys.readouterr().err
    assert err.startswith("hybridjit: error: ") and err.count("\n") == 1


@pytest.fixture
def my_model(isolated_dirs, monkeypatch):
    """A checkpoint named mymodel in the models directory, seen from a working directory and home without one."""
    target = isolated_dirs / "models" / "mymodel"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    work = isolated_dirs / "home" / "work"
    work.mkdir(parents=True)
    (work / "weights.safetensors").write_bytes(b"")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(work))
    return target


@pytest.mark.parametrize(
    "written, state",
    [
        ("./mymodel", "does not exist"),
        ("../mymodel", "does not exist"),
        ("~/mymodel", "does not exist"),
        ("/no/such/dir/mymodel", "does not exist"),
        ("mymodel/", "does not exist"),
        ("org/mymodel/extra", "does not exist"),
        ("./weights.safetensors", "is not a directory"),
    ],
)
def test_an_argument_written_as_a_path_is_only_that_path(my_model, written, state):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(written)
    assert str(e.value) == (
        f"{os.path.expanduser(written)} {state}: a checkpoint is a directory with config.json and *.safetensors, "
        "or a .gguf file"
    )


def test_bare_names_are_looked_up_after_a_directory_of_that_name(my_model):
    assert resolve_model("mymodel") == my_model
    local = my_model.parent.parent / "home" / "work" / "mymodel"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model("mymodel").resolve() == local


def test_a_bare_gguf_file_name_is_that_file_in_the_working_directory(my_model):
    (Path.cwd() / "tiny.gguf").write_bytes(b"GGUF")
    assert resolve_model("tiny.gguf") == Path("tiny.gguf")
    with pytest.raises(ModelNotFoundError, match="^other.gguf does not exist: a checkpoint is a directory"):
        resolve_model("other.gguf")  # not looked up as a name in the models directory


def test_a_repo_id_is_looked_for_once_in_each_place(isolated_dirs):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("org/name")
    looked = str(e.value).split("Looked in: ")[1].split(". To provide it")[0].split("; ")
    assert len(looked) == len(set(looked)) == 3  # models/org/name, models/name, the hub cache's snapshots


def test_cli_path_that_does_not_exist(my_model, capsys):
    assert cli.main(["info", "./typo-dir"]) == 2
    assert capsys.readouterr().err == (
        "hybridjit: error: ./typo-dir does not exist: a checkpoint is a directory with config.json and *.safetensors, "
        "or a .gguf file\n"
    )


def test_help_shows_every_option_with_help_and_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    (subcommands,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, parser in subcommands.choices.items():
        assert all(action.help for action in parser._actions), name
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "most tokens to generate (default: 64)" in out and "in [0, 2**64) (default: 0)" in out
    assert "(default: the embedded model)" in out and "(default: None)" not in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"hybridjit {hybridjit.__version__}\n"


def test_generate_notes_compiling_and_statistics_on_stderr(capsys):
    assert cli.main(["generate", "--max-new-tokens", "8", "def fibonacci(n):"]) == 0
    out, err = capsys.readouterr()
    assert GREEDY_FIBONACCI.startswith(out.rstrip("\n"))  # only the completion on stdout
    assert "compiling the model's programs" in err
    assert re.search(r"^prompt \d+ tokens, first token \d+\.\d\d s, \d+ tokens at \d+\.\d tok/s$", err, re.M)


def test_quiet_generate_writes_nothing_on_stderr(capsys):
    assert cli.main(["generate", "--quiet", "--max-new-tokens", "8", "def fibonacci(n):"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and GREEDY_FIBONACCI.startswith(out.rstrip("\n"))


def test_statistics_summary():
    stats = cli.GenerationStats()
    assert stats.summary(5) == "prompt 5 tokens, no new tokens"
    stats.start, stats.first, stats.last, stats.tokens = 10.0, 11.25, 13.25, 41
    assert stats.summary(5) == "prompt 5 tokens, first token 1.25 s, 41 tokens at 20.0 tok/s"


def test_stop_strings_end_the_completion_before_the_first_of_them(capsys):
    argv = ["generate", "--quiet", "--stop", "file", "--stop", "string", "def fibonacci(n):"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == '\n    """\n    Create a \n'
