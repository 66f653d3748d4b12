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
- ``compiled_vs_eager``: a compiled export against the eager PyTorch model on the export's own
  weights: per-step logit error and greedy agreement, with the eager model's own sensitivity as the
  scale to judge them by.
- ``multidevice_parity``: an N-device export against the one-device export of the same weights
  (torch-free).
- ``device_sampling``: decode ms/step of sampled requests, sampling on the device (sample_bs{N})
  against sampling on the host.
- ``moe_bytes``: bytes of routed-expert weights one decode step reads, from the traced graph's shapes
  (no weights needed).
- ``weights_memory``: peak memory of writing weights at real dimensions (run under /usr/bin/time -v).

``torch_backends`` is the library behind ``speed --compare``, not a benchmark of its own.
This file imports nothing, so ``dsv4.bench.serve_load`` and ``dsv4.bench.speed`` stay torch-free.
Dependencies: dsv4.runtime and dsv4.contract; dsv4.model only in the benchmarks that run torch.
"""
