"""Peak memory of writing weights at real dimensions (docs/export.md, "Measured"). Run each step
under `/usr/bin/time -v` and read "Maximum resident set size"; the files are several GB, delete
them afterwards.

    W="python -m dsv4.bench.weights_memory"
    $W shards DIR                 # write_shards: 8 x 512 MiB into 2 GiB shards
    $W config DIR [--layers 1]    # config.json of flash, first N layers, no weights
    dsv4 weights random DIR       # (torch-free) random weights for it
    $W checkpoint DIR CKPT        # DIR's weights as a release checkpoint (safetensors)
    $W stream CKPT OUT [--fnuz]   # checkpoint_tensors -> write_shards
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
import warnings
from pathlib import Path


def shards(out: Path) -> None:
    import numpy as np

    from dsv4.contract.weights import write_shards

    def gen():
        for i in range(8):
            a = np.full(512 << 20, i, np.uint8)
            yield f"model.t{i}", a, "uint8"
            del a  # freed before the next one is made

    write_shards(out, gen(), shard_bytes=2 << 30, progress=print)


def config(out: Path, layers: int) -> None:
    import torch

    from dsv4.model.checkpoint import param_inventory
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer
    from dsv4.contract.weights import SHARD_BYTES, planned_names

    full = ModelConfig.preset("flash")
    cfg = full.replace(num_hidden_layers=layers, num_hash_layers=min(full.num_hash_layers, layers),
                       compress_ratios=full.compress_ratios[:layers] + full.compress_ratios[full.n_layers:])
    with torch.device("meta"):
        specs = param_inventory(Transformer(cfg, quantized=True))
    out.mkdir(parents=True, exist_ok=True)
    raw = {"format": "dsv4-iree-export", "version": 1, "model": cfg.to_dict(), "activation_dtype": "bfloat16",
           "n_slots": 1, "max_seq_len": cfg.max_seq_len,
           "prefill": {"batch_sizes": [1], "min_tokens": 128, "max_tokens": 256}, "decode": {"batch_sizes": [1]},
           "state": [{"name": "unused", "shape": [1, 1], "dtype": "float32"}], "functions": {
               f: {"args": ["tokens", "start_pos", "lengths", "slots", "unused"]} for f in ("prefill_bs1", "decode_bs1")},
           "targets": {"llvm-cpu": {"vmfb": "model.llvm-cpu.vmfb"}},
           "parameters": planned_names(specs, "model", SHARD_BYTES),
           "weights": {"tensors": [s.to_json() for s in specs], "shard_bytes": SHARD_BYTES}}
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    print(f"{out}/config.json: {len(specs)} tensors, {sum(s.nbytes for s in specs) / 1e9:.2f} GB, "
          f"largest {max(s.nbytes for s in specs) / 1e9:.2f} GB")


def checkpoint(src: Path, ckpt: Path) -> None:
    import torch

    from dsv4.model.checkpoint import write_checkpoint
    from dsv4.model.config import ModelConfig
    from dsv4.contract.weights import open_weights

    cfg = ModelConfig.from_dict(json.loads((src / "config.json").read_text())["model"])
    w = open_weights(sorted(glob.glob(f"{src}/model-*.irpa")))
    warnings.simplefilter("ignore")  # read-only views of the maps, only read from
    state = {}
    for k in w:
        shape, dt = w.spec(k)
        state[k.removeprefix("model.")] = torch.from_numpy(w[k]).view(getattr(torch, dt)).reshape(shape)
    write_checkpoint(state, cfg, ckpt)


def stream(ckpt: Path, out: Path, fnuz: bool) -> None:
    import torch

    from dsv4.model.checkpoint import checkpoint_tensors, open_checkpoint
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer
    from dsv4.contract.weights import write_shards

    ck = open_checkpoint(ckpt)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_checkpoint(ck.config), quantized=True)
    t0 = time.perf_counter()
    fp8 = "float8_e4m3fnuz" if fnuz else "float8_e4m3fn"
    names = write_shards(out, checkpoint_tensors(ck, model, fp8, progress=False), progress=print)
    print(f"{len(names)} files, {time.perf_counter() - t0:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.weights_memory",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    sub.add_parser("shards").add_argument("out", type=Path)
    c = sub.add_parser("config")
    c.add_argument("out", type=Path)
    c.add_argument("--layers", type=int, default=1)
    k = sub.add_parser("checkpoint")
    k.add_argument("src", type=Path)
    k.add_argument("ckpt", type=Path)
    s = sub.add_parser("stream")
    s.add_argument("ckpt", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--fnuz", action="store_true")
    a = ap.parse_args()
    if a.step == "shards":
        shards(a.out)
    elif a.step == "config":
        config(a.out, a.layers)
    elif a.step == "checkpoint":
        checkpoint(a.src, a.ckpt)
    else:
        stream(a.ckpt, a.out, a.fnuz)
    return 0


if __name__ == "__main__":
    sys.exit(main())
