"""Train the embedded "small" DeepSeek-V4 model: on CPU, reproducibly, in minutes, or longer on a GPU.

The model is the exact V4 architecture at toy size (preset "small": sliding-only, CSA with the
lightning indexer, HCA, hash-routed and score-routed MoE with a shared expert, mHC, MTP) trained on
the CPython-docs corpus (`corpus.py`) with the corpus BPE tokenizer (`tokenizer.py`).

Files: `config.py` (TrainConfig), `data.py` (token streams, batches, prepared data), `losses.py`,
`loop.py` (optimizer, schedule, steps), `evaluate.py` (held-out perplexity + the greedy check),
`master.py` (the bf16 master format), `run.py` (a whole run: train / from_master / finish),
`__main__.py` (the command line), `corpus.py` and `tokenizer.py` (the training text and the
tokenizer trainer; the tokenizer's format is the model's, `dsv4.contract.tokenizer`).

Choices, and why:
* fp32 master weights and fp32 compute. The CPU has no fast path that makes bf16 training cheaper
  for this op mix (the step is dominated by small element-wise ops), bf16 weights would lose the
  small AdamW updates, and fp32 needs no loss scaling. The result is evaluated and shipped in bf16
  (and quantized to the official FP8/MXFP4 format), the reference's inference dtypes.
* Forward = the model's own chunk forward (`Transformer.hidden` + `logits`, i.e. `model(...,
  all_logits=True)`) from position 0 with a fresh state per batch; autograd runs through the
  in-place `index_put_` state writes (compressed entries are written to the state, then read back).
* QAT as the release: the FP8 KV / FP4 indexer simulations stay on and pass gradients straight
  through (`quant_sim.straight_through`); forward values are exactly the inference values.
* Losses: next-token cross entropy + `mtp_weight` x the MTP block's cross entropy on token t+2
  + `indexer_weight` x the indexer KL: KL(p_attn || softmax(indexer scores)) over the visible
  compressed entries, where p_attn is the main attention's distribution over those entries (scores
  q·k of every head against every visible entry, softmax per head, summed over heads, normalized;
  detached), as DeepSeek trains its lightning indexer. The indexer's inputs are detached (the
  `Indexer.aux` hook), so this loss trains only the indexer and the LM loss never reaches it.
* Speed: the `moe_experts` kernel hook is swapped (kernels.overrides) for `routed_moe_experts`,
  which runs each expert on its routed tokens only: the same math as the reference (whose unrouted
  tokens get weight exactly 0), E/k = 4x fewer expert FLOPs. Evaluation uses the reference.
* MoE balance as DeepSeek does it (ExpertLoad): the auxiliary-loss-free bias (after each step every
  score-routed gate's selection bias moves by `bias_update` x sign(mean load - expert load)) plus
  the complementary balance loss with a small weight (`balance_weight`).
* One thread by default: on the 2 shared cores of the dev machine, a second OpenMP thread gained
  nothing whenever another process was busy (and lost 2-4x with spinning waits, see below), and
  the step is dominated by small element-wise ops. Results are bitwise reproducible for a given
  seed, thread count, torch build and machine (the thread count changes fp32 summation order).
* Sequences are 256 tokens (+2 for the MTP target) cut from the token stream of the training
  documents (each framed by bos/eos) at a per-epoch random offset, in a per-epoch random order:
  both from generators seeded by (seed, epoch), so the data order is a pure function of the seed.
  Training runs the model with max_seq_len = seq_len: that only sizes the state and the RoPE tables
  (positions < seq_len see the same values), so the weights are the preset's, at lower cost.

Run: ``python -m dsv4.train`` writes model/assets/small: the official-layout FP8/MXFP4
checkpoint (config.json, model.safetensors: what `checkpoint.load_checkpoint` loads, the default),
the bf16 master (master-bf16.safetensors, this model's state_dict names: `dsv4.train.load_master`), the
tokenizer files and train_log.json (settings, loss curve, timings, evaluations).

A longer run on a GPU (how the shipped model was made; docs/training.md has the commands):
* ``--save-data DIR`` here writes the tokenized train/eval streams, the tokenizer and the corpus
  hash: the corpus comes from the local stdlib (its hash is checked against the reference), so it is
  built here, not on a GPU host with another Python;
* there, ``--data DIR --device cuda`` trains on them (the model is initialized on the CPU, so the
  start is the same on any device); ``--eval-every N`` measures the held-out perplexity during
  training, ``--keep-best true`` returns the weights of the best such evaluation (the corpus is
  small: a few hundred k tokens, which this model overfits after about ten epochs), ``--snapshot``
  writes each new best master as it comes, ``--out DIR --no-fp8`` the master + train_log.json;
* back here, ``--from-master DIR`` evaluates that master on this CPU (bf16 eager), writes the
  official checkpoint into --out, evaluates and samples it, and writes master + train_log.json
  (the run's record, with this machine's evaluations added).
"""

from __future__ import annotations

import os

# Read by libgomp when torch is first imported, so it only takes effect if this package is imported
# before torch (as `python -m dsv4.train` does). It matters for --threads 2: with spinning OpenMP
# workers, 2 threads on the 2 shared dev cores ran 2-4x slower than 1 thread whenever another
# process was busy; with passive waiting they ran about as fast as 1 (hence the default of 1).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .config import TrainConfig  # noqa: E402
from .data import BatchSampler, prepare_data, save_data, token_stream  # noqa: E402
from .evaluate import DEFAULT_PROMPT, eval_and_sample, evaluate  # noqa: E402
from .loop import lr_at, make_optimizer, train_steps  # noqa: E402
from .losses import ExpertLoad, compute_losses, indexer_kl, routed_moe_experts  # noqa: E402
from .master import MASTER_FILE, cast_model, load_master, master_model, master_state, save_master  # noqa: E402
from .run import TrainResult, finish, from_master, train  # noqa: E402

__all__ = [
    "TrainConfig",
    "TrainResult",
    "token_stream",
    "BatchSampler",
    "prepare_data",
    "save_data",
    "compute_losses",
    "indexer_kl",
    "routed_moe_experts",
    "ExpertLoad",
    "make_optimizer",
    "lr_at",
    "train_steps",
    "train",
    "finish",
    "from_master",
    "evaluate",
    "eval_and_sample",
    "cast_model",
    "master_state",
    "master_model",
    "save_master",
    "load_master",
    "MASTER_FILE",
    "DEFAULT_PROMPT",
]
