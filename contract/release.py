"""The release checkpoint's storage format of each model tensor, by name (torch-free): what
`write_checkpoint` writes (model/checkpoint/write.py) and what `dsv4 bench` counts as the bytes the
release format needs (bench/traffic.py). Names are the model's state_dict keys without `model.`.

    FP8_LINEAR  float8_e4m3fn [N, K] + E8M0 block scales [ceil(N/128), ceil(K/128)]
    experts     MXFP4 (0.5 byte a weight) + E8M0 scales per 32 (or FP8 + block scales: config expert_dtype)
    BF16        embed, head, norms, compressor and gate weights, the indexer's weights_proj
    F32         mHC mixes, attn_sink, ape, biases
    I64         the hash layers' tid2eid
"""

from __future__ import annotations

import re

__all__ = ["FP8_LINEAR", "BF16", "F32", "I64"]

FP8_LINEAR = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                        r"|e_proj|h_proj)\.weight$")
BF16 = re.compile(r"^(embed|head)\.weight$|norm\.weight$|\.compressor\.(wkv|wgate)\.weight$"
                  r"|\.indexer\.weights_proj\.weight$|\.ffn\.gate\.weight$")
F32 = re.compile(r"(^|\.)(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|ape|bias)$")
I64 = re.compile(r"\.ffn\.gate\.tid2eid$")
