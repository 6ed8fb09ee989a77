"""The tokenizer (round trip, BOS, byte table, save/load, errors) and bits per byte against a hand count."""

import math

import pytest
import torch

from nanomuon.common import evaluate_bpb
from nanomuon.gpt import GPT, GPTConfig
from nanomuon.tokenizer import BOS, Tokenizer

TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "The quick brown fox jumps over the lazy dog. 1234567890, 3.14159!",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🚀🔥, math ∑∫√",
    "    indented\n\ttabbed\r\nwindows line\n\n\nblank lines",
    "don't I'll we've they're it's HELLO'S",
] * 20


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(iter(TEXTS), vocab_size=400)


def test_round_trip_and_bos(tok):
    for text in set(TEXTS) | {"", " ", "<|bos|> is plain text here", "\x00\xff bytes"}:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.bos_id not in ids  # text that spells the special token stays text
        assert tok.encode(text, prepend_bos=True) == [tok.bos_id] + ids
    assert tok.decode([tok.bos_id]) == BOS
    assert tok.vocab_size == len(tok.mergeable_ranks) + 1 and tok.bos_id == tok.vocab_size - 1


def test_training_learns_merges(tok):
    assert 256 < len(tok.mergeable_ranks) <= 399
    assert len(tok.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2  # compresses text it was trained on


def test_batch_encode_equals_single(tok):
    batch = tok.encode(TEXTS[:5], prepend_bos=True)
    assert batch == [tok.encode(t, prepend_bos=True) for t in TEXTS[:5]]


def test_token_bytes_table(tok):
    table = tok.token_bytes()
    assert table.shape == (tok.vocab_size,) and table[tok.bos_id] == 0
    for i in range(tok.vocab_size - 1):
        assert table[i] == len(tok.enc.decode_single_token_bytes(i))
    for text in set(TEXTS):  # the table's sum over a text's tokens is its UTF-8 length
        assert int(table[tok.encode(text, prepend_bos=True)].sum()) == len(text.encode("utf-8"))


def test_save_load(tok, tmp_path):
    tok.save(tmp_path / "t")
    back = Tokenizer.load(tmp_path / "t")
    assert back.fingerprint == tok.fingerprint and back.mergeable_ranks == tok.mergeable_ranks
    assert back.encode(TEXTS[2]) == tok.encode(TEXTS[2])
    other = Tokenizer.train(iter(TEXTS[:2] * 50), vocab_size=300)
    assert other.fingerprint != tok.fingerprint


def test_load_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts.tok_train"):
        Tokenizer.load(tmp_path / "nothing")
    tok.save(tmp_path / "t")
    bpe = tmp_path / "t" / "tokenizer.bpe"
    lines = bpe.read_text().splitlines()
    bpe.write_text("\n".join(lines[:-1]) + "\n")  # a truncated merge list
    with pytest.raises(ValueError, match="does not match|corrupt"):
        Tokenizer.load(tmp_path / "t")
    bpe.write_text("garbage\n")
    with pytest.raises(ValueError, match="corrupt"):
        Tokenizer.load(tmp_path / "t")
    with pytest.raises(ValueError, match="vocab_size must be >= 257"):
        Tokenizer.train(iter(TEXTS), vocab_size=100)


def test_bits_per_byte_of_a_uniform_model(tok):
    """A GPT whose lm_head is zero predicts the uniform distribution: ln(V) nats per target, so bpb is
    ln(V) * (text targets) / (ln 2 * their bytes), counted here by hand; BOS targets are excluded."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
    model.init_weights()
    torch.nn.init.zeros_(model.lm_head.weight)
    rows = []
    for text in TEXTS[:4]:
        ids = (tok.encode(text, prepend_bos=True) * 8)[:33]  # BOS appears mid-row as a target too
        rows.append(ids)
    rows = torch.tensor(rows)
    y = rows[:, 1:]
    table = tok.token_bytes()
    text_targets = int((table[y] > 0).sum())
    assert text_targets < y.numel()  # the BOS targets are really there to exclude
    expected = math.log(tok.vocab_size) * text_targets / (math.log(2) * int(table[y].sum()))
    assert evaluate_bpb(model, rows, 4, table, "fp32") == pytest.approx(expected, rel=1e-6)
    # a batch size that leaves a short last batch: padded with ignored targets, the same bpb
    assert evaluate_bpb(model, rows, 3, table, "fp32") == pytest.approx(expected, rel=1e-6)


def _bpb_worker(rank, world_size, rows, table, out_dir):
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=len(table), n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
    model.init_weights()
    bpb = evaluate_bpb(model, rows, 2, table, "fp32")  # bf16 rounds by batch composition
    (out_dir / f"{world_size}_{rank}").write_text(repr(bpb))


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.heavy)])
def test_bits_per_byte_is_the_same_at_any_world_size(tok, tmp_path, world_size):
    """The rows define the measurement: ranks share 7 rows (uneven shares, padded last batches) and every
    rank reports the single-process bpb, up to the fp32 rounding of per-batch sums (one row counted twice or
    missed would move it by about 1/7)."""
    from test_dist import spawn

    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, tok.vocab_size, (7, 17), generator=g)
    rows[:, 0] = tok.bos_id
    table = tok.token_bytes()
    _bpb_worker(0, 1, rows, table, tmp_path)
    spawn(_bpb_worker, world_size, rows, table, tmp_path)
    single = float((tmp_path / "1_0").read_text())
    got = [float((tmp_path / f"{world_size}_{r}").read_text()) for r in range(world_size)]
    assert got == pytest.approx([single] * world_size, rel=1e-7)


def test_bits_per_byte_ignores_padding_inside_rows(tok):
    """val_rows pads the last rows of a split with -1, inputs included: those positions count for nothing,
    and the rest scores as a hand-computed cross-entropy over the unpadded prefixes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
    model.init_weights()
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)  # not uniform: positions must line up to match
    rows = torch.tensor([(tok.encode(text, prepend_bos=True) * 8)[:33] for text in TEXTS[:2]])
    keep = 20
    rows[1, keep:] = -1
    table = tok.token_bytes()
    nats, nbytes = 0.0, 0
    for row, n in ((rows[0], 33), (rows[1], keep)):
        x, y = row[:n - 1], row[1:n]
        logp = torch.log_softmax(model(x[None])[0].double(), dim=-1)
        text = table[y] > 0
        nats -= float(logp[torch.arange(len(y)), y][text].sum())
        nbytes += int(table[y].sum())
    assert evaluate_bpb(model, rows, 2, table, "fp32") == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-6)
