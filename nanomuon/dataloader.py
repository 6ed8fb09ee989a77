"""
The training data loader: documents in, (inputs, targets) token batches out, every token of an
epoch trained exactly once, in bounded memory, with exact resume. docs/data.md, "The data loader",
has the packing rules and the numbers. Its own design rather than a torch DataLoader, for:
- Distribution: global document k belongs to rank k % world_size, whatever the shard sizes.
- Tokenizing on the fly (tiktoken), in a prefetch thread: a new tokenizer needs no preprocessing.
- Packing: rows of seq_len + 1 tokens open with BOS and never mix epochs; a cut document's
  remainder opens a row `interleave` rows later, so a long one does not fill a micro-batch alone.
- Bounded memory: at most buffer_size pieces; a long document is tokenized chunk by chunk, cut
  where the tokenizer's pre-split cuts anyway, so its tokens are the whole text's.
- Exact resume: state_dict() names the buffered pieces by (epoch, document[, chunk, offset]);
  reshard_states() turns N ranks' states into M, every token still trained once per epoch.
"""

import bisect
import contextlib
import itertools
import logging
import queue
import random
import threading
from array import array
from collections import deque

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from nanomuon.common import one_line, shown
from nanomuon.dataset import DATASETS, data_dir, list_shards, open_shard
from nanomuon.sources import hold

log = logging.getLogger("nanomuon")
# row groups whose documents a shuffle_seed mixes: the embedded corpus's 7, 8,192 FineWeb docs
SHUFFLE_WINDOW = 8
UNKNOWN = float("inf")  # the length of a document whose later chunks are not tokenized yet
# what a loader state must share with the loader that loads it, and every rank's state with the
# others' (shuffle_seed decides which document each index names: every rank reads in one order)
SHARED = ("dataset", "split", "seq_len", "buffer_size", "num_docs", "chunk_chars", "shuffle_seed")


def chunk_end(text: str, start: int, chunk_chars: int) -> int:
    """Where the chunk of `text` at `start` ends: at most chunk_chars on, after a newline or before
    a space followed by a non-space, boundaries of the tokenizer's pre-split (GPT-4's), so chunks
    encode to the whole text's tokens; without either in the chunk's second half, anywhere."""
    end = start + chunk_chars
    if end >= len(text):
        return len(text)
    lo = start + chunk_chars // 2
    for sep, after in (("\n", 1), (" ", 0)):
        i = text.rfind(sep, lo, end - 1)
        while i >= 0 and text[i + 1].isspace():
            i = text.rfind(sep, lo, i)
        if i >= 0:
            return i + after
    return end


class DataError(ValueError):
    """Bad data found as it is read (a corrupt row group, a rank without text), not at the start."""


class _Piece:
    """What is left of a document: its current chunk's tokens from `pos`, where the next chunk
    starts (None on the last), and its text once that chunk is wanted (waiting pieces hold none)."""
    __slots__ = ("epoch", "doc", "text", "chunk", "next", "tokens", "pos", "due")

    def __init__(self, epoch, doc, tokens, chunk=0, next_chunk=None, pos=0, due=0):
        self.epoch, self.doc, self.tokens, self.pos = epoch, doc, tokens, pos
        self.text, self.chunk, self.next, self.due = None, chunk, next_chunk, due  # due: its row

    def left(self) -> float:
        return len(self.tokens) - self.pos if self.next is None else UNKNOWN

    def ref(self) -> tuple:
        """(epoch, doc) untouched, else (epoch, doc, chunk start, token offset)."""
        return ((self.epoch, self.doc, self.chunk, self.pos) if self.chunk or self.pos
                else (self.epoch, self.doc))


class DataLoader:
    """next_batch() gives (inputs, targets), each (batch_size, seq_len) int64 (epochs wrap around),
    always contiguous: a compiled model guards on strides, and one layout never recompiles it.
    A row is seq_len + 1 packed tokens, inputs the first seq_len, targets the last; padding (only
    at an epoch's end) has target -1 and input BOS. After next_batch(), batch_epochs holds each
    row's epoch; stats counts rows, inserted BOS and padding. shuffle_seed: the row groups shuffled,
    then the documents of each SHUFFLE_WINDOW of them (read together, so each group is still read
    once); None reads in file order."""

    def __init__(self, tokenizer, dataset: str, split: str, batch_size: int, seq_len: int,
                 rank: int = 0, world_size: int = 1, device="cpu", buffer_size: int = 1000,
                 tokenize_batch: int = 128, prefetch: int = 0, chunk_chars: int = 1 << 16,
                 interleave: int | None = None, shuffle_seed: int | None = None):
        if (min(batch_size, seq_len, buffer_size, tokenize_batch) < 1 or prefetch < 0
                or chunk_chars < 2):
            raise ValueError("DataLoader needs batch_size, seq_len, buffer_size, "
                             "tokenize_batch >= 1, prefetch >= 0 and chunk_chars >= 2, got "
                             f"{batch_size}, {seq_len}, {buffer_size}, {tokenize_batch}, "
                             f"{prefetch}, {chunk_chars}")
        most = max(1, buffer_size // 2)
        # every row of a micro-batch from another document, buffer permitting
        interleave = min(batch_size, most) if interleave is None else interleave
        if not 1 <= interleave <= most:
            raise ValueError(f"interleave must be in 1..buffer_size // 2 = {most} (the rest of "
                             f"the buffer fills the rows), got {interleave}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.tokenizer, self.bos, self.device = tokenizer, tokenizer.bos_id, torch.device(device)
        self.dataset, self.split, self.rank, self.world_size = dataset, split, rank, world_size
        self.batch_size, self.seq_len, self.buffer_size = batch_size, seq_len, buffer_size
        self.tokenize_batch, self.chunk_chars, self.prefetch = tokenize_batch, chunk_chars, prefetch
        self.interleave, self.shuffle_seed = interleave, shuffle_seed
        self._queue, self._stop, self._thread = (queue.Queue(maxsize=max(prefetch, 1)),
                                                 threading.Event(), None)
        # a prepared source: a shared lock, so that prepare() does not remove it while it is read
        self._held = None if dataset in DATASETS else hold(data_dir(dataset))
        self.files = list_shards(dataset, split)
        groups, nulls, empty = self._row_groups()
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(groups)
        size = 1 if shuffle_seed is None else SHUFFLE_WINDOW
        windows = [groups[i:i + size] for i in range(0, len(groups), size)]
        self.windows = [[g for g, _ in w] for w in windows]
        # where each window's documents start, then the number of documents
        *self.starts, total = itertools.accumulate((sum(n for _, n in w) for w in windows),
                                                  initial=0)
        self.num_docs = total
        if self.num_docs < world_size:
            raise ValueError(f"the {dataset} {split} split has {self.num_docs} documents, fewer "
                             f"than the {world_size} ranks; use fewer processes or more data")
        if nulls + empty == total:  # else found as read, per rank (_read_ahead)
            what = "null" if not empty else "empty" if not nulls else "null or empty"
            raise ValueError(f"the {dataset} {split} split has no text: all {total} documents are "
                             f"{what}; rebuild or replace its shards ({self.files[0].parent})")
        if nulls and rank == 0:
            log.warning(f"nanomuon: {nulls:,} of {total:,} documents in the {dataset} {split} "
                        "split have null text and are skipped")
        # _counts: what the packer made; stats: what next_batch handed out (prefetch packs ahead)
        self._counts = dict(rows=0, inserted=0, padding=0, skipped_docs=0)
        self.stats = dict(self._counts)
        self.batch_epochs: list[int] = []
        self._cached = {}  # window -> texts, 2 last read: to read on, and long texts' next chunks
        self._reset(stream=(0, rank), backlog=[], buffer=[], open_=[])

    def _row_groups(self) -> tuple[list, int, int]:
        """([((file, row group), docs)] of the non-empty row groups, null documents, empty ones),
        from the parquet footers alone: the counts as far as the column statistics tell."""
        groups, nulls, empty = [], 0, 0
        for fi, path in enumerate(self.files):
            pf = open_shard(self.dataset, path)  # a bad file fails here, not mid-run
            col = pf.schema_arrow.get_field_index("text")
            for rg in range(pf.metadata.num_row_groups):
                meta = pf.metadata.row_group(rg)
                if not meta.num_rows:
                    continue
                groups.append(((fi, rg), meta.num_rows))
                stats = meta.column(col).statistics if col < meta.num_columns else None
                null = stats.null_count if stats is not None and stats.has_null_count else 0
                nulls += null
                if stats is not None and stats.has_min_max and stats.max == "":  # all ""
                    empty += meta.num_rows - null
        return groups, nulls, empty

    def _doc_text(self, doc: int) -> str | None:
        w = bisect.bisect_right(self.starts, doc) - 1
        if w not in self._cached:
            texts = []
            for fi, rg in self.windows[w]:
                try:
                    table = pq.ParquetFile(self.files[fi]).read_row_group(rg, columns=["text"])
                except (pa.ArrowException, OSError) as e:
                    raise DataError(f"{self.files[fi]}: row group {rg} is unreadable, the "
                                    "shard is corrupt: delete it and download or build it again "
                                    f"({one_line(e)})") from None
                texts += table.column("text").to_pylist()
            if self.shuffle_seed is not None:
                random.Random(self.shuffle_seed * 1_000_003 + w).shuffle(texts)
            self._cached = dict([*self._cached.items()][-1:] + [(w, texts)])
        return self._cached[w][doc - self.starts[w]]

    def _chunk(self, text: str, start: int) -> tuple[array, int]:
        """Tokens of the chunk of text at start (BOS first for the first), and where it ends."""
        end = chunk_end(text, start, self.chunk_chars)
        piece = text[start:end] if start or end < len(text) else text
        return array("i", self.tokenizer.encode(piece, prepend_bos=start == 0)), end

    def _piece(self, epoch: int, doc: int, text: str, chunk: int = 0, pos: int = 0,
               due: int = 0) -> _Piece:
        """A document re-read from a saved reference: its chunk at `chunk`, from token `pos`."""
        tokens, end = self._chunk(text, chunk)
        if not 0 <= pos < len(tokens):
            raise ValueError(f"data loader state names token {pos} of the chunk at character "
                             f"{chunk} of document {doc}, which has {len(tokens)} tokens: the data "
                             "or the tokenizer changed since it was saved")
        return _Piece(epoch, doc, tokens, chunk, end if end < len(text) else None, pos, due)

    def _read_ahead(self) -> None:
        """Tokenize up to tokenize_batch documents (the backlog, then this rank's stride to its
        epoch's end) into the pending queue. Documents without text are skipped and counted."""
        # first chunks to tokenize in one batch; (ref, from backlog, text, first chunk's end)
        fresh, read, first = [], [], self._stream[0]
        for _ in range(self.tokenize_batch):
            if self._backlog:
                ref, from_backlog = self._backlog.popleft(), True
            elif self._stream[0] > first:  # a tiny split is not read epochs ahead
                break
            else:
                ref, from_backlog = self._stream, False
                epoch, doc = ref[0], ref[1] + self.world_size
                self._stream = (epoch + 1, self.rank) if doc >= self.num_docs else (epoch, doc)
            text = self._doc_text(ref[1])
            if not isinstance(text, str) or not text:
                self._counts["skipped_docs"] += 1
                self._empty_run += 1
                if self._empty_run > self.num_docs:
                    raise DataError(f"the {self.dataset} {self.split} split has no text for rank "
                                     f"{self.rank} of {self.world_size}: a whole epoch of its "
                                     "documents is null or empty")
                continue
            self._empty_run, end = 0, None
            # a fresh document (a 4-tuple is a continuation handed over by reshard_states)
            if len(ref) == 2:
                end = chunk_end(text, 0, self.chunk_chars)
                fresh.append(text if end == len(text) else text[:end])
            read.append((ref, from_backlog, text, end))
        encoded = iter(self.tokenizer.encode(fresh, prepend_bos=True) if fresh else ())
        for ref, from_backlog, text, end in read:
            if end is None:
                p = self._piece(*ref[:2], text, *ref[2:])
            else:
                p = _Piece(*ref, array("i", next(encoded)), 0, end if end < len(text) else None)
            self._pending.append((from_backlog, p))

    def _next_epoch(self) -> int:
        """The epoch of the next document to enter the buffer."""
        while not self._pending:  # an epoch without text reads nothing: on
            self._read_ahead()
        return self._pending[0][1].epoch

    def _refill(self) -> None:
        """Top the buffer up to buffer_size pieces with this epoch's documents."""
        while (len(self._pool) + len(self._open) < self.buffer_size
               and self._next_epoch() == self.epoch):
            p = self._pending.popleft()[1]
            if p.chunk or p.pos:  # handed over by reshard_states: due now
                p.due = self._row
                self._open.append(p)
            else:
                self._add(p)

    def _add(self, p: _Piece) -> None:
        self._seq += 1
        self._pool[self._seq] = p
        if p.left() != UNKNOWN:  # sorted by (length, -age): bisect finds the longest, oldest first
            bisect.insort(self._fits, (p.left(), -self._seq))

    def _remove(self, seq: int) -> _Piece:
        p = self._pool.pop(seq)
        if p.left() != UNKNOWN:
            del self._fits[bisect.bisect_left(self._fits, (p.left(), -seq))]
        return p

    def _take(self, p: _Piece, row: array, n: int) -> None:
        """Move up to n of p's tokens to the row; the rest of p is due `interleave` rows on (one
        piece per row is cut, so continuations never fall due together)."""
        while n > 0 and p.pos < len(p.tokens):
            k = min(n, len(p.tokens) - p.pos)
            row.extend(p.tokens[p.pos:p.pos + k])
            p.pos += k
            n -= k
            if p.pos == len(p.tokens) and p.next is not None:  # on to the document's next chunk
                text = p.text or self._doc_text(p.doc)  # held from now to the last chunk
                p.tokens, end = self._chunk(text, p.next)
                p.chunk, p.pos, p.next = p.next, 0, end if end < len(text) else None
                p.text = text if p.next is not None else None
        if p.pos < len(p.tokens):
            p.due = self._row + self.interleave
            self._open.append(p)

    def next_row(self) -> tuple[array, int]:
        """The next packed row (seq_len + 1 token ids, -1 for padding) and its epoch."""
        size, row = self.seq_len + 1, array("i")
        self._refill()
        if not self._pool and not self._open:  # this epoch's documents are all trained
            self.epoch = self._next_epoch()
            self._refill()
        epoch = self.epoch
        if self._open and (self._open[0].due <= self._row or not self._pool):
            p = self._open.popleft()
            row.append(self.bos)  # a continuation: BOS, then the document's next tokens
            self._counts["inserted"] += 1
        else:
            p = self._remove(next(iter(self._pool)))  # the oldest document
        self._take(p, row, size - len(row))
        while len(row) < size:
            self._refill()
            space = size - len(row)
            i = bisect.bisect_right(self._fits, (space, 0)) - 1
            # best fit: the longest document that fits whole; if none fits, cut the oldest (its
            # remainder opens a later row)
            seq = -self._fits[i][1] if i >= 0 else next(iter(self._pool), None)
            if seq is not None:
                self._take(self._remove(seq), row, space)
            else:  # the epoch is drained but for continuations, which open rows only: pad
                row.extend([-1] * space)
                self._counts["padding"] += space
        self._counts["rows"] += 1
        self._row += 1
        return row, epoch

    def _make_batch(self) -> tuple[tuple[torch.Tensor, torch.Tensor], dict, list, dict]:
        """The next batch on the CPU as (inputs, targets), each (batch_size, seq_len) and
        contiguous, the loader state right after it, each row's epoch, and what it adds to stats."""
        before, flat, epochs = dict(self._counts), array("i"), []
        for _ in range(self.batch_size):
            row, epoch = self.next_row()
            flat.extend(row)
            epochs.append(epoch)
        rows = torch.frombuffer(flat, dtype=torch.int32).view(self.batch_size, -1)
        # contiguous: a padded batch in another layout would compile the model again
        x, y = (rows[:, s].to(torch.long, memory_format=torch.contiguous_format)
                for s in (slice(None, -1), slice(1, None)))
        if self._counts["padding"] > before["padding"]:
            x.masked_fill_(x < 0, self.bos)
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        added = {k: v - before[k] for k, v in self._counts.items()}
        return (x, y), self._state_now(), epochs, added

    def _produce(self) -> None:
        # Background thread: tiktoken releases the GIL, so tokenizing overlaps the training step.
        while not self._stop.is_set():
            try:
                item = self._make_batch()
            except BaseException as e:  # next_batch re-raises it where the batch was wanted
                item = e
            while not self._stop.is_set():
                with contextlib.suppress(queue.Full):
                    self._queue.put(item, timeout=0.1)
                    break
            if isinstance(item, BaseException):
                return

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefetch and self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="DataLoader", daemon=True)
            self._thread.start()
        item = self._queue.get() if self.prefetch else self._make_batch()
        if isinstance(item, BaseException):  # what went wrong in the prefetch thread, raised here
            raise item
        (x, y), self._consumed, self.batch_epochs, added = item
        for k, v in added.items():
            self.stats[k] += v
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def packing(self) -> str:
        """One line on the rows so far: inserted BOS and padding as fractions of row tokens."""
        total = max(1, self.stats["rows"] * (self.seq_len + 1))
        line = (f"{self.stats['rows']:,} rows of {self.seq_len + 1} tokens: "
                f"{self.stats['inserted'] / total:.3%} inserted BOS, "
                f"{self.stats['padding'] / total:.3%} padding")
        if self.stats["skipped_docs"]:
            line += f", {self.stats['skipped_docs']:,} documents without text skipped"
        return line

    def close(self) -> None:
        """Stop the prefetch thread (before exiting: no thread tokenizes at shutdown)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _reset(self, stream: tuple, backlog: list, buffer: list, open_: list) -> None:
        self._stream = tuple(stream)
        self._backlog = deque(tuple(r) for r in backlog)
        self._pending = deque()  # (came from the backlog, piece): tokenized, not yet in the buffer
        self._pool, self._fits, self._seq = {}, [], 0  # fresh documents, oldest first
        self._open = deque(open_)  # continuations, by the row they open (due)
        self._row, self._empty_run = 0, 0  # rows made (due counts in them), textless docs in a row
        for p in buffer:
            self._add(p)
        self.epoch = min([p.epoch for p in [*buffer, *self._open]]
                         + [r[0] for r in [*self._backlog, self._stream]])
        self._consumed = self._state_now()

    def _identity(self) -> dict:
        # not batch_size or interleave: the state counts rows, so a resumed run may change them
        return {k: getattr(self, k) for k in ("rank", "world_size", *SHARED)}

    def _state_now(self) -> dict:
        backlog = [p.ref() for from_backlog, p in self._pending if from_backlog]
        stream = next((p.ref()[:2] for from_backlog, p in self._pending if not from_backlog),
                      self._stream)
        return dict(self._identity(), epoch=stream[0], doc=stream[1],
                    backlog=[list(r) for r in [*backlog, *self._backlog]],
                    buffer=[list(p.ref()) for p in self._pool.values()],
                    open=[[*p.ref(), max(0, p.due - self._row)] for p in self._open])

    def _bad_positions(self, state: dict) -> list[str]:
        """What in a state cannot be a position of this loader: refs are [epoch, doc] or [epoch,
        doc, chunk, token], open ones with the rows they wait; every number an int >= 0, every doc
        one of ours."""
        refs = [("the stream position", [state.get("epoch"), state.get("doc")], (2,))]
        for key, sizes in (("backlog", (2, 4)), ("buffer", (2, 4)), ("open", (5,))):
            if not isinstance(state.get(key), list):
                return [f"{key} is {state.get(key)!r}, not a list"]
            refs += [(f"{key} entry", ref, sizes) for ref in state[key]]
        return [f"{where} {ref!r}" for where, ref, sizes in refs
                if not (isinstance(ref, list | tuple) and len(ref) in sizes
                        and all(type(v) is int and v >= 0 for v in ref) and ref[1] < self.num_docs)]

    def state_dict(self) -> dict:
        """Small and exact, as of the last batch next_batch returned (not those prefetched): where
        reading continues (epoch, doc), documents queued before that (backlog, after a reshard),
        the buffered documents, and the pending continuations with the rows each still waits."""
        return self._consumed

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load_state_dict must come before the first next_batch of a "
                               "prefetching loader")
        if "open" not in state:
            raise ValueError("this data loader state is from a nanomuon older than the loader that "
                             "trains every token once; it cannot be continued exactly: "
                             "start the run afresh")
        diffs = [f"{k}: saved {shown(state.get(k), 80)}, now {v!r}"
                 for k, v in self._identity().items() if state.get(k) != v]
        if diffs:
            raise ValueError("data loader state does not match this loader (" + "; ".join(diffs)
                             + "); resume with the same data and sequence length "
                             "(reshard_states() changes the process count)")
        if bad := self._bad_positions(state):
            raise ValueError(f"data loader state of rank {self.rank} is out of range "
                             f"({'; '.join(bad[:3])}) for {self.num_docs} documents: it was edited "
                             "or belongs to other data; restore it, or resume from an earlier step")
        text = lambda ref: self._doc_text(ref[1]) or ""
        # an open piece's due: rows from now, as a fresh loader's row count is 0
        self._reset((state["epoch"], state["doc"]), state["backlog"],
                    [self._piece(r[0], r[1], text(r), *r[2:4]) for r in state["buffer"]],
                    [self._piece(r[0], r[1], text(r), *r[2:5]) for r in state["open"]])


def val_rows(tokenizer, dataset: str, seq_len: int, num_tokens: int) -> torch.Tensor:
    """The val split's documents in order, packed with a one-document buffer into num_tokens //
    seq_len rows (at least 1, fewer when the split runs out; -1: all of it) of seq_len + 1 int64,
    -1 for padding. One stream at any world size, so val bpb measures the same tokens."""
    loader = DataLoader(tokenizer, dataset, "val", 1, seq_len, buffer_size=1)
    rows = array("i")
    for _ in itertools.count() if num_tokens == -1 else range(max(1, num_tokens // seq_len)):
        row, epoch = loader.next_row()
        if epoch:
            break
        rows.extend(row)
    return torch.frombuffer(rows, dtype=torch.int32).view(-1, seq_len + 1).to(torch.long)


def scored_tokens(rows: torch.Tensor) -> int:
    """The targets in val_rows' rows that an eval scores: every one but the padding."""
    return int((rows[:, 1:] >= 0).sum())


def reshard_states(states: list[dict], rank: int, world_size: int) -> dict:
    """The loader state for `rank` of `world_size` new processes, from the states of all N old
    ranks. Old rank r has read its documents r, r + N, ... up to (not including) its position P_r;
    documents at or after the frontier F = max P_r are unread by every rank. The carry is what was
    read but not yet trained (every backlog, buffered document and continuation) plus what lies
    below F but was not reached (from P_r up to F on each old rank). The new ranks share the carry
    round-robin as their backlog, read before anything else, and read on from F with the new stride:
    new rank j reads F + j, F + j + M, ... So no token is skipped or trained twice in any epoch."""
    old_n = len(states)
    if (sorted(s.get("rank") for s in states) != list(range(old_n))
            or any(s["world_size"] != old_n for s in states)):
        sizes = sorted({s["world_size"] for s in states})
        raise ValueError("resharding needs the states of all ranks of one run, got ranks "
                         + shown(f"{[s.get('rank') for s in states]} of world sizes {sizes}",
                                 200, quote=False))
    for key in SHARED:
        if len({repr(s.get(key)) for s in states}) != 1:
            raise ValueError(f"the saved loader states disagree on {key}: "
                             + shown([s.get(key) for s in states], 200))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    num_docs = states[0]["num_docs"]
    if num_docs < world_size:
        raise ValueError(f"{num_docs} documents cannot be shared by {world_size} ranks")
    states = sorted(states, key=lambda s: s["rank"])
    frontier = max((s["epoch"], s["doc"]) for s in states)
    carry = [tuple(ref[:4])
             for s in states for key in ("backlog", "buffer", "open") for ref in s[key]]
    for r, s in enumerate(states):
        epoch, doc = s["epoch"], s["doc"]
        while (epoch, doc) < frontier:
            carry.append((epoch, doc))
            doc += old_n
            if doc >= num_docs:
                epoch, doc = epoch + 1, r
    carry.sort()  # by epoch, then document: the backlog is read in order, and rows never mix epochs
    epoch, doc = frontier[0], frontier[1] + rank
    if doc >= num_docs:  # past the frontier's epoch: start the next one at our own stride
        epoch, doc = epoch + 1, rank
    return dict({key: states[0].get(key) for key in SHARED}, rank=rank, world_size=world_size,
                epoch=epoch, doc=doc, backlog=[list(ref) for ref in carry[rank::world_size]],
                buffer=[], open=[])
