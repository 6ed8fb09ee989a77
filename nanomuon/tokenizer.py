"""
The tokenizer: a byte-level BPE trained with rustbpe, run with tiktoken.

rustbpe learns the merges (fast, parallel, streaming); tiktoken encodes with them (threaded
batches). One special token, <|bos|>, opens every document. A trained tokenizer is tokenizer.bpe
(tiktoken's format: base64 token bytes and rank per line) and tokenizer.json (split pattern,
special tokens, fingerprint). Checkpoints record the fingerprint, so a run is never resumed or
sampled with a tokenizer it was not trained with.
"""

import base64
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import regex  # tiktoken's own dependency: its pattern syntax
import tiktoken
import torch

from nanomuon.common import get_base_dir, load_json, read_regular, write_atomic

# GPT-4's split pattern with digit runs of at most 2 (as in nanochat: fewer number tokens
# wasted on small vocabularies).
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}"""
                 r"""| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
BOS = "<|bos|>"
SPECIAL_TOKENS = (BOS,)
FILES = ("tokenizer.bpe", "tokenizer.json")


class Tokenizer:
    """A tiktoken Encoding plus what training needs (BOS, token byte lengths, fingerprint)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN):
        n = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(n)):
            raise ValueError("mergeable ranks must be exactly 0..N-1")
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing:  # tiktoken would panic at the first text that needs one
            raise ValueError(f"{len(missing)} of the 256 single-byte tokens are missing "
                             f"(byte {hex(missing[0])}{', ...' if len(missing) > 1 else ''}), "
                             "so some text cannot be encoded")
        self.mergeable_ranks, self.pattern = mergeable_ranks, pattern
        self.tokens = sorted(mergeable_ranks, key=mergeable_ranks.get)  # token i's bytes at i
        self.special_tokens = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name="nanomuon", pat_str=pattern,
                                     mergeable_ranks=mergeable_ranks,
                                     special_tokens=self.special_tokens)
        self.bos_id, self.vocab_size = self.special_tokens[BOS], n + len(self.special_tokens)
        digest = hashlib.sha256(pattern.encode())
        for token in self.tokens:
            digest.update(len(token).to_bytes(2, "little") + token)
        digest.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        self.fingerprint = digest.hexdigest()[:16]

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int,
              pattern: str = SPLIT_PATTERN) -> "Tokenizer":
        """Learn vocab_size - len(SPECIAL_TOKENS) byte-level BPE tokens from texts with rustbpe."""
        import rustbpe  # only training needs it; encoding needs tiktoken alone

        min_size = 256 + len(SPECIAL_TOKENS)
        if vocab_size < min_size:
            raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + special tokens), "
                             f"got {vocab_size}")
        if vocab_size >= 2 ** 31:  # token ids travel as int32 (the data loader's rows)
            raise ValueError(f"vocab_size {vocab_size} is too large: token ids are int32, "
                             "so use < 2**31 (32768 is standard)")
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), pattern=pattern)
        return cls({bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}, pattern)

    def save(self, directory: Path) -> None:
        """Write both files atomically, so a reader never sees half a tokenizer."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        bpe = "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(self.tokens))
        meta = dict(pattern=self.pattern, special_tokens=self.special_tokens,
                    vocab_size=self.vocab_size, fingerprint=self.fingerprint)
        for name, text in zip(FILES, (bpe, json.dumps(meta, indent=1) + "\n")):
            write_atomic(directory / name, text)

    @classmethod
    def load(cls, directory: Path) -> "Tokenizer":
        directory = Path(directory)
        if missing := [n for n in FILES if not (directory / n).is_file()]:
            raise FileNotFoundError(f"no tokenizer in {directory} (missing {', '.join(missing)}): "
                                    "train one with `python -m scripts.tok_train --dataset "
                                    "embedded` (or --dataset fineweb-edu)")
        try:
            meta = load_json(directory / "tokenizer.json", 1 << 16, "a tokenizer's metadata")
            bpe = read_regular(directory / "tokenizer.bpe", 1 << 26, "a tokenizer's merges")
            lines = (line.split() for line in bpe.decode().splitlines())
            ranks = {base64.b64decode(token): int(rank) for token, rank in lines}
            check_pattern(meta["pattern"])
            tok = cls(ranks, meta["pattern"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the tokenizer in {directory} is corrupt ({type(e).__name__}: {e}); "
                             "retrain it with `python -m scripts.tok_train`") from e
        if (tok.fingerprint != meta.get("fingerprint")
                or tok.special_tokens != meta.get("special_tokens")):
            raise ValueError(f"the tokenizer in {directory} does not match its own tokenizer.json "
                             f"(fingerprint {tok.fingerprint} vs {meta.get('fingerprint')}); "
                             "retrain it with `python -m scripts.tok_train`")
        return tok

    def encode(self, text: str | Sequence[str], prepend_bos: bool = False, num_threads: int = 8):
        """Token ids of a string, or id lists of a list of strings (in parallel). Text that looks
        like a special token is encoded as plain text."""
        prefix = [self.bos_id] if prepend_bos else []
        if isinstance(text, str):
            return prefix + self.enc.encode_ordinary(text)
        return [prefix + ids
                for ids in self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(list(ids))

    def token_bytes(self) -> torch.Tensor:
        """(vocab_size,) int64: each token's UTF-8 bytes, the denominator of bits per byte (which,
        unlike loss per token, compares across vocabularies); 0 for special tokens."""
        lengths = [len(token) for token in self.tokens] + [0] * len(self.special_tokens)
        return torch.tensor(lengths, dtype=torch.int64)


def check_pattern(pattern) -> None:
    """ValueError unless pattern is a split regex that never matches empty text, on which
    tiktoken's Rust code panics (one that does not compile, building the Encoding refuses)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"tokenizer.json's split pattern is {pattern!r}: it must be a non-empty regex")
    try:
        empty = any(m.start() == m.end() for m in regex.finditer(pattern, "Ab 12, 345!\n\n x  y"))
    except regex.error:  # tiktoken's dialect differs a little: building the Encoding decides
        return
    if empty:
        raise ValueError(f"tokenizer.json's split pattern {pattern!r:.60} matches empty text")


def tokenizer_dir() -> Path:
    return get_base_dir() / "tokenizer"


def get_tokenizer() -> Tokenizer:
    """The tokenizer trained by scripts.tok_train, from $NANOMUON_BASE_DIR/tokenizer."""
    return Tokenizer.load(tokenizer_dir())
