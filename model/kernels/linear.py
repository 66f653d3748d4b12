"""Linear layers over the checkpoint's weight formats (the FP8 block GEMM hook).

`linear(x, weight, scale)` dispatches on the weight's storage dtype:
  - bf16/fp32 weight, scale None: a plain matmul in x's dtype;
  - FP8 (float8_e4m3fn / float8_e4m3fnuz) [N, K] with 128x128 block scales: fp8_block_linear;
  - uint8 [N, K/2] packed MXFP4 with per-32 E8M0 scales: mxfp4_linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    if scale is None:
        return F.linear(x, weight.to(x.dtype))
    raise NotImplementedError(f"quantized weight dtype {weight.dtype} is not wired yet")
