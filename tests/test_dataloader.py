"""The data loader: BOS-first rows, lossless packing, rank-disjoint documents, exact resume."""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanomuon.dataloader import DataLoader, reshard_states
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
    with pytest.raises(ValueError, match="seq_len"):
        loader(tok, T=32, world=2).load_state_dict(state)
    loader(tok, B=8, world=2).load_state_dict(state)  # the state counts rows: a new batch size is fine


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


class DocPositionTokenizer:
    """Token = doc index * 100000 + position (position 0 stands for BOS): every emitted token says which
    document and which position it came from, so the test can count what was read, skipped or repeated."""

    bos_id = 0

    def __init__(self, docs):
        self.index = {text: k for k, text in enumerate(docs)}

    def _one(self, text):
        k = self.index[text]
        return [k * 100000 + i for i in range(1 + len(text.split()))]

    def encode(self, text, prepend_bos=False):
        return [self._one(t) for t in text] if isinstance(text, list) else self._one(text)


def take(dl, n):
    """n batches as (doc, position) pairs, every row's tokens including the last target."""
    out = []
    for _ in range(n):
        x, y = dl.next_batch()
        out.extend(divmod(t, 100000) for t in torch.cat([x, y[:, -1:]], dim=1).flatten().tolist())
    return out


@pytest.mark.parametrize("new_world", [1, 3, 4])
# (batches read by old rank 0, by old rank 1): with these, the frontier lies mid-epoch, at the last
# document of epoch 0 (so new ranks 2 and 3 start epoch 1), or in epoch 1 while rank 1 is still in epoch 0
@pytest.mark.parametrize("old_batches", [(6, 9), (66, 65), (75, 60)], ids=["mid-epoch", "epoch-end", "across-epochs"])
def test_reshard_reads_every_document_once_per_epoch(corpus, new_world, old_batches):
    """2 ranks read (rank 0 further than rank 1: a ragged frontier, which in the second case straddles the
    epoch boundary), save, and M new ranks go on from the resharded states. Counting every token emitted
    plus every token still buffered at the end, each document must be whole (all its positions counted
    the same number of times n) and n must be the number of epochs it was read in: with the slowest new
    rank at (e, L), documents below L were read e + 1 times and the others e or e + 1 times."""
    _, shards = corpus
    docs = sum(shards[:-1], [])
    tok = DocPositionTokenizer(docs)
    lengths = [len(tok.encode(d)) for d in docs]

    def make(rank, world):
        return DataLoader(tok, "fineweb-edu", "train", 2, 48, rank=rank, world_size=world, buffer_size=12,
                          tokenize_batch=16)

    emitted, states = [], []
    for rank, n in enumerate(old_batches):
        dl = make(rank, 2)
        emitted += take(dl, n)
        states.append(json.loads(json.dumps(dl.state_dict())))  # checkpoints keep it as JSON
    assert states[1]["epoch"] == 0 and states[0]["epoch"] == (old_batches == (75, 60))
    if old_batches == (66, 65):
        assert max((s["epoch"], s["doc"]) for s in states) == (0, len(docs) - 2)
    new = []
    for rank in range(new_world):
        dl = make(rank, new_world)
        dl.load_state_dict(reshard_states(states, rank, new_world))
        new.append(dl)
    while True:  # read on until every new rank is past the old frontier's epoch, and then some
        for dl in new:
            emitted += take(dl, 3)
        finals = [dl.state_dict() for dl in new]
        if min(s["epoch"] for s in finals) > states[0]["epoch"] and min(s["doc"] for s in finals) > 60:
            break
    assert max(s["epoch"] for s in finals) == min(s["epoch"] for s in finals)
    counts = [[0] * n for n in lengths]
    for doc, pos in emitted:
        counts[doc][pos] += 1
    for s in finals:
        for _, doc, offset in s["buffer"]:
            for pos in range(offset, lengths[doc]):
                counts[doc][pos] += 1
    epoch, low = min((s["epoch"], s["doc"]) for s in finals)
    for doc, c in enumerate(counts):
        assert len(set(c)) == 1, f"document {doc} is torn: positions counted {sorted(set(c))} times"
        expected = {epoch + 1} if doc < low else {epoch, epoch + 1}
        assert c[0] in expected, f"document {doc} was read {c[0]} times, expected {expected}"


def test_reshard_refuses_incomplete_or_mixed_states(corpus):
    tok, _ = corpus
    states = [loader(tok, rank=r, world=2).state_dict() for r in range(2)]
    with pytest.raises(ValueError, match="all ranks"):
        reshard_states(states[:1] + states[:1], 0, 3)
    other = loader(tok, rank=1, world=2, T=32).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        reshard_states([states[0], other], 0, 3)
