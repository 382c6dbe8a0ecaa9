"""Builds pipecomm._C with ninja: CPU kernels always, CUDA kernels when torch has CUDA and nvcc exists."""

import os
import shutil
from pathlib import Path

from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).parent
SOURCE_LIST = ROOT / "csrc" / "sources.txt"


def read_sources() -> dict[str, list[str]]:
    """Sources by kind, from the one list CMakeLists.txt reads too."""
    sources: dict[str, list[str]] = {}
    for line in SOURCE_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            kind, path = line.split()
            sources.setdefault(kind, []).append(path)
    return sources


def unity_source(name: str, paths: list[str]) -> str:
    """One translation unit that includes ``paths``: each C++ file that includes torch's headers spends 10 to 30 s
    parsing them, so the files of one kind are compiled as one (the tree keeps one file per concern). Rewritten
    only when its list changes, so that ninja rebuilds it only when an included file does."""
    unit = ROOT / "build" / "unity" / f"{name}.cpp"
    text = "".join(f'#include "{(ROOT / path).resolve()}"\n' for path in paths)
    if not unit.exists() or unit.read_text() != text:
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(text)
    return str(unit.relative_to(ROOT))


def nvcc_path() -> str | None:
    if cpp_extension.CUDA_HOME is None:
        return None
    nvcc = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
    return str(nvcc) if nvcc.exists() else shutil.which("nvcc")


def use_cuda() -> tuple[bool, str]:
    """Decided by the toolchain and PIPECOMM_USE_CUDA, never by whether a GPU is visible."""
    import torch

    choice = os.environ.get("PIPECOMM_USE_CUDA", "auto").lower()
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"PIPECOMM_USE_CUDA must be auto, 0 or 1, not {choice!r}")
    if choice == "0":
        return False, "PIPECOMM_USE_CUDA=0"
    torch_has_cuda = torch.version.cuda is not None
    nvcc = nvcc_path()
    if choice == "1" and not (torch_has_cuda and nvcc):
        raise SystemExit(
            "PIPECOMM_USE_CUDA=1 but "
            + ("torch was built without CUDA" if not torch_has_cuda else "nvcc was not found (set CUDA_HOME)")
        )
    if torch_has_cuda and nvcc:
        return True, f"torch {torch.__version__} has CUDA {torch.version.cuda}, nvcc at {nvcc}"
    return False, "torch has no CUDA" if not torch_has_cuda else "nvcc not found"


def make_extension():
    sources = read_sources()
    cuda, reason = use_cuda()
    python_glue = sources["python"] + (sources["cuda_python"] if cuda else [])
    files = [unity_source("core", sources["core"]), unity_source("python", python_glue), *sources["transport"]]
    # -g0 overrides the -g of Python's own CFLAGS: debug info for torch's and pybind11's templates doubled the
    # compile time of the Python glue (55 -> 28 s on one core).
    compile_args = {"cxx": ["-O3", "-std=c++17", "-g0"]}
    macros = []
    if cuda:
        files += sources["cuda"] + sources["cuda_transport"]
        compile_args["nvcc"] = ["-O3", "-std=c++17", "-lineinfo"]
        macros.append(("PIPECOMM_WITH_CUDA", "1"))
    builder = cpp_extension.CUDAExtension if cuda else cpp_extension.CppExtension
    print(
        f"pipecomm build: {'CPU + CUDA' if cuda else 'CPU only'} ({reason}); "
        f"{len(files)} sources; MAX_JOBS={os.environ.get('MAX_JOBS', 'auto')}"
    )
    return builder("pipecomm._C", files, define_macros=macros, extra_compile_args=compile_args)


setup(
    ext_modules=[make_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
