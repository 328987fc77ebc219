"""The backends' registry and the choice of one: each registered name is its class's, ``auto``
picks by device with the reason it logs, a name asked for runs or says why not, and the names
reach the torch-free settings the main process validates."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pyserve.worker import quant
from pyserve.worker.backends import REGISTRY, backend_class, select_backend
from pyserve.worker.backends.base import Backend
from pyserve.worker.models.config import ModelConfig, RopeConfig, uniform_layers

ISA_NAMES = {"avx512_vnni": "AVX-512 VNNI", "avx2": "AVX2"}


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=32, intermediate_size=16, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, context_length=64,
        tie_word_embeddings=False, layers=uniform_layers(1, RopeConfig(10000.0, 16), None),
    )  # fmt: skip


def test_every_registered_backend_is_a_backend_named_as_registered():
    assert list(REGISTRY)[-1] == "torch"  # the fallback that claims every device
    for name in REGISTRY:
        cls = backend_class(name)
        assert issubclass(cls, Backend) and cls.name == name


def test_auto_picks_by_device_and_says_why():
    def auto(device: str) -> tuple[str, str]:
        backend = select_backend("auto", tiny_config(), torch.device(device))
        return backend.name, backend.reason

    isa = quant.kernels().isa()
    if isa == "scalar":
        assert auto("cpu") == ("torch", "no AVX2 on this CPU")
    else:
        assert auto("cpu") == ("cpu-kernels", ISA_NAMES[isa])
    assert auto("meta") == ("torch", "device meta: no kernels of ours run there")
    assert auto("cuda") == ("triton", "a CUDA device")  # triton is a test dependency


def test_a_backend_asked_for_runs_or_says_why_not():
    config, cpu = tiny_config(), torch.device("cpu")
    torch_backend = select_backend("torch", config, cpu)
    assert (torch_backend.name, torch_backend.reason) == ("torch", "asked for (--backend torch)")
    kernels = select_backend("cpu-kernels", config, cpu)
    isa = quant.kernels().isa()
    assert kernels.reason == f"asked for ({ISA_NAMES.get(isa, 'portable loops')})"
    with pytest.raises(ValueError, match="runs on the CPU, not meta"):
        select_backend("cpu-kernels", config, torch.device("meta"))
    triton = select_backend("triton", config, cpu)  # in the interpreter (conftest.py)
    assert (triton.name, triton.reason) == ("triton", "asked for (--backend triton)")
    with pytest.raises(ValueError, match=r"the triton backend cannot run: .* not meta"):
        select_backend("triton", config, torch.device("meta"))
    with pytest.raises(ValueError, match="must be auto, cpu-kernels, triton or torch; got 'x'"):
        select_backend("x", config, cpu)


def test_the_settings_take_the_registered_names_without_importing_torch():
    code = (
        "import sys\n"
        "from pyserve.worker.settings import WorkerSettings\n"
        "for name in ('auto', 'cpu-kernels', 'triton', 'torch'):\n"
        "    WorkerSettings(backend=name).validate()\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
