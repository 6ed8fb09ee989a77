"""
Generate text from a trained checkpoint.

    python -m scripts.sample --run d20 --prompt "The meaning of life is" --max-tokens 64
"""

import argparse
import codecs
import math
from collections.abc import Iterator

import torch

from nanomuon.checkpoint import load_model, step_arg
from nanomuon.common import check_device_type, get_base_dir, user_errors
from nanomuon.run import run_arg
from nanomuon.tokenizer import get_tokenizer


def add_checkpoint_args(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--run", type=run_arg, required=True,
                   help="run name, as given to base_train --run (e.g. d20)")
    p.add_argument("--step", type=step_arg, default="latest", help="checkpoint step, or 'latest'")
    if device:
        p.add_argument("--device-type", choices=["auto", "cuda", "cpu", "mps"], default="auto")


def load_for_inference(args, device):
    """(model, tokenizer, meta) for --run/--step; a one-line error when they do not fit together."""
    with user_errors():
        tokenizer = get_tokenizer()
        model, meta = load_model(get_base_dir() / "runs" / args.run, args.step, device)
    if meta["tokenizer"] != tokenizer.fingerprint:
        raise SystemExit(f"error: run {args.run} was trained with a different tokenizer than the "
                         f"one in {get_base_dir() / 'tokenizer'}; restore that tokenizer or sample "
                         "a run trained with it")
    return model, tokenizer, meta


def stream(model, tokenizer, prompt: str, max_tokens: int, temperature: float,
           top_k: int | None, seed: int) -> Iterator[str]:
    """The sampled text piece by piece as each token comes; a character split across tokens comes
    whole with its last byte, so the pieces join to exactly what decoding all the ids gives."""
    ids = tokenizer.encode(prompt, prepend_bos=True)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in model.generate(ids, max_tokens, temperature=temperature, top_k=top_k, seed=seed):
        if piece := utf8.decode(tokenizer.enc.decode_single_token_bytes(t)):
            yield piece
    if tail := utf8.decode(b"", final=True):
        yield tail



def main(argv=None):
    p = argparse.ArgumentParser(description="Sample text from a nanomuon checkpoint",
                                allow_abbrev=False)
    add_checkpoint_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for several")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample from the k most likely tokens (0: all)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.num_samples < 1:
        p.error("--max-tokens and --num-samples must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        p.error("--top-k must be >= 0")
    if not 0 <= args.seed < 2 ** 64:  # torch's generator takes 64 bits
        p.error(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.seed + args.num_samples > 2 ** 64:
        p.error(f"sample i is seeded with --seed + i, so --seed must be at most 2**64 - "
                f"--num-samples = {2 ** 64 - args.num_samples}")
    device = torch.device(check_device_type(args.device_type))
    model, tokenizer, meta = load_for_inference(args, device)
    print(f"run {args.run}, step {meta['step']}, {model.num_params():,} params")
    for prompt in args.prompt or ["The"]:
        for i in range(args.num_samples):
            print(f"--- {prompt!r}\n{prompt}", end="", flush=True)
            # printed as it comes: a long sample takes minutes on a CPU
            for piece in stream(model, tokenizer, prompt, args.max_tokens, args.temperature,
                                args.top_k or None, args.seed + i):
                print(piece, end="", flush=True)
            print(flush=True)


if __name__ == "__main__":
    main()
