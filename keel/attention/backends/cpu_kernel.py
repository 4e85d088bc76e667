"""keel's CPU decode-attention kernel (csrc/paged_decode.cpp), compiled once per machine.

The portable torch path gathers every request's context into a padded copy and runs SDPA; for
decode rows that copy costs more than the attention itself (at 64 requests x 256 tokens it was
~45% of a SmolLM2 decode step). The kernel reads K/V in place through the block table instead.
It is built with torch's JIT extension builder the first time it is needed (about a minute;
cached under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) and used only on the CPU.
If it cannot be built (no compiler), keel logs why and keeps the torch path.
KEEL_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_module: Any = None
_tried = False


def get_kernel() -> Any | None:
    """The compiled module (with `paged_decode`), or None when unavailable or disabled."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("KEEL_CPU_KERNEL", "1") == "0":
        return None
    # The `ninja` that pip installed with keel sits next to this interpreter; torch looks for
    # it on PATH, which an unactivated virtual environment does not extend.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load_inline

        src = _SOURCE.read_text()
        cflags = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
        tag = hashlib.sha256((src + " ".join(cflags)).encode()).hexdigest()[:12]
        logger.info("Loading keel's CPU paged-attention kernel (compiled once per machine)")
        _module = load_inline(
            name=f"keel_paged_decode_{tag}",
            cpp_sources=[src],
            functions=["paged_decode"],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: torch path
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch path.", e)
        _module = None
    return _module
