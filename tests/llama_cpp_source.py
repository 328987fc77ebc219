"""llama.cpp's own model converter (``convert_hf_to_gguf.py`` with its ``conversion`` package and
``gguf-py``), from the llama-cpp-python sdist that benchmarks/compare.py builds llama-server
from: the tests of files as llama.cpp's converter writes them (mixtures of experts, ``--mmproj``
projectors) run it on tiny Hugging Face models.

`make test` unpacks it once (``python tests/llama_cpp_source.py``) into pyserve's cache, where
compare.py unpacks the whole source tree for its build; the sdist comes from PyPI.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
# what the converter imports, under the sdist's vendor/llama.cpp/
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def peers_dir() -> Path:
    from pyserve.model_files import cache_dir

    return cache_dir() / "peers"


def llama_cpp_converter() -> Path | None:
    """The unpacked ``vendor/llama.cpp`` whose convert_hf_to_gguf.py converts, or None."""
    found = sorted((peers_dir() / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found and (found[-1] / "convert_hf_to_gguf.py").is_file() else None


def required_converter() -> Path:
    """The converter's directory; the test fails without it (`make test` unpacks it, so its
    absence is a set-up that did not run, as the browser's is for the web tests)."""
    import pytest

    found = llama_cpp_converter()
    if found is None:
        pytest.fail(
            "llama.cpp's convert_hf_to_gguf.py is missing: `make test` unpacks it "
            "(python tests/llama_cpp_source.py)"
        )
    return found


def unpack_converter() -> Path:
    """The converter's directory: unpacked from the sdist (downloaded when missing)."""
    found = llama_cpp_converter()
    if found is not None:
        return found
    sdist_dir = peers_dir() / "sdist"
    archives = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, "-d", str(sdist_dir), SDIST], check=True)
        archives = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archives[-1]) as tar:
        wanted = [
            member
            for member in tar.getmembers()
            if "/vendor/llama.cpp/" in member.name
            and member.name.split("/vendor/llama.cpp/", 1)[1].startswith(CONVERTER_PARTS)
        ]
        tar.extractall(peers_dir() / "src", members=wanted, filter="data")
    found = llama_cpp_converter()
    if found is None:
        raise RuntimeError(f"no vendor/llama.cpp/convert_hf_to_gguf.py in {archives[-1].name}")
    return found


if __name__ == "__main__":
    print(f"llama.cpp's converter: {unpack_converter()}")
