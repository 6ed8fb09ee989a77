"""The data loader: every token of an epoch in exactly one row, BOS-first rows, bounded memory, rank-disjoint
documents, exact resume, resharding, and the val stream.

Most tests read the rows through WordTokenizer, whose every token says which document and position it came
from, so what the model sees is counted directly against the corpus, not against the loader's bookkeeping."""

import json
import random
import tracemalloc
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanomuon.dataloader import DataLoader, chunk_end, reshard_states, val_rows
from nanomuon.dataset import data_dir
from nanomuon.tokenizer import Tokenizer

BOS = 999_999_999  # WordTokenizer's inserted BOS; a document's own first token is (doc, 0)
SCALE = 100_000  # token = doc * SCALE + position


class WordTokenizer:
    """Word `t<N>` is token N = doc * SCALE + position (positions from 1); with prepend_bos, a document
    opens with (doc, 0) instead of BOS, so an inserted BOS (bos_id) is told apart from a document's own."""

    bos_id = BOS

    def _one(self, text, prepend_bos):
        ids = [int(w[1:]) for w in text.split()]
        return [ids[0] - ids[0] % SCALE] + ids if prepend_bos else ids

    def encode(self, text, prepend_bos=False):
        return [self._one(t, prepend_bos) for t in text] if isinstance(text, list) else self._one(text, prepend_bos)


# document lengths in words: short, a few rows, many rows (at seq 48), and one longer than the whole buffer
LENGTHS = [1, 2, 3, 10, 40, 150, 400, 1500]
HUGE = 9000


def make_docs(first, n, seed, huge_at=None):
    rng = random.Random(seed)
    docs = []
    for k in range(first, first + n):
        words = HUGE if k == huge_at else rng.choice(LENGTHS)
        seps = [rng.choice(["\n", "\n    ", "  "]) if rng.random() < 0.2 else " " for _ in range(words)]
        docs.append("".join(f"{s}t{k * SCALE + p}" for p, s in enumerate(seps, 1)).lstrip())
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("base")
    mp = pytest.MonkeyPatch()
    mp.setenv("NANOMUON_BASE_DIR", str(base))
    d = data_dir("fineweb-edu")
    d.mkdir(parents=True, exist_ok=True)
    sizes = [120, 75, 90, 40]  # the last shard is val
    shards, first = [], 0
    for seed, n in enumerate(sizes):
        shards.append(make_docs(first, n, seed, huge_at=100 if seed == 0 else None))
        first += n
    train = sum(shards[:-1], [])
    train[7] = None  # a null text and an empty one are skipped
    train[8] = ""
    for i, docs in enumerate(shards):
        rows = train[sum(sizes[:i]):sum(sizes[:i + 1])] if i < len(sizes) - 1 else docs
        pq.write_table(pa.table({"text": pa.array(rows, pa.string())}), d / f"shard_{i:05d}.parquet",
                       row_group_size=32)
    tok = Tokenizer.train(iter(d for d in train if d), vocab_size=400)
    yield tok, train, shards[-1]
    mp.undo()


def loader(tok, B=4, T=48, rank=0, world=1, split="train", buffer_size=12, chunk_chars=500, **kw):
    return DataLoader(tok, "fineweb-edu", split, B, T, rank=rank, world_size=world, buffer_size=buffer_size,
                      tokenize_batch=16, chunk_chars=chunk_chars, **kw)


def expected_tokens(train, rank, world):
    """(doc, position) of every token of this rank's documents, the document's own first token included."""
    return Counter((k, p) for k, t in enumerate(train) if t and k % world == rank
                   for p in range(len(t.split()) + 1))


def rows_of_epochs(dl, epochs):
    """Every row the loader makes for the first `epochs` epochs, with each row's epoch."""
    out = []
    while True:
        row, epoch = dl.next_row()
        if epoch >= epochs:
            return out
        out.append((row.tolist(), epoch))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_epoch_trains_every_token_exactly_once(corpus, world):
    _, train, _ = corpus
    tok = WordTokenizer()
    seen_docs = set()
    for rank in range(world):
        dl = loader(tok, rank=rank, world=world)
        rows = rows_of_epochs(dl, 2)
        expected = expected_tokens(train, rank, world)
        for e in (0, 1):
            trained, inserted, padded = Counter(), 0, 0
            epoch_rows = [r for r, re in rows if re == e]
            for row in epoch_rows:
                assert len(row) == 49
                if row[0] == BOS:  # an inserted BOS opens a continuation, never a document start
                    inserted += 1
                    assert row[1] % SCALE > 0, row[:3]
                else:
                    assert row[0] % SCALE == 0, "a row must open with BOS or a document's own first token"
                assert BOS not in row[1:], "the packer inserts BOS only at a row's start"
                if -1 in row:  # a document that ends with nothing left to fill its row: the epoch's end
                    padded += 1
                    assert set(row[row.index(-1):]) == {-1}
                trained.update(divmod(t, SCALE) for t in row if t not in (BOS, -1))
            # each token of each document of this rank in exactly one row: nothing dropped, nothing repeated
            assert trained == expected, (sorted((expected - trained).items())[:5], sorted(trained - expected)[:5])
            assert inserted <= len(epoch_rows)
            assert padded <= dl.interleave, "padding only where the epoch's last documents end"
            seen_docs |= {k for k, _ in trained}
        # a row that ends mid-document is continued, after BOS, at the start of the row `interleave` rows on
        # (sooner only at the end of an epoch, when nothing else is left to open rows with)
        stream = [r for r, _ in rows]
        for i, a in enumerate(stream):
            doc, pos = divmod(a[-1], SCALE)
            if a[-1] != -1 and pos < len(train[doc].split()):
                later = [j for j in range(i + 1, len(stream)) if stream[j][:2] == [BOS, a[-1] + 1]]
                assert later and later[0] - i <= dl.interleave, (i, a[-3:])
                if i < len(stream) // 4:
                    assert later[0] - i == dl.interleave, (i, a[-3:])
    assert seen_docs == {k for k, t in enumerate(train) if t}, "the ranks together cover every document"


def test_rows_are_what_next_batch_returns(corpus):
    tok, _, _ = corpus
    a, b = loader(tok, B=4), loader(tok, B=1, interleave=4)  # the default interleave is the batch size
    for _ in range(30):
        x, y = a.next_batch()
        assert x.shape == y.shape == (4, 48) and x.dtype == y.dtype == torch.long
        assert (x[:, 0] == tok.bos_id).all()
        made = [b.next_row() for _ in range(4)]
        rows = torch.tensor([r.tolist() for r, _ in made])
        assert torch.equal(y, rows[:, 1:])
        assert torch.equal(x, rows[:, :-1].masked_fill(rows[:, :-1] < 0, tok.bos_id))
        assert a.batch_epochs == [e for _, e in made]


def test_real_tokenizer_rows_hold_the_corpus_unigrams(corpus):
    """With the real tokenizer and documents cut into chunks, one epoch's rows hold exactly the tokens of
    the documents encoded whole: chunks end where the tokenizer's pre-split would split anyway."""
    tok, train, _ = corpus
    dl = loader(tok, buffer_size=8, chunk_chars=64)
    rows = rows_of_epochs(dl, 1)
    trained = Counter(t for row, _ in rows for t in row if t != -1)
    expected = Counter(t for d in train if d for t in tok.encode(d, prepend_bos=True))
    inserted = trained[tok.bos_id] - expected[tok.bos_id]
    assert 0 <= inserted <= len(rows)
    trained[tok.bos_id] -= inserted
    assert trained == expected


def test_chunks_end_at_line_starts():
    text = "ab\n  cd\nef gh\n\nij kl mn"
    assert chunk_end(text, 0, 100) == len(text)
    assert chunk_end(text, 0, 10) == 8  # after "\n" before "ef", not before the indented "  cd"
    assert chunk_end("abcdefghij", 0, 4) == 4  # no space or newline: a hard cut
    assert chunk_end("abcd efghij", 0, 8) == 4  # else before a space
    assert chunk_end("abcd  efghij", 0, 9) == 5  # the last space of a run, as the pre-split cuts it


def test_memory_and_state_stay_bounded_over_many_epochs(corpus):
    _, train, _ = corpus
    tok = WordTokenizer()
    dl = loader(tok, buffer_size=12, world=2)
    sizes, mem = [], []
    tracemalloc.start()
    try:
        for epoch in range(8):
            while True:
                row, e = dl.next_row()
                assert len(dl._pool) + len(dl._open) <= 12
                if e > epoch:
                    break
            sizes.append(len(json.dumps(dl._state_now())))
            mem.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert max(sizes) < 1500, sizes  # a dozen small references, whatever has been read
    assert max(mem[2:]) < 1.2 * mem[2] + 200_000, mem  # no growth from epoch to epoch


@pytest.mark.slow  # tokenizes 50 MB twice, about 30 s; a session's own --slow run covers it, CI does not
def test_a_50mb_document_trains_in_bounded_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path))
    d = data_dir("fineweb-edu")
    d.mkdir(parents=True)
    rng = random.Random(0)
    line = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "(x)", "42"]) for _ in range(5000)) + " end"
    huge = "\n".join([line] * (50_000_000 // len(line)))
    pq.write_table(pa.table({"text": ["a short one", huge, "another short one"]}), d / "shard_00000.parquet")
    pq.write_table(pa.table({"text": ["val text"]}), d / "shard_00001.parquet")
    tok = Tokenizer.train(iter([line, "a short one"]), vocab_size=300)
    counts = Counter(tok.encode(line))
    dl = DataLoader(tok, "fineweb-edu", "train", 1, 2048, buffer_size=4)
    tracemalloc.start()
    base_mem = tracemalloc.get_traced_memory()[0]
    trained, rows = Counter(), 0
    try:
        while True:
            row, epoch = dl.next_row()
            if epoch:
                break
            trained.update(row)
            rows += 1
        peak = tracemalloc.get_traced_memory()[1] - base_mem
    finally:
        tracemalloc.stop()
    # whole, the document would be ~13M token ids (~460 MB as a Python list); the loader holds its text
    # (50 MB, read from the shard) and one 64K-character chunk of tokens at a time
    assert peak < 2.5 * len(huge), f"peak {peak / 1e6:.0f} MB"
    n_lines = huge.count("\n") + 1
    assert trained[counts.most_common(1)[0][0]] >= counts.most_common(1)[0][1] * n_lines  # every line was trained
    assert sum(trained.values()) >= rows * 2049 - 2049


def test_a_long_document_in_a_tiny_split_is_held_and_read_about_once(tmp_path, monkeypatch):
    """A split of two documents, one ~80 chunks long, each in its own shard: the loader must hold a
    small multiple of the long text, not a copy per document read ahead (tokenize_batch documents a
    call, most of them repeats of the same two), and read each shard at most twice an epoch."""
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path))
    d = data_dir("fineweb-edu")
    d.mkdir(parents=True)
    long_doc = " ".join(f"t{p}" for p in range(1, 99_000))  # doc 0: ~650K characters, ~80 chunks
    short = "t100001 t100002"
    for i, texts in enumerate(([long_doc], [short], ["t200000"])):
        pq.write_table(pa.table({"text": texts}), d / f"shard_{i:05d}.parquet")
    reads, real = [], pq.ParquetFile.read_row_group
    count = lambda *a, **k: reads.append(a) or real(*a, **k)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", count)
    dl = DataLoader(WordTokenizer(), "fineweb-edu", "train", 2, 64, buffer_size=16,
                    chunk_chars=8192)
    docs = [long_doc, short]
    trained = [[0] * (len(t.split()) + 1) for t in docs]  # allocated before measuring
    tracemalloc.start()
    base_mem = tracemalloc.get_traced_memory()[0]
    try:
        while True:
            row, epoch = dl.next_row()
            if epoch == 2:
                break
            for t in row:
                if t not in (BOS, -1):
                    trained[t // SCALE][t % SCALE] += 1
        peak = tracemalloc.get_traced_memory()[1] - base_mem
    finally:
        tracemalloc.stop()
    assert trained == [[2] * (len(t.split()) + 1) for t in docs]  # every token in both epochs
    assert peak < 4 * len(long_doc), f"peak {peak:,} bytes, the document {len(long_doc):,} chars"
    assert len(reads) <= 2 * 3 * 2, len(reads)  # 2 documents, 3 epochs begun, at most 2 reads each


def test_val_rows_are_a_contiguous_stream_of_whole_documents(corpus):
    _, _, val_docs = corpus
    tok = WordTokenizer()
    rows = val_rows(tok, "fineweb-edu", 48, 48 * 30)
    assert rows.shape == (30, 49)
    stream = []
    for row in rows.tolist():
        assert row[0] == BOS or row[0] % SCALE == 0
        stream += [t for t in (row[1:] if row[0] == BOS else row) if t != -1]
    expected = [t for d in val_docs for t in tok.encode(d, prepend_bos=True)]
    assert stream == expected[:len(stream)]  # the documents in order, nothing skipped or repeated
    # more than the split holds: all of it once, the last row padded, no document twice
    everything = val_rows(tok, "fineweb-edu", 48, 10 ** 7).tolist()
    flat = [t for row in everything for t in (row[1:] if row[0] == BOS else row) if t != -1]
    assert flat == expected


@pytest.mark.parametrize("world, seed", [(1, None), (2, None), (2, 5)])
def test_exact_resume(corpus, world, seed):
    """Resumed from a state saved at any batch (several are tried, mid-epoch with partly trained documents
    buffered, continuations waiting their turn), a loader yields exactly the batches of the uninterrupted
    one, past the end of an epoch; with a shuffled document order too."""
    tok = WordTokenizer()
    for rank in range(world):
        ref = loader(tok, B=16, rank=rank, world=world, shuffle_seed=seed)
        states, batches = {}, []
        for i in range(150):
            if i in (5, 13, 30, 47):
                states[i] = json.loads(json.dumps(ref.state_dict()))  # checkpoints keep it as JSON
                assert states[i]["open"]
            batches.append(ref.next_batch())
        assert ref.state_dict()["epoch"] >= 1 and states[5]["buffer"]
        for i, state in states.items():
            resumed = loader(tok, B=16, rank=rank, world=world, shuffle_seed=seed)
            resumed.load_state_dict(state)
            assert resumed.state_dict() == state  # what it loaded, the continuations' waits included
            for x1, y1 in batches[i:]:
                x2, y2 = resumed.next_batch()
                assert torch.equal(x1, x2) and torch.equal(y1, y2), f"resumed at batch {i}"
            assert resumed.state_dict() == ref.state_dict()


def test_a_shuffle_seed_reorders_the_documents_and_trains_every_token_once(corpus):
    """shuffle_seed (base_train --data-seed, ablate's seeds): another document order per seed, the same for the
    same seed, mixing documents of several row groups; the ranks together still train every token once."""
    _, train, _ = corpus
    tok = WordTokenizer()

    def epoch_docs(seed, rank=0):  # the documents in the order their first tokens are trained, and the tokens
        rows = [r for r, _ in rows_of_epochs(loader(tok, rank=rank, world=2, shuffle_seed=seed), 1)]
        tokens = Counter(divmod(t, SCALE) for r in rows for t in r if t not in (BOS, -1))
        return list(dict.fromkeys(t // SCALE for r in rows for t in r if t not in (BOS, -1))), tokens

    (order, tokens0), (_, tokens1) = epoch_docs(1), epoch_docs(1, rank=1)
    assert tokens0 + tokens1 == expected_tokens(train, 0, 1)
    assert epoch_docs(1)[0] == order
    assert order != epoch_docs(None)[0] and order != epoch_docs(2)[0]
    assert {k % 2 for k in order} == {0, 1}  # rank 0's documents are no longer the even ones
    assert len({k // 32 for k in order[:10]}) > 2  # nor read row group by row group (32 documents each)
    with pytest.raises(ValueError, match="shuffle_seed"):
        loader(tok, world=2, shuffle_seed=2).load_state_dict(loader(tok, world=2, shuffle_seed=1).state_dict())


def test_resume_inside_a_chunked_document(corpus):
    _, train, _ = corpus
    tok = WordTokenizer()
    ref = loader(tok, buffer_size=2)
    while True:  # until the huge document (many chunks) is the pending continuation, past its first chunk
        ref.next_batch()
        opened = ref.state_dict()["open"]
        if opened and opened[0][1] == 100 and opened[0][2] > 0:
            break
    state = json.loads(json.dumps(ref.state_dict()))
    resumed = loader(tok, buffer_size=2)
    resumed.load_state_dict(state)
    for _ in range(30):
        assert torch.equal(ref.next_batch()[1], resumed.next_batch()[1])


def test_resume_refuses_a_different_setup(corpus):
    tok, _, _ = corpus
    state = loader(tok, world=2).state_dict()
    with pytest.raises(ValueError, match="world_size"):
        loader(tok, world=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        loader(tok, T=32, world=2).load_state_dict(state)
    with pytest.raises(ValueError, match="chunk_chars"):
        loader(tok, world=2, chunk_chars=900).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "open"}
    with pytest.raises(ValueError, match="older than the loader"):
        loader(tok, world=2).load_state_dict(old)
    loader(tok, B=8, world=2).load_state_dict(state)  # the state counts rows: a new batch size is fine


def test_bad_arguments(corpus):
    tok, _, _ = corpus
    with pytest.raises(ValueError, match="rank"):
        loader(tok, rank=2, world=2)
    with pytest.raises(ValueError, match="seq_len"):
        loader(tok, T=0)


def test_val_split_is_the_last_shard(corpus):
    _, train, val_docs = corpus
    x, _ = loader(WordTokenizer(), split="val").next_batch()
    assert len(train) <= x[0, 0].item() // SCALE < len(train) + len(val_docs)


def test_prefetch_yields_the_same_batches_and_states(corpus):
    tok, _, _ = corpus
    plain = loader(tok, world=2, buffer_size=20)
    ahead = loader(tok, world=2, buffer_size=20, prefetch=3)
    try:
        for _ in range(25):
            (x1, y1), (x2, y2) = plain.next_batch(), ahead.next_batch()
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
            # the state and stats describe the batches handed out, not the ones the thread packed ahead
            assert ahead.state_dict() == plain.state_dict()
            assert ahead.stats == plain.stats
        state = ahead.state_dict()
        expected = [ahead.next_batch()[0] for _ in range(5)]
        with pytest.raises(RuntimeError, match="before the first next_batch"):
            ahead.load_state_dict(state)
    finally:
        ahead.close()
    resumed = loader(tok, world=2, buffer_size=20, prefetch=2)
    resumed.load_state_dict(state)
    try:
        assert all(torch.equal(resumed.next_batch()[0], x) for x in expected)
    finally:
        resumed.close()


def test_prefetch_thread_errors_reach_the_caller(corpus):
    tok, _, _ = corpus

    class Broken:
        bos_id = tok.bos_id

        def encode(self, texts, prepend_bos=False):
            raise UnicodeError("tokenizer exploded")

    dl = DataLoader(Broken(), "fineweb-edu", "train", 2, 16, prefetch=2)
    with pytest.raises(UnicodeError, match="exploded"):
        dl.next_batch()
    dl.close()


def take(dl, n):
    """n batches as (doc, position) pairs, every row's tokens including the last target."""
    out = []
    for _ in range(n):
        x, y = dl.next_batch()
        out.extend(divmod(t, SCALE) for t in torch.cat([x, y[:, -1:]], dim=1).flatten().tolist()
                   if t not in (BOS, -1))
    return out


def batches_until(dl, done, limit=3000):
    """Batches read until done(state) holds."""
    for n in range(1, limit):
        dl.next_batch()
        if done(dl.state_dict()):
            return n
    raise AssertionError("never reached")


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("new_world", [1, 3, 4])
@pytest.mark.parametrize("case", ["mid-epoch", "epoch-end", "across-epochs"])
def test_reshard_trains_every_token_once_per_epoch(corpus, new_world, case, seed):
    """2 ranks read (rank 0 further than rank 1: a ragged frontier), save, and M new ranks go on from the
    resharded states. The frontier lies mid-epoch, at the last document of epoch 0 (so some new ranks
    start epoch 1), or in epoch 1 while rank 1 is still in epoch 0. Counting every token emitted plus
    every token still buffered at the end, each document must be whole (all its positions counted the
    same number of times n) and n must be the number of epochs it was read in: with the slowest new rank
    at (e, L), documents below L were read e + 1 times and the others e or e + 1 times. With a shuffle
    seed, L and the states' refs count documents in the shuffled order, which every new rank must keep."""
    _, train, _ = corpus
    tok = WordTokenizer()
    n_docs = len(train)

    def make(rank, world):
        return loader(tok, B=2, rank=rank, world=world, shuffle_seed=seed)

    probe = make(0, 2)
    texts = [probe._doc_text(k) for k in range(n_docs)]  # the seed's order: its k-th document
    assert (texts == train) == (seed is None) and sorted(map(str, texts)) == sorted(map(str, train))
    index = {int(t.split()[0][1:]) // SCALE: k for k, t in enumerate(texts) if t}  # corpus doc -> k
    lengths = [len(t.split()) + 1 if t else 0 for t in texts]
    if case == "mid-epoch":
        old_batches = (6, 9)
    elif case == "epoch-end":  # rank 0 stops with the last document of epoch 0 next to read
        old_batches = (batches_until(probe, lambda s: s["epoch"] == 0 and s["doc"] >= n_docs - 4), 20)
    else:
        old_batches = (batches_until(probe, lambda s: s["epoch"] == 1 and s["doc"] > 40), 20)
    emitted, states = [], []
    for rank, n in enumerate(old_batches):
        dl = make(rank, 2)
        emitted += take(dl, n)
        states.append(json.loads(json.dumps(dl.state_dict())))  # checkpoints keep it as JSON
    assert states[1]["epoch"] == 0 and states[0]["epoch"] == (case == "across-epochs")
    new = []
    for rank in range(new_world):
        dl = make(rank, new_world)
        state = reshard_states(states, rank, new_world)
        assert state["shuffle_seed"] == seed
        dl.load_state_dict(state)
        new.append(dl)
    for dl in new:  # each reads on until past the old frontier's epoch, and then some
        while dl.state_dict()["epoch"] <= states[0]["epoch"] or dl.state_dict()["doc"] <= 60:
            emitted += take(dl, 3)
    finals = [dl.state_dict() for dl in new]
    assert max(s["epoch"] for s in finals) == min(s["epoch"] for s in finals)
    counts = [[0] * n for n in lengths]
    for doc, pos in emitted:
        counts[index[doc]][pos] += 1

    def first_position(ref):  # a continuation's offset counts from its chunk's start (BOS is position 0)
        if len(ref) == 2:
            return 0
        _, doc, chunk, pos = ref
        return pos + (1 + len(texts[doc][:chunk].split()) if chunk else 0)

    for s in finals:
        for ref in s["backlog"] + s["buffer"] + [r[:4] for r in s["open"]]:
            for pos in range(first_position(ref), lengths[ref[1]]):
                counts[ref[1]][pos] += 1
    epoch, low = min((s["epoch"], s["doc"]) for s in finals)
    for doc, c in enumerate(counts):
        if not lengths[doc]:  # no text
            continue
        assert len(set(c)) == 1, f"document {doc} is torn: positions counted {sorted(set(c))} times"
        expected = {epoch + 1} if doc < low else {epoch, epoch + 1}
        assert c[0] in expected, f"document {doc} was read {c[0]} times, expected {expected}"


def test_reshard_refuses_incomplete_or_mixed_states(corpus):
    tok, _, _ = corpus
    states = [loader(tok, rank=r, world=2).state_dict() for r in range(2)]
    with pytest.raises(ValueError, match="all ranks"):
        reshard_states(states[:1] + states[:1], 0, 3)
    other = loader(tok, rank=1, world=2, T=32).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        reshard_states([states[0], other], 0, 3)


def test_a_resharded_loader_resumes_exactly(corpus):
    """A state saved while the loader still works through the backlog it was resharded with."""
    tok = WordTokenizer()
    states = []
    for rank, n in enumerate((10, 7)):
        dl = loader(tok, rank=rank, world=2, buffer_size=30)
        take(dl, n)
        states.append(dl.state_dict())
    dl = loader(tok, buffer_size=30)
    dl.load_state_dict(reshard_states(states, 0, 1))
    take(dl, 2)
    state = json.loads(json.dumps(dl.state_dict()))
    assert state["backlog"], "the backlog should not be used up yet"
    resumed = loader(tok, buffer_size=30)
    resumed.load_state_dict(state)
    for _ in range(60):
        assert torch.equal(dl.next_batch()[1], resumed.next_batch()[1])


def test_documents_without_text_are_skipped_with_a_count(corpus, caplog):
    tok = WordTokenizer()
    with caplog.at_level("WARNING", logger="nanomuon"):
        dl = loader(tok, B=16)
    assert "1 of 285 documents in the fineweb-edu train split have null text and are skipped" in caplog.text
    while dl.state_dict()["epoch"] == 0:
        dl.next_batch()
    assert dl.stats["skipped_docs"] == 2  # the null one and the empty one
    assert "2 documents without text skipped" in dl.packing()


def test_rows_of_a_batch_come_from_different_documents(corpus):
    """Interleaving: a long document's pieces are `interleave` rows apart, so in the middle of an epoch each
    row of a micro-batch holds the start of another document (or another document's continuation)."""
    _, train, _ = corpus
    tok = WordTokenizer()
    dl = loader(tok, B=8, buffer_size=40)
    assert dl.interleave == 8
    for _ in range(40):
        x, _ = dl.next_batch()
        if set(dl.batch_epochs) != {0} or dl.state_dict()["epoch"] > 0:
            break  # near the end of the epoch fewer documents are left than rows
        first = [(x[r, 1] if x[r, 0] == BOS else x[r, 0]).item() // SCALE for r in range(8)]
        assert len(set(first)) == 8, first
    with pytest.raises(ValueError, match="interleave must be in 1..buffer_size // 2 = 20"):
        loader(tok, buffer_size=40, interleave=21)


def test_bench_loader_reports_full_coverage_on_the_embedded_corpus(base, capsys):
    # last in this file: the base fixture points NANOMUON_BASE_DIR at the embedded corpus from here on
    from scripts.bench_loader import main

    main(["--world-size", "8", "--device-batch-size", "4", "--max-seq-len", "256", "--epochs", "1", "--batches",
          "2", "--step-ms", "1"])
    out = capsys.readouterr().out
    assert "epoch 0: coverage 100.0000% of the rank's" in out and "0.0000% trained more than once" in out, out
    assert "prefetch 2 / none" in out
