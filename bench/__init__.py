"""dsv4.bench: the benchmarks a user reruns. Each prints a table (or JSON); none is a test.

Every one runs as ``python -m dsv4.bench.NAME --help``:

- ``speed``: ``dsv4 bench OUT``: decode ms/step, prefill tokens/s, TTFT and the HBM roofline of an
  export, side by side with the same weights in PyTorch (``--compare torch-eager,torch-compile,
  transformers``, whose backends are ``torch_backends``). Imports only numpy and iree.runtime unless
  --compare asks for torch.
- ``serve_load``: ``dsv4 bench serve URL``: TTFT / TPOT / ITL / latency / throughput of a running
  OpenAI-compatible server at several concurrencies, like ``vllm bench serve`` (needs httpx only).
- ``torch_compile_warm``: fills torch.compile's on-disk caches, several processes at once, for the
  shapes a later ``dsv4 bench --compare torch-compile`` compiles (at Flash dimensions one shape takes
  about two minutes).
- ``audit``: ``dsv4 audit OUT``: a compiled export against its eager reference, weights decoded and
  compared exactly with the checkpoint's, activations layer by layer and part by part through a
  probe module, judged against the eager model's own bf16-vs-float32 noise.
- ``multidevice_parity``: an N-device export against the one-device export of the same weights
  (torch-free).
- ``tile_sweep``: the routed experts' gathered MXFP4 GEMM under IREE's tile choice, the tuning library
  (export/tuning) and candidate tiles: ``build`` compiles here, ``run`` times on the GPU host.
- ``device_sampling``: decode ms/step of sampled requests, sampling on the device (sample_bs{N})
  against sampling on the host.
- ``speculative_speed``: MTP speculation against plain greedy through the Engine at batch 1 and 8:
  tokens/s, drafts accepted, decode (verify) calls; ``verify_cost``: one verify call's time against one
  decode call's on the same export.
- ``moe_bytes``: bytes of routed-expert weights one decode step reads, from the traced graph's shapes
  (no weights needed).
- ``weights_memory``: peak memory of writing weights at real dimensions (run under /usr/bin/time -v).

``torch_backends`` is the library behind ``speed --compare``, not a benchmark of its own.
This file imports nothing, so ``dsv4.bench.serve_load`` and ``dsv4.bench.speed`` stay torch-free.
Dependencies: dsv4.runtime and dsv4.contract; dsv4.model only in the benchmarks that run torch.
"""
