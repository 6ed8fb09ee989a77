"""
Train the BPE tokenizer on the train split, save it to $NANOMUON_BASE_DIR/tokenizer, and print its
compression on the val split (UTF-8 bytes per token: how much text a token budget buys).

    python -m scripts.tok_train --dataset fineweb-edu --vocab-size 32768 --max-chars 2000000000
    python -m scripts.tok_train --dataset embedded --vocab-size 4096 --max-chars 8000000
"""

import argparse
import time

from nanomuon.common import user_errors
from nanomuon.dataset import iter_texts
from nanomuon.sources import add_data_args, prepare
from nanomuon.tokenizer import Tokenizer, get_tokenizer, tokenizer_dir


def main(argv=None):
    p = argparse.ArgumentParser(description="Train nanomuon's BPE tokenizer", allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_data_args(p, "fineweb-edu")
    p.add_argument("--vocab-size", type=int, default=32768, help="including the special tokens")
    p.add_argument("--max-chars", type=int, default=2_000_000_000,
                   help="training characters to read")
    p.add_argument("--doc-cap", type=int, default=10_000, help="characters kept per document")
    p.add_argument("--eval-chars", type=int, default=2_000_000,
                   help="val characters for the compression check")
    p.add_argument("--keep-existing", action="store_true",
                   help="keep a tokenizer that is already there with this --vocab-size instead of "
                   "training (so a machine without rustbpe can run on one made elsewhere)")
    args = p.parse_args(argv)
    for name in ("vocab_size", "max_chars", "doc_cap", "eval_chars"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    if args.keep_existing:
        try:
            have = get_tokenizer().vocab_size
        except FileNotFoundError:
            have = None
        except ValueError as e:
            have = None
            print(f"the tokenizer in {tokenizer_dir()} is unreadable ({e}); training a new one")
        if have == args.vocab_size:
            print(f"reusing the tokenizer in {tokenizer_dir()} (vocab {have}); delete it to "
                  "retrain")
            return

    with user_errors():
        data = prepare(args.dataset, args.text_column, args.val_fraction)
        t0 = time.time()
        # capped: a few huge documents (minified code, tables) would dominate the pair counts
        texts = (text[:args.doc_cap] for text in iter_texts(data, "train", args.max_chars))
        tok = Tokenizer.train(texts, args.vocab_size)
        train_s = time.time() - t0
        val = list(iter_texts(data, "val", args.eval_chars))
    if tok.vocab_size < args.vocab_size:
        print(f"warning: the training text only supports {tok.vocab_size} tokens, not "
              f"{args.vocab_size}; raise --max-chars for a full vocabulary")
    out = tokenizer_dir()
    tok.save(out)
    n_bytes = sum(len(t.encode("utf-8")) for t in val)
    n_tokens = sum(len(ids) for ids in tok.encode(val))
    print(f"tokenizer: {tok.vocab_size} tokens (fingerprint {tok.fingerprint}) trained on "
          f"{args.dataset} in {train_s:.1f} s, saved to {out}")
    print(f"compression on val: {n_bytes / max(n_tokens, 1):.2f} bytes/token ({n_bytes:,} bytes, "
          f"{n_tokens:,} tokens)")


if __name__ == "__main__":
    main()
