"""The data loader: BOS-first rows, lossless packing, rank-disjoint documents, exact resume."""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanomuon.dataloader import DataLoader
from nanomuon.dataset import data_dir
from nanomuon.tokenizer import Tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def make_docs(n, seed):
    rng = random.Random(seed)
    # a unique, recognisable prefix per document; lengths from a few tokens to several rows
    return [f"doc{seed}x{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 10, 40, 150, 400])))
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("base")
    mp = pytest.MonkeyPatch()
    mp.setenv("NANOMUON_BASE_DIR", str(base))
    d = data_dir("fineweb-edu")
    d.mkdir(parents=True, exist_ok=True)
    shards = [make_docs(n, seed) for seed, n in enumerate([120, 75, 90, 40])]  # last one is val
    for i, docs in enumerate(shards):
        pq.write_table(pa.table({"text": docs}), d / f"shard_{i:05d}.parquet", row_group_size=32)
    tok = Tokenizer.train(iter(sum(shards, [])), vocab_size=400)
    yield tok, shards
    mp.undo()


def loader(tok, B=4, T=64, rank=0, world=1, split="train", buffer_size=50):
    return DataLoader(tok, "fineweb-edu", split, B, T, rank=rank, world_size=world, buffer_size=buffer_size,
                      tokenize_batch=16)


def test_rows_start_with_bos_and_targets_shift(corpus):
    tok, _ = corpus
    dl = loader(tok)
    for _ in range(20):
        x, y = dl.next_batch()
        assert x.shape == y.shape == (4, 64) and x.dtype == torch.long
        assert (x[:, 0] == tok.bos_id).all()
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_packing_drops_and_invents_nothing(corpus):
    """Over the stream, every emitted token is a document token: the sequence of BOS-delimited pieces,
    read per document, reassembles each document's tokens exactly and in order."""
    tok, shards = corpus
    train_docs = sum(shards[:-1], [])
    encoded = {d.split(":")[0]: tok.encode(d, prepend_bos=True) for d in train_docs}
    dl = loader(tok, B=2, T=48, buffer_size=8)
    # Ask for well over one epoch of tokens and rebuild documents from the state's bookkeeping.
    total = sum(len(t) for t in encoded.values())
    emitted = []
    while len(emitted) < 1.5 * total:
        x, y = dl.next_batch()
        rows = torch.cat([x, y[:, -1:]], dim=1)
        emitted.extend(rows.flatten().tolist())
    state = dl.state_dict()
    buffered = sum(len(tok.encode(train_docs[doc], prepend_bos=True)) - off for _, doc, off in state["buffer"])
    # documents entered into the buffer: everything before the (epoch, doc) read position
    n_docs = len(train_docs)
    entered = state["epoch"] * n_docs + state["doc"]
    expected = sum(len(tok.encode(train_docs[k % n_docs], prepend_bos=True)) for k in range(entered))
    assert len(emitted) + buffered == expected  # no padding, nothing dropped
    assert emitted.count(tok.bos_id) <= entered  # BOS only where a document starts


def test_ranks_read_disjoint_documents(corpus):
    tok, shards = corpus
    train_docs = sum(shards[:-1], [])
    world = 3
    seen = {}
    for rank in range(world):
        dl = loader(tok, B=4, T=64, rank=rank, world=world)
        for _ in range(15):
            x, _ = dl.next_batch()
            for row in x.tolist():
                text = tok.decode(row[1:12])  # the document that opens the row
                name = text.split(":")[0]
                seen.setdefault(name, set()).add(rank)
    assert seen
    index = {d.split(":")[0]: k for k, d in enumerate(train_docs)}
    for name, ranks in seen.items():
        assert len(ranks) == 1, f"{name} read by ranks {ranks}"
        assert ranks == {index[name] % world}


def test_val_split_is_the_last_shard(corpus):
    tok, shards = corpus
    val_names = {d.split(":")[0] for d in shards[-1]}
    dl = loader(tok, split="val")
    x, _ = dl.next_batch()
    assert tok.decode(x[0, 1:12].tolist()).split(":")[0] in val_names


@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume(corpus, world):
    tok, _ = corpus
    for rank in range(world):
        ref = loader(tok, rank=rank, world=world, buffer_size=20)
        for _ in range(13):  # stop mid-epoch, with partly used documents buffered
            ref.next_batch()
        state = json.loads(json.dumps(ref.state_dict()))  # checkpoints keep it as JSON
        expected = [ref.next_batch() for _ in range(40)]  # runs past the end of an epoch
        resumed = loader(tok, rank=rank, world=world, buffer_size=20)
        resumed.load_state_dict(state)
        for (x1, y1), (x2, y2) in zip(expected, (resumed.next_batch() for _ in range(40))):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert resumed.state_dict() == ref.state_dict()


def test_resume_refuses_a_different_setup(corpus):
    tok, _ = corpus
    state = loader(tok, world=2).state_dict()
    with pytest.raises(ValueError, match="world_size"):
        loader(tok, world=3).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        loader(tok, B=8, world=2).load_state_dict(state)


def test_bad_arguments(corpus):
    tok, _ = corpus
    with pytest.raises(ValueError, match="rank"):
        loader(tok, rank=2, world=2)
    with pytest.raises(ValueError, match="seq_len"):
        loader(tok, T=0)


def test_prefetch_yields_the_same_batches_and_states(corpus):
    tok, _ = corpus
    plain = loader(tok, world=2, buffer_size=20)
    ahead = DataLoader(tok, "fineweb-edu", "train", 4, 64, rank=0, world_size=2, buffer_size=20, tokenize_batch=16,
                       prefetch=3)
    try:
        for _ in range(25):
            (x1, y1), (x2, y2) = plain.next_batch(), ahead.next_batch()
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
            # the state describes the batches handed out, not the ones the thread packed ahead
            assert ahead.state_dict() == plain.state_dict()
        state = ahead.state_dict()
        expected = [ahead.next_batch()[0] for _ in range(5)]
        with pytest.raises(RuntimeError, match="before the first next_batch"):
            ahead.load_state_dict(state)
    finally:
        ahead.close()
    resumed = DataLoader(tok, "fineweb-edu", "train", 4, 64, rank=0, world_size=2, buffer_size=20,
                         tokenize_batch=16, prefetch=2)
    resumed.load_state_dict(state)
    try:
        assert all(torch.equal(resumed.next_batch()[0], x) for x in expected)
    finally:
        resumed.close()


def test_prefetch_thread_errors_reach_the_caller(corpus):
    tok, _ = corpus

    class Broken:
        bos_id = tok.bos_id

        def encode(self, texts, prepend_bos=False):
            raise UnicodeError("tokenizer exploded")

    dl = DataLoader(Broken(), "fineweb-edu", "train", 2, 16, prefetch=2)
    with pytest.raises(UnicodeError, match="exploded"):
        dl.next_batch()
    dl.close()
