"""`dsv4 generate` and `dsv4 score`: the compiled model from the command line.

Torch-free (numpy + iree.runtime + tokenizers), so these work on a host with only the
iree-base-runtime wheel. Bad requests and broken exports print one error line and exit 2; a request
longer than the export's context is refused with the server's rule (`Engine.check_length`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import add_command, fail

__all__ = ["add_parser", "cmd_generate", "cmd_score", "token_ids"]


def token_ids(text: str) -> list[int]:
    """`--prompt-ids`: comma-separated non-negative integers; an empty entry ("5,,7") is an error."""
    parts = [t.strip() for t in text.split(",")]
    for i, t in enumerate(parts):
        if not t:
            raise argparse.ArgumentTypeError(f"empty entry {i + 1} in {text!r}: expected comma-separated token "
                                             "ids like 5,6,7")
        if not t.isdigit():
            raise argparse.ArgumentTypeError(f"entry {i + 1} of {text!r} is {t!r}, not a token id (a "
                                             "non-negative integer)")
    return [int(t) for t in parts]



def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a continuation of the prompt (text to stdout as it is produced, or one JSON object)."""
    from dsv4.contract.errors import EngineError, RequestError
    from dsv4.runtime.engine import Engine
    from dsv4.runtime.sampling import SamplingParams

    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()),
                                ignore_eos=args.ignore_eos, speculative=args.speculative == "mtp")
    except ValueError as e:
        return fail("generate", e)
    if args.draft_tokens is not None and args.speculative is None:
        return fail("generate", "--draft-tokens needs --speculative mtp")
    try:
        eng = Engine(args.export_dir, device=args.device, device_index=args.device_index,
                     devices=args.devices)
        if params.speculative:
            _check_speculative(eng, args.draft_tokens)
        if args.prompt_ids is not None:
            prompt: Any = args.prompt_ids
        elif args.chat:
            prompt = eng.apply_chat_template([{"role": "user", "content": args.prompt}])
        else:
            if not args.prompt:
                raise RequestError("prompt is empty")
            prompt = args.prompt
        ids = list(prompt) if isinstance(prompt, list) else eng.encode(prompt, add_bos=not args.no_bos)
        eng.check_ids(ids)
        eng.check_length(len(ids), params.max_new_tokens)  # the server's rule for oversized requests
        chunks = eng.stream(ids, params, add_bos=False)
        if args.echo and not args.json:
            if isinstance(prompt, str):
                sys.stdout.write(prompt)
            else:
                sys.stdout.write(eng.decode(prompt) if eng.tokenizer is not None else ",".join(map(str, prompt)) + ",")
        rid = None
        show_text = eng.tokenizer is not None and not args.json
        first = True
        for ch in chunks:
            rid = ch.request_id
            if args.json:
                continue
            if show_text:
                sys.stdout.write(ch.text)
            else:  # no tokenizer: stream the ids
                sys.stdout.write(("" if first else ",") + str(ch.token))
            first = False
            sys.stdout.flush()
        res = eng.result(rid)
    except EngineError as e:
        return fail("generate", e)
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        sys.stdout.write("\n")
        print(f"[{len(res.tokens)} tokens, stop: {res.stop_reason}, ttft {res.ttft_s * 1e3:.1f} ms"
              + (f", {1.0 / res.tpot_s:.1f} tok/s" if res.tpot_s else "")
              + (f", {res.decode_calls} verify calls, {res.accepted}/{res.drafted} drafts accepted"
                 if params.speculative else "")
              + ("" if params.greedy else f", seed {res.seed}") + "]",
              file=sys.stderr)
    return 0


def _check_speculative(eng: Any, draft_tokens: int | None) -> None:
    """RequestError unless the export has MTP speculative entry points (with K = draft_tokens when given)."""
    from dsv4.contract.errors import RequestError

    k = eng.draft_tokens
    if k is None:
        raise RequestError(f"{eng.config.directory} has no speculative entry points (mtp_prefill, verify): "
                           "export it with `dsv4 export --draft-tokens K` for --speculative mtp")
    if draft_tokens is not None and draft_tokens != k:
        raise RequestError(f"--draft-tokens {draft_tokens}, but {eng.config.directory} was exported with "
                           f"--draft-tokens {k} (its verify entry points check {k} drafts per step)")


def cmd_score(args: argparse.Namespace) -> int:
    """Per-token log-probabilities and perplexity of a text or id sequence."""
    from dsv4.contract.errors import EngineError, RequestError
    from dsv4.runtime.engine import Engine

    try:
        eng = Engine(args.export_dir, device=args.device, device_index=args.device_index,
                     devices=args.devices)
        if args.prompt_ids is not None:
            ids: Any = args.prompt_ids
        else:
            if not args.text:
                raise RequestError("text is empty")
            ids = args.text
        res = eng.score(ids, add_bos=not args.no_bos)
    except EngineError as e:
        return fail("score", e)
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        for t, lp in zip(res.tokens, res.logprobs):
            piece = repr(eng.decode([t])) if eng.tokenizer is not None else ""
            print(f"{t:>8} {'' if lp is None else f'{lp:10.4f}':>10} {piece}")
        print(f"perplexity {res.perplexity:.4f} over {len(res.tokens) - 1} predicted tokens")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("export_dir", metavar="OUT", help="export directory (config.json, the .irpa weight shards, a vmfb per target)")
    p.add_argument("--device", default="local-task", choices=["local-task", "local-sync", "cuda", "hip"],
                   help="IREE driver: local-task/local-sync run the llvm-cpu vmfb, cuda the cuda one, hip the "
                        "gfx942 one (default: local-task)")
    p.add_argument("--device-index", type=int, default=0, help="which GPU (default: 0)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="devices of a multi-device export (dsv4 export --devices N): GPUs device-index .. "
                        "device-index+N-1, or N local devices (default: the export's count)")
    p.add_argument("--no-bos", action="store_true", help="do not prepend bos to a text prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    """Register `generate` or `score` (`name`) on the `dsv4` command's subparsers."""
    return (_add_generate if name == "generate" else _add_score)(subparsers)


def _add_generate(subparsers: Any) -> argparse.ArgumentParser:
    g = add_command(subparsers, "generate",
                              description="Continue a prompt with a compiled export: the text streams to stdout "
                                          "as it is produced; a summary line (tokens, stop reason, timing) goes to "
                                          "stderr. Greedy unless --temperature > 0.")
    _common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the export's tokenizer)")
    src.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids, used as given")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template (needs jinja2)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (default: 0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: a fresh one, printed so the run can be repeated)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g.add_argument("--speculative", choices=["mtp"], default=None,
                   help="speculative decoding: the model's MTP block drafts, one verify call per step checks "
                        "the drafts (greedy: the same tokens as without; with --temperature: the speculative-"
                        "sampling rule on the device, each token distributed as plain sampling's, other draws "
                        "for a seed; needs an export made with --draft-tokens K). --json then reports drafted, "
                        "accepted and acceptance_rate")
    g.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="with --speculative: drafts per step; must equal the export's --draft-tokens "
                        "(default: the export's)")
    g.set_defaults(fn=cmd_generate)
    return g


def _add_score(subparsers: Any) -> argparse.ArgumentParser:
    s = add_command(subparsers, "score",
                              description="Per-token log-probabilities and the perplexity of a text, with the "
                                          "export's score_bs1 entry point (exports made with --no-score, as "
                                          "`make run`'s, lack it).")
    _common(s)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to score (needs the export's tokenizer)")
    src.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids to score")
    s.set_defaults(fn=cmd_score)
    return s
