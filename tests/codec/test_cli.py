"""`hafiza codec inspect` and a tiny `hafiza codec bench` through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hafiza.cli import main
from hafiza.codec import CodecContext, encode


def _run(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> int:
    monkeypatch.setattr("sys.argv", ["hafiza", *args])
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_inspect_shows_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "k.hkv"
    path.write_bytes(encode(torch.randn(2, 40, 3, 4).to(torch.bfloat16), CodecContext(coder="exponent",
                                                                                      chunk_tokens=16)))
    assert _run(monkeypatch, ["codec", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "exponent" in out and "bf16" in out and "[2, 40, 3, 4]" in out


def test_inspect_refuses_foreign_files_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"not a container at all")
    assert _run(monkeypatch, ["codec", "inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not a hafiza KV container") and "Traceback" not in err


def test_bench_writes_json_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = tmp_path / "t.txt"
    text.write_text("Keys and values are kept so the past is never recomputed. " * 8)
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    args = ["codec", "bench", "--text", str(text), "--tokens", "24", "--coders", "raw,exponent,zstd-3",
            "--no-quantized", "--json", str(out), "--plot", str(png)]
    assert _run(monkeypatch, args) == 0
    result = json.loads(out.read_text())
    names = {c["coder"] for c in result["coders"]}
    assert names == {"raw", "exponent", "zstd-3"}
    for c in result["coders"]:
        assert c["lossless"] is True
        assert {"coder", "bits_per_value", "decode_MBps", "encode_MBps", "lossless"} <= set(c)
    assert png.read_bytes()[:4] == b"\x89PNG"
