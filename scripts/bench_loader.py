"""
What the data loader trains on, how fast, in how much memory, and how long it holds up a step.

    python -m scripts.bench_loader --dataset embedded --device-batch-size 32 --max-seq-len 2048

Per epoch of one rank's documents: coverage of the documents tokenized independently (as unigram
counts), inserted BOS and padding, tok/s and peak RSS (docs/data.md, "The data loader"). Then how
long next_batch() blocks a simulated step (a sleep: the device step waits without holding the GIL)
with and without the prefetch thread. Needs a trained tokenizer (scripts.tok_train).
"""

import argparse
import resource
import statistics
import sys
import time

import torch

from nanomuon.common import user_errors
from nanomuon.dataloader import DataLoader
from nanomuon.dataset import iter_texts
from nanomuon.sources import add_data_args, prepare
from nanomuon.tokenizer import get_tokenizer
from scripts.bench_memory import status


def unigrams(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Count per token id, padding (negative ids) left out."""
    return torch.bincount(tokens[tokens >= 0], minlength=vocab_size)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    add_data_args(p, "embedded")
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--world-size", type=int, default=1, help="measure rank --rank of this many processes")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2,
                   help="epochs to check coverage and memory over (0: skip)")
    p.add_argument("--step-ms", type=float, default=100.0, help="simulated device time per micro-batch")
    p.add_argument("--batches", type=int, default=40, help="batches timed with and without prefetch")
    args = p.parse_args(argv)
    if min(args.device_batch_size, args.max_seq_len, args.world_size, args.batches) < 1 or args.epochs < 0:
        p.error("--device-batch-size, --max-seq-len, --world-size and --batches must be >= 1, --epochs >= 0")
    with user_errors():
        tok = get_tokenizer()
        data = prepare(args.dataset, args.text_column, args.val_fraction)
        make = lambda prefetch=0: DataLoader(tok, data, "train", args.device_batch_size,
                                             args.max_seq_len, args.rank, args.world_size,
                                             prefetch=prefetch)
        dl = make()
    B, T = args.device_batch_size, args.max_seq_len
    print(f"{args.dataset} train, rank {args.rank} of {args.world_size}: batches of {B} rows x "
          f"{T + 1} tokens, buffer {dl.buffer_size} documents; torch {torch.__version__}, "
          f"{args.epochs} epochs")
    # rows of the next epoch that came in the last batch of the previous one
    leftover = torch.zeros(0, dtype=torch.long)
    for epoch in range(args.epochs):
        trained = unigrams(leftover, tok.vocab_size)
        stats0, seconds, rows = dict(dl.stats), 0.0, 0
        while True:
            t0 = time.perf_counter()
            x, y = dl.next_batch()
            seconds += time.perf_counter() - t0
            full = torch.cat([x[:, :1], y], dim=1)  # the row as packed: input BOS, then the targets
            mine = torch.tensor([e == epoch for e in dl.batch_epochs])
            trained += unigrams(full[mine], tok.vocab_size)
            rows += int(mine.sum())
            if not mine.all():
                leftover = full[~mine]
                break
        counts = {k: dl.stats[k] - stats0[k] for k in stats0}
        slots = counts["rows"] * (T + 1)
        # peak RSS in MB: VmHWM on Linux (exec keeps the parent's peak in ru_maxrss); bytes on macOS
        rss = (status("VmHWM") if sys.platform == "linux"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / (1 << 20)
        # the independent reference: every document of this rank, tokenized whole
        ref = sum(unigrams(torch.tensor(tok.encode(text, prepend_bos=True)), tok.vocab_size)
                  for text in iter_texts(data, "train", rank=args.rank, world_size=args.world_size)
                  if text)  # the loader skips empty documents too
        inserted = trained[tok.bos_id] - ref[tok.bos_id]
        trained[tok.bos_id] -= inserted
        total = ref.sum().item()
        covered = torch.minimum(trained, ref).sum().item() / total
        repeated = (trained - ref).clamp(min=0).sum().item() / total
        tv = 0.5 * (trained / trained.sum() - ref / ref.sum()).abs().sum().item()
        print(f"epoch {epoch}: coverage {covered:.4%} of the rank's {total:,} tokens, "
              f"{repeated:.4%} trained more than once, unigram total variation {tv:.5f} | {rows:,} "
              f"rows: inserted BOS {inserted / slots:.3%}, padding {counts['padding'] / slots:.3%} "
              f"| {rows * (T + 1) / seconds:,.0f} tok/s | peak RSS {rss:,.0f} MB")
    means = {}
    for pf in (0, 2):
        dl = make(prefetch=pf)
        dl.next_batch()  # fills the buffer, starts the thread
        waits = []
        for _ in range(args.batches):
            time.sleep(args.step_ms / 1000)
            t0 = time.perf_counter()
            dl.next_batch()
            waits.append(time.perf_counter() - t0)
        dl.close()
        means[pf] = statistics.mean(waits)
        print(f"  {args.step_ms:.0f} ms simulated step, prefetch={pf}: next_batch blocks median "
              f"{1000 * statistics.median(waits):7.1f} ms, mean {1000 * means[pf]:7.1f} ms, max "
              f"{1000 * max(waits):6.0f} ms")
    print(f"mean time the loader adds per batch, prefetch 2 / none: {means[2] / means[0]:.3f}")


if __name__ == "__main__":
    main()
