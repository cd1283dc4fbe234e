"""roundpipe.kernels: Triton fused stage ops (RMSNorm, SwiGLU, RoPE, linear cross-entropy).

Installed from the repository's top-level kernels/ folder.  Importing this
package never needs Triton or a GPU: each functional form falls back to its
PyTorch reference when Triton cannot run, and says so once.
"""
from ._triton import available, can_run, report, unavailable_reason
from .linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy
from .rms_norm import RMSNorm, rms_norm
from .rope import RotaryEmbedding, apply_rope
from .swiglu import SwiGLU, swiglu

__all__ = ["available", "can_run", "report", "unavailable_reason", "RMSNorm", "rms_norm", "SwiGLU", "swiglu",
           "RotaryEmbedding", "apply_rope", "LinearCrossEntropyLoss", "linear_cross_entropy"]
