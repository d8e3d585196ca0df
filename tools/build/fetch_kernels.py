"""Lift DeepSeek's prebuilt FlashMLA and DeepGEMM out of a PyPI vLLM wheel into a kernels folder for build.sh.

    python tools/build/fetch_kernels.py [DEST]          (default .kernels; needs PyPI, about 250 MB downloaded)

vLLM's wheel ships both libraries compiled against its own torch and CUDA. vllm 0.25.0's binaries load with torch
2.11 + CUDA 13 (the H200 test box; kernel-anchors §10), so that is the release taken here; other torch builds need
the vLLM release built for them (``--vllm``). Only the compiled parts are kept, about 32 MB:

    DEST/deepinfer_flashmla/_flashmla_C.abi3.so   FlashMLA's extension (registers ``torch.ops._flashmla_C``)
    DEST/deep_gemm/                                DeepGEMM: its package, the extension for this Python, and the
                                                   CUTLASS/CuTe headers its JIT compiles against

``DEEPINFER_KERNELS_DIR=DEST DEEPINFER_ACCELERATOR=nvidia ./build.sh`` then puts DEST on the interpreter's path and
reports what loads. The folder is build output: keep it out of git.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FLASHMLA = "vllm/_flashmla_C.abi3.so"
DEEP_GEMM = "vllm/third_party/deep_gemm/"


def _download(release: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(into),
                    f"vllm=={release}"], check=True)
    return next(into.glob("vllm-*.whl"))


def _extract(wheel: Path, dest: Path, python_tag: str) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        if FLASHMLA not in names:
            raise SystemExit(f"{wheel.name} has no {FLASHMLA}: pick another vLLM release")
        flashmla = dest / "deepinfer_flashmla"
        flashmla.mkdir(parents=True, exist_ok=True)
        (flashmla / "__init__.py").write_text('"""FlashMLA\'s compiled extension, lifted from a vLLM wheel."""\n')
        (flashmla / "_flashmla_C.abi3.so").write_bytes(archive.read(FLASHMLA))
        extensions = [n for n in names if n.startswith(DEEP_GEMM + "_C.")]
        if not any(f".{python_tag}-" in n for n in extensions):
            raise SystemExit(f"{wheel.name} has no DeepGEMM extension for {python_tag} (it has {extensions})")
        for name in names:
            if not name.startswith(DEEP_GEMM) or name.endswith("/"):
                continue
            if name in extensions and f".{python_tag}-" not in name:
                continue  # another Python's build
            target = dest / "deep_gemm" / name[len(DEEP_GEMM):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", nargs="?", default=".kernels", type=Path)
    parser.add_argument("--vllm", default="0.25.0", help="vLLM release whose binaries match the target torch/CUDA")
    parser.add_argument("--python", default="cpython-312", help="the target interpreter's tag (the H200 box: 3.12)")
    parser.add_argument("--wheel", type=Path, help="an already downloaded vLLM wheel")
    args = parser.parse_args()
    for stale in ("deepinfer_flashmla", "deep_gemm"):
        shutil.rmtree(args.dest / stale, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or _download(args.vllm, Path(tmp))
        _extract(wheel, args.dest, args.python)
    size = sum(p.stat().st_size for p in args.dest.rglob("*") if p.is_file())
    print(f"fetch_kernels: FlashMLA and DeepGEMM from {wheel.name} in {args.dest} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
