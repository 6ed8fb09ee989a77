"""
The training data loader: documents in, (inputs, targets) token batches out, with exact resume.

Why its own design rather than a torch DataLoader:
- Distributed: global document k belongs to rank k % world_size, so ranks read disjoint documents
  whatever the shard and row-group sizes are.
- Tokenizes on the fly (tiktoken, threaded), so changing the tokenizer needs no preprocessing pass.
- Packs without padding or waste. Every row starts with a fresh document (BOS first). The oldest
  buffered document opens each row, the rest of the row is filled best-fit: the longest buffered piece
  that fits. When nothing fits, the oldest piece is cut to fill the row exactly and its remainder stays
  buffered for a later row, so no token is dropped (nanochat's packer crops and drops it).
- Prefetch: with prefetch=K a background thread packs up to K batches ahead (tiktoken releases the
  GIL), so tokenizing overlaps the training step; state_dict() still describes the last batch returned.
- Exact resume: state_dict() names the buffered pieces by (epoch, document, offset) instead of storing
  their tokens, and the next document to read. load_state_dict() re-reads and re-tokenizes them, so a
  resumed run sees exactly the batches the uninterrupted run would have seen.
- Resume at another process count: reshard_states() turns the N saved states into one for each of M new
  ranks. Every document is still read exactly once per epoch; the batches differ from an uninterrupted
  run (other ranks pack other rows), so the run is the same run, not the same bits.
"""

import bisect
import queue
import threading
from collections import deque

import pyarrow.parquet as pq
import torch

from nanomuon.dataset import list_shards, open_shard


class DataLoader:
    """Yields (inputs, targets), each (batch_size, seq_len) int64, forever (epochs wrap around).

    Each row is seq_len + 1 packed tokens: inputs are the first seq_len, targets the last seq_len.
    """

    def __init__(self, tokenizer, dataset: str, split: str, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1, device="cpu", buffer_size: int = 1000, tokenize_batch: int = 128,
                 prefetch: int = 0):
        if batch_size < 1 or seq_len < 1 or buffer_size < 1 or tokenize_batch < 1 or prefetch < 0:
            raise ValueError(f"DataLoader needs batch_size, seq_len, buffer_size, tokenize_batch >= 1 and prefetch "
                             f">= 0, got {batch_size}, {seq_len}, {buffer_size}, {tokenize_batch}, {prefetch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.tokenizer = tokenizer
        self.dataset, self.split = dataset, split
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.buffer_size, self.tokenize_batch = buffer_size, tokenize_batch
        # prefetch > 0: a thread packs up to that many batches ahead of the training loop
        self.prefetch = prefetch
        self._queue, self._stop, self._thread = queue.Queue(maxsize=max(prefetch, 1)), threading.Event(), None
        self.files = list_shards(dataset, split)
        # Row-group index from the parquet footers: (file, row group, first global doc, rows).
        self.row_groups, self.starts, total = [], [], 0
        for fi, path in enumerate(self.files):
            meta = open_shard(dataset, path).metadata  # a shard without a text column fails here, not mid-run
            for rg in range(meta.num_row_groups):
                n = meta.row_group(rg).num_rows
                if n:
                    self.row_groups.append((fi, rg, total, n))
                    self.starts.append(total)
                    total += n
        self.num_docs = total
        if self.num_docs < world_size:
            raise ValueError(f"the {dataset} {split} split has {self.num_docs} documents, fewer than the "
                             f"{world_size} ranks; use fewer processes or more data")
        self._cached = (None, None)  # (row group index, its texts): sequential reads hit one group at a time
        self._reset(epoch=0, doc=rank, buffer=[])

    # -- reading --------------------------------------------------------------------------------
    def _texts(self, rgi: int) -> list[str]:
        if self._cached[0] != rgi:
            fi, rg, _, _ = self.row_groups[rgi]
            table = pq.ParquetFile(self.files[fi]).read_row_group(rg, columns=["text"])
            self._cached = (rgi, table.column("text").to_pylist())
        return self._cached[1]

    def _doc_text(self, doc: int) -> str:
        rgi = bisect.bisect_right(self.starts, doc) - 1
        return self._texts(rgi)[doc - self.starts[rgi]]

    def _advance(self, epoch: int, doc: int) -> tuple[int, int]:
        doc += self.world_size
        return (epoch + 1, self.rank) if doc >= self.num_docs else (epoch, doc)

    def _read_ahead(self) -> None:
        """Tokenize the next tokenize_batch documents of this rank into the pending queue."""
        keys, texts = [], []
        epoch, doc = self._read_pos
        for _ in range(self.tokenize_batch):
            keys.append((epoch, doc))
            texts.append(self._doc_text(doc))
            epoch, doc = self._advance(epoch, doc)
        self._read_pos = (epoch, doc)
        for key, tokens in zip(keys, self.tokenizer.encode(texts, prepend_bos=True)):
            self._pending.append((key, tokens))

    def _take_fresh(self) -> None:
        if not self._pending:
            self._read_ahead()
        (epoch, doc), tokens = self._pending.popleft()
        self._buffer.append([epoch, doc, 0, tokens])

    # -- packing --------------------------------------------------------------------------------
    def _next_row(self) -> list[int]:
        while len(self._buffer) < self.buffer_size:
            self._take_fresh()
        oldest_fresh = next((i for i, e in enumerate(self._buffer) if e[2] == 0), None)
        if oldest_fresh is None:  # the buffer is all remainders: a row must still open with a document
            self._take_fresh()
            oldest_fresh = len(self._buffer) - 1
        row, space = [], self.seq_len + 1
        pick = oldest_fresh
        while space > 0:
            if not self._buffer:  # only with a tiny buffer_size
                self._take_fresh()
            entry = self._buffer[pick]
            piece = entry[3][entry[2]:entry[2] + space]
            row.extend(piece)
            space -= len(piece)
            entry[2] += len(piece)
            if entry[2] == len(entry[3]):
                del self._buffer[pick]
            if space == 0:
                break
            # best fit: the longest piece that fits whole; when none does, cut the oldest piece
            best, best_len = 0, -1
            for i, e in enumerate(self._buffer):
                n = len(e[3]) - e[2]
                if best_len < n <= space:
                    best, best_len = i, n
            pick = best
        return row

    def _make_batch(self) -> tuple[torch.Tensor, dict]:
        """The next (batch_size, seq_len + 1) rows on the CPU, and the loader state right after them."""
        rows = torch.tensor([self._next_row() for _ in range(self.batch_size)], dtype=torch.long)
        if self.device.type == "cuda":
            rows = rows.pin_memory()
        return rows, self._state_now()

    def _produce(self) -> None:
        # The background thread: tiktoken releases the GIL, so tokenizing overlaps the training step.
        while not self._stop.is_set():
            try:
                item = self._make_batch()
            except BaseException as e:  # handed to the consumer, which re-raises it where the batch was wanted
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if isinstance(item, BaseException):
                return

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.prefetch:
            rows, self._consumed = self._make_batch()
        else:
            if self._thread is None:
                self._thread = threading.Thread(target=self._produce, name="DataLoader", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            rows, self._consumed = item
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def close(self) -> None:
        """Stop the prefetch thread (call before exiting, so no thread is mid-tokenization at shutdown)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __iter__(self):
        while True:
            yield self.next_batch()

    # -- exact resume ---------------------------------------------------------------------------
    def _reset(self, epoch: int, doc: int, buffer: list) -> None:
        self._buffer = buffer
        self._pending = deque()
        self._read_pos = (epoch, doc)
        self._consumed = self._state_now()

    def _identity(self) -> dict:
        # batch_size is not part of it: the state counts rows, so a resumed run may change its batch size
        return dict(dataset=self.dataset, split=self.split, rank=self.rank, world_size=self.world_size,
                    seq_len=self.seq_len, buffer_size=self.buffer_size, num_docs=self.num_docs)

    def _state_now(self) -> dict:
        epoch, doc = self._pending[0][0] if self._pending else self._read_pos
        return dict(self._identity(), epoch=epoch, doc=doc, buffer=[tuple(e[:3]) for e in self._buffer])

    def state_dict(self) -> dict:
        """Small and exact: where reading continues, and which (epoch, doc, offset) pieces are buffered,
        as of the last batch returned by next_batch (batches prefetched beyond it are not counted)."""
        return self._consumed

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load_state_dict must come before the first next_batch of a prefetching loader")
        mine = self._identity()
        diffs = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diffs:
            raise ValueError("data loader state does not match this loader (" + "; ".join(diffs) + "); resume "
                             "with the same data and sequence length (reshard_states() changes the process count)")
        buffer = []
        for epoch, doc, offset in state["buffer"]:
            tokens = self.tokenizer.encode(self._doc_text(doc), prepend_bos=True)
            if not 0 <= offset < len(tokens):
                raise ValueError(f"data loader state names offset {offset} in document {doc}, which has "
                                 f"{len(tokens)} tokens: the data or the tokenizer changed since it was saved")
            buffer.append([epoch, doc, offset, tokens])
        self._reset(state["epoch"], state["doc"], buffer)


def val_rows(tokenizer, dataset: str, seq_len: int, num_tokens: int) -> torch.Tensor:
    """The validation set: the first num_tokens // seq_len (at least 1) packed rows of the val split,
    (rows, seq_len + 1) int64 on the CPU. One stream, whatever the process count, so val bpb measures the
    same tokens at any world size (evaluate_bpb deals the rows out to the ranks)."""
    num_rows = max(1, num_tokens // seq_len)
    rows, _ = DataLoader(tokenizer, dataset, "val", num_rows, seq_len)._make_batch()
    return rows


def reshard_states(states: list[dict], rank: int, world_size: int) -> dict:
    """The loader state for `rank` of `world_size` new processes, from the states of all N old ranks.

    Old rank r has read its documents r, r + N, ... up to (not including) its position P_r; documents at
    or after the frontier F = max P_r are unread by every rank. The carry is what was read but not yet
    packed (all buffered pieces) plus what lies below F but was not reached (from P_r up to F on each old
    rank). The new ranks share the carry round-robin, as buffered pieces, and read on from F with the new
    stride: new rank j reads F + j, F + j + M, ... So nothing is skipped or read twice in any epoch.
    """
    old_n = len(states)
    if sorted(s.get("rank") for s in states) != list(range(old_n)) or any(s["world_size"] != old_n for s in states):
        sizes = sorted({s["world_size"] for s in states})
        raise ValueError(f"resharding needs the states of all ranks of one run, got ranks "
                         f"{[s.get('rank') for s in states]} of world sizes {sizes}")
    shared = ("dataset", "split", "seq_len", "buffer_size", "num_docs")
    for key in shared:
        if len({repr(s[key]) for s in states}) != 1:
            raise ValueError(f"the saved loader states disagree on {key}: {[s[key] for s in states]}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    num_docs = states[0]["num_docs"]
    if num_docs < world_size:
        raise ValueError(f"{num_docs} documents cannot be shared by {world_size} ranks")
    states = sorted(states, key=lambda s: s["rank"])
    frontier = max((s["epoch"], s["doc"]) for s in states)
    carry = [tuple(piece) for s in states for piece in s["buffer"]]
    for r, s in enumerate(states):
        epoch, doc = s["epoch"], s["doc"]
        while (epoch, doc) < frontier:
            carry.append((epoch, doc, 0))
            doc += old_n
            if doc >= num_docs:
                epoch, doc = epoch + 1, r
    carry.sort()  # oldest first: the packer opens rows with the oldest buffered document
    epoch, doc = frontier[0], frontier[1] + rank
    if doc >= num_docs:  # past the end of the frontier's epoch: start the next one at our own stride
        epoch, doc = epoch + 1, rank
    state = {key: states[0][key] for key in shared}
    return dict(state, rank=rank, world_size=world_size, epoch=epoch, doc=doc,
                buffer=[list(piece) for piece in carry[rank::world_size]])
