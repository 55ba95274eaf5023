"""The CLI on bad input: a non-zero exit code and one error line on stderr, never a traceback, nothing allocated.

Every case runs ``vtoken.cli.main(argv)`` in-process.
"""
from __future__ import annotations

import json
import os

import pytest

from vtoken.cli import main


def error_line(capsys, argv, code: int = 2) -> str:
    """Run the CLI expecting failure with ``code``; return its last stderr line (the error) after checking no
    traceback was printed."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a model would be built or loaded."""
    from vtoken.experiments.common import ModelSpec

    built = []
    monkeypatch.setattr(ModelSpec, "build", lambda self: built.append(self))
    monkeypatch.setattr(ModelSpec, "load", lambda self: built.append(self))
    yield
    assert built == []


# ----------------------------------------------------------------------- sizes refused up front
@pytest.mark.parametrize("argv, line", [
    (["demo", "--requests", "1000000000"],
     "requests: expected a pool of at most 134217728 blocks of 16 tokens (int32 slot ids), got 1000000000, "
     "which needs 49406250001"),
    (["demo", "--prompt-len", str(2**40)],
     "prompt_len + output_len: expected a pool of at most 134217728 blocks of 16 tokens (int32 slot ids), "
     "got 1099511628032, which needs 68719476753"),
])
def test_demo_sizes_beyond_the_pool_are_refused_before_any_model(capsys, no_model, argv, line):
    assert error_line(capsys, argv) == f"vtoken demo: error: {line}"


def test_demo_prompts_beyond_memory_are_refused_before_any_model(capsys, no_model, monkeypatch):
    import vtoken.experiments.common as common

    monkeypatch.setattr(common, "memory_bytes", lambda device=None: 2**20)
    line = error_line(capsys, ["demo", "--requests", "1000"])
    assert line == ("vtoken demo: error: requests: expected at most 1.0 MiB of prompts (this machine's memory), "
                    "got 1000, which needs about 4.0 MiB")


# ------------------------------------------------------------------------------- prompt files
@pytest.mark.parametrize("content, line", [
    (b"hello\n\xc3\x28\n", "prompts (p.txt line 2): expected UTF-8 text, got the byte b'\\xc3' at offset 6"),
    (b"[" * 50000 + b"\n", "prompts (p.txt line 1): expected chat messages (a list of {'role', 'content'} objects), "
     "got JSON nested too deeply to read"),
])
def test_a_bad_prompts_file_is_one_line(capsys, no_model, tmp_path, content, line):
    p = tmp_path / "p.txt"
    p.write_bytes(content)
    assert error_line(capsys, ["demo", "--prompts", str(p)]) == f"vtoken demo: error: {line}"


# --------------------------------------------------------------------------- broken checkpoints
def _broken_checkpoints(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF\x03\x00\x00\x00\x05\x00")
    nocfg = tmp_path / "nocfg"
    nocfg.mkdir()
    badcfg = tmp_path / "badcfg"
    badcfg.mkdir()
    (badcfg / "config.json").write_text('{"hidden_size": 64,')
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 100000 + "]" * 100000)
    notobj = tmp_path / "notobj"
    notobj.mkdir()
    (notobj / "config.json").write_text("[1, 2]")
    return {
        "empty": (empty, "expected a GGUF file (it starts with b'GGUF' and a version), got "),
        "trunc": (trunc, "expected a complete GGUF file, got "),
        "nocfg": (nocfg, "expected a checkpoint directory with config.json, got "),
        "badcfg": (badcfg, "expected a JSON object in "),
        "deep": (deep, "(too deeply nested)"),
        "notobj": (notobj, "got list"),
    }


@pytest.mark.parametrize("which", ["empty", "trunc", "nocfg", "badcfg", "deep", "notobj"])
def test_a_broken_checkpoint_is_a_typed_error(tmp_path, which):
    pytest.importorskip("gguf")
    from vtoken.engine.pretrained import load_checkpoint
    from vtoken.errors import InvalidArgumentError

    path, text = _broken_checkpoints(tmp_path)[which]
    with pytest.raises(InvalidArgumentError) as e:
        load_checkpoint(str(path))
    assert text in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("which", ["empty", "trunc", "nocfg", "badcfg", "deep"])
def test_a_broken_model_path_is_one_line(capsys, tmp_path, which):
    pytest.importorskip("gguf")
    path, text = _broken_checkpoints(tmp_path)[which]
    line = error_line(capsys, ["demo", "--model-path", str(path)])
    assert line.startswith("vtoken demo: error: ") and text in line


# ------------------------------------------------------------------------------ model fetch/export
@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    return f


def test_fetch_into_a_path_under_a_file_is_refused_before_downloading(capsys, a_file, monkeypatch):
    import vtoken.checkpoints as ck

    monkeypatch.setattr(ck, "fetch", lambda *a, **kw: pytest.fail("fetched"))
    line = error_line(capsys, ["model", "fetch", "smollm2", "--dir", str(a_file / "sub")])
    assert line == (f"vtoken model fetch: error: dir: expected a directory that exists or can be created, got "
                    f"'{a_file / 'sub'}' ('{a_file}' is a file)")


def test_export_into_a_path_under_a_file_is_refused(capsys, a_file, tmp_path, monkeypatch):
    import vtoken.checkpoints as ck

    monkeypatch.setattr(ck, "export", lambda *a, **kw: pytest.fail("exported"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF\x03\x00\x00\x00")
    line = error_line(capsys, ["model", "export", str(src), str(a_file / "out")])
    assert line == (f"vtoken model export: error: out_dir: expected a directory that exists or can be created, "
                    f"got '{a_file / 'out'}' ('{a_file}' is a file)")
    line = error_line(capsys, ["model", "export", str(src), str(a_file)])
    assert line == f"vtoken model export: error: out_dir: expected a directory, got the file '{a_file}'"


def test_export_into_a_non_empty_directory_needs_force(capsys, tmp_path, monkeypatch):
    import vtoken.checkpoints as ck

    calls = []
    monkeypatch.setattr(ck, "export", lambda name, out, cache=None: calls.append(out) or out)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF\x03\x00\x00\x00")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = error_line(capsys, ["model", "export", str(src), str(out)])
    assert line == (f"vtoken model export: error: out_dir: expected an empty or new directory (or --force), "
                    f"got '{out}' holding 1 entries")
    assert calls == [] and (out / "keep.txt").read_text() == "mine"
    assert main(["model", "export", str(src), str(out), "--force"]) == 0
    assert calls == [str(out)]


def test_a_failed_write_is_one_line_exit_1(capsys, tmp_path, monkeypatch):
    import vtoken.checkpoints as ck

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "export", full)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF\x03\x00\x00\x00")
    line = error_line(capsys, ["model", "export", str(src), str(tmp_path / "out")], code=1)
    assert line == "vtoken model export: error: [Errno 28] No space left on device"


def test_export_of_an_empty_gguf_is_refused(capsys, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"")
    line = error_line(capsys, ["model", "export", str(src), str(tmp_path / "out")])
    assert line.startswith("vtoken model export: error: model: expected a GGUF file")
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------------------- ignored flags
@pytest.mark.parametrize("argv, line", [
    (["quality", "--model-preset", "tiny"],
     "vtoken quality: error: model_preset: expected none with quality (it serves a real checkpoint: --model or "
     "--model-path), got 'tiny'"),
    (["demo", "--model-preset", "tiny", "--model-path", "/x"],
     "vtoken demo: error: model_preset: expected --model-preset or a real checkpoint (--model, --model-path), "
     "got both ('tiny', '/x')"),
    (["sla", "--cost-model", "h200", "--model-preset", "gpu"],
     "vtoken sla: error: model_preset: expected none with --cost-model h200 (the modeled run has no model "
     "forward), got 'gpu'"),
    (["frontier", "--trace-only", "--model-preset", "gpu"],
     "vtoken frontier: error: model_preset: expected none with --trace-only (no model forward), got 'gpu'"),
])
def test_a_flag_the_command_would_ignore_is_an_error(capsys, no_model, argv, line):
    assert error_line(capsys, argv) == line
