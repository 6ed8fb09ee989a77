"""
How long the data loader holds up a training step, with and without its prefetch thread.

    python -m scripts.bench_loader --dataset embedded --device-batch-size 32 --max-seq-len 2048

A sleep stands in for the device step (the main thread waits on the GPU without holding the GIL);
what is timed is next_batch(), the part of the step the loader adds. Prints medians, means and the
ratio, measured in one run. Needs a trained tokenizer (scripts.tok_train).
"""

import argparse
import statistics
import time

from nanomuon.dataloader import DataLoader
from nanomuon.dataset import DATASETS
from nanomuon.tokenizer import get_tokenizer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--dataset", choices=DATASETS, default="embedded")
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--step-ms", type=float, default=100.0, help="simulated device time per micro-batch")
    p.add_argument("--batches", type=int, default=40)
    args = p.parse_args(argv)
    try:
        tok = get_tokenizer()
        loaders = {pf: DataLoader(tok, args.dataset, "train", args.device_batch_size, args.max_seq_len, prefetch=pf)
                   for pf in (0, 2)}
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    tokens = args.device_batch_size * args.max_seq_len
    print(f"{args.dataset}, batches of {args.device_batch_size} x {args.max_seq_len} = {tokens:,} tokens, "
          f"{args.step_ms:.0f} ms simulated step, {args.batches} batches")
    means = {}
    for pf, dl in loaders.items():
        dl.next_batch()  # opens the first shard, starts the thread
        waits = []
        for _ in range(args.batches):
            time.sleep(args.step_ms / 1000)
            t0 = time.perf_counter()
            dl.next_batch()
            waits.append(time.perf_counter() - t0)
        dl.close()
        means[pf] = statistics.mean(waits)
        print(f"  prefetch={pf}: next_batch blocks median {1000 * statistics.median(waits):7.1f} ms, "
              f"mean {1000 * means[pf]:7.1f} ms, max {1000 * max(waits):6.0f} ms")
    print(f"mean time the loader adds per batch, prefetch 2 / none: {means[2] / means[0]:.3f}; without prefetch the "
          f"loader alone sustains {tokens / means[0]:,.0f} tok/s per process")


if __name__ == "__main__":
    main()
