"""`hybridjit convert` never harms its source, replaces a destination only when told to and writes files as
any program does; `hybridjit info` names the format it wrote."""

import os
import stat

import numpy as np
import pytest
from checkpoint_factory import tensor_digest, tiny_config, write_checkpoint

from hybridjit import cli
from hybridjit.export import save_checkpoint


@pytest.fixture
def source(tmp_path):
    src = write_checkpoint(tmp_path / "src", tiny_config("v3"), seed=5, weight_format="bf16")
    (src / "tokenizer_config.json").write_text("{}")
    (src / "tokenizer_config.json").chmod(0o600)  # a private source file: its copy gets the usual mode
    return src


@pytest.fixture
def umask():
    """Sets the process umask for the test (and restores it)."""
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


def convert(capsys, *argv) -> tuple[int, str]:
    status = cli.main(["convert", *map(str, argv)])
    return status, capsys.readouterr().err


def modes(directory) -> dict[str, int]:
    return {f.name: stat.S_IMODE(f.stat().st_mode) for f in directory.iterdir()}


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_saved_files_have_the_mode_the_umask_gives(tmp_path, umask, mask, mode):
    umask(mask)
    tensors = {f"t{i}": np.full((64,), i, np.float32) for i in range(3)}
    save_checkpoint(tmp_path / "one", {}, tensors)
    save_checkpoint(tmp_path / "sharded", {}, tensors, max_shard_bytes=300)  # one tensor a shard, and an index
    assert set(modes(tmp_path / "one").values()) == {mode}
    assert len(modes(tmp_path / "sharded")) == 5 and set(modes(tmp_path / "sharded").values()) == {mode}


def test_converted_files_have_the_usual_mode(source, tmp_path, umask, capsys):
    assert convert(capsys, source, tmp_path / "dst", "--format", "bf16") == (0, "")
    written = modes(tmp_path / "dst")
    assert "tokenizer_config.json" in written and set(written.values()) == {0o644}


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["", "force"])
@pytest.mark.parametrize("where", ["itself", "a link to it", "inside it", "its parent"])
def test_refuses_a_destination_that_is_in_or_holds_the_source(source, tmp_path, capsys, where, force):
    digest = tensor_digest(source)
    files = sorted(os.listdir(source))
    (tmp_path / "link").symlink_to(source)
    dst = {"itself": source, "a link to it": tmp_path / "link", "inside it": source / "sub", "its parent": tmp_path}
    status, err = convert(capsys, source, dst[where], "--format", "fp8", *force)
    assert status == 2
    assert err.startswith("hybridjit: error: destination") and err.count("\n") == 1
    assert "source checkpoint" in err
    assert tensor_digest(source) == digest and sorted(os.listdir(source)) == files


def test_a_non_empty_destination_is_replaced_only_with_force(source, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old-file").write_text("mine")
    status, err = convert(capsys, source, dst, "--format", "fp8")
    assert status == 2 and "is not empty" in err and "--force" in err
    assert os.listdir(dst) == ["old-file"]

    assert convert(capsys, source, dst, "--format", "fp8", "--force") == (0, "")
    assert "old-file" not in os.listdir(dst) and (dst / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # nothing left aside or half-written


@pytest.mark.parametrize("fmt, bits", [("int8", 8), ("int4", 4)])
def test_info_names_an_int_format(source, tmp_path, capsys, fmt, bits):
    assert convert(capsys, source, tmp_path / fmt, "--format", fmt) == (0, "")
    assert cli.main(["info", str(tmp_path / fmt)]) == 0
    assert f"format          int{bits} routed experts, groups of 128 input columns" in capsys.readouterr().out


def test_a_failed_conversion_leaves_the_destination_as_it_was(source, tmp_path, capsys, monkeypatch):
    def disk_full(directory, config, tensors):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hybridjit.convert.save_checkpoint", disk_full)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old-file").write_text("mine")
    status, err = convert(capsys, source, dst, "--format", "bf16", "--force")
    assert status == 1 and err == "hybridjit: error: OSError: [Errno 28] No space left on device\n"
    assert os.listdir(dst) == ["old-file"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_a_gguf_source_is_refused_in_one_line(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # refused by what it is, before it is read
    status, err = convert(capsys, gguf, tmp_path / "out", "--format", "bf16")
    assert status == 2
    assert err == (f"hybridjit: error: {gguf}: a GGUF file is loaded as it is (hybridjit.load, --model); convert takes "
                   "a safetensors checkpoint directory\n")
    assert not (tmp_path / "out").exists()
