"""
Bad input across the CLI and the library, in one table. Each case must stop at the earliest point with
a one-line message, no traceback, that names the problem and the fix (checked by a phrase of each), and
must leave no file behind: the base dir holds the same files before and after.
"""

import base64
import io
import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_dataset import fetch
from test_train import REPO, TINY

from nanomuon.dataloader import DataLoader
from nanomuon.dataset import HF_REPO, MAX_SHARD, shard_name
from nanomuon.dataset import main as dataset_main
from nanomuon.gpt import GPTConfig
from nanomuon.optim import MuonAdamW
from nanomuon.run import lock_run_dir
from nanomuon.tokenizer import Tokenizer, get_tokenizer, tokenizer_dir

GOOD = [*TINY, "--total-batch-size", "256", "--num-iterations", "2", "--eval-every", "-1"]


def train(*extra, run="bad"):
    from scripts.base_train import main

    return lambda: main([*GOOD, "--run", run, *extra])


def script(module, *argv):
    def call():
        mod = __import__(f"scripts.{module}", fromlist=["main"])
        return mod.main(list(argv))

    return call


@pytest.fixture(scope="module")
def good(base):
    """A finished 2-step run with checkpoints at steps 1 and 2, copied by the cases that damage one."""
    from scripts.base_train import main

    main([*GOOD, "--run", "good", "--save-every", "1"])
    return base / "runs" / "good"


def damaged(base, good, name, damage):
    run = base / "runs" / name
    if not run.exists():
        shutil.copytree(good, run)
        damage(run / "step_000002")
    return name


def resume_nanochat(base, *flags):
    """Resume a 2-step run trained with --arch nanochat (trained once) with these flags."""
    from scripts.base_train import main

    if not (base / "runs" / "nanochat" / "step_000002").exists():
        main([*GOOD, "--run", "nanochat", "--arch", "nanochat"])
    return train(*flags, "--resume-from-step", "2", run="nanochat")


def other_tokenizer(base, tmp_path, monkeypatch):
    """A base dir that shares the data and runs but has a different tokenizer."""
    for sub in ("data", "runs"):
        (tmp_path / sub).symlink_to(base / sub)
    Tokenizer.train(iter(["a different corpus entirely"] * 50), vocab_size=300).save(tmp_path / "tokenizer")
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path))


def no_text_shard(base):
    d = base / "data" / "fineweb-edu"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        pq.write_table(pa.table({"content": ["x"]}), d / f"shard_{i:05d}.parquet")


def own_fineweb(base, tmp_path, monkeypatch, train_shard, val_shard=None):
    """A base dir of its own whose fineweb-edu split holds the given shards (a pyarrow table, or raw bytes
    for a file that is not parquet), with the shared tokenizer; returns base_train on it."""
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path))
    (tmp_path / "tokenizer").symlink_to(base / "tokenizer")
    d = tmp_path / "data" / "fineweb-edu"
    d.mkdir(parents=True)
    good = pa.table({"text": ["some text here", "and more text"] * 4})
    for i, shard in enumerate([train_shard, good if val_shard is None else val_shard]):
        path = d / f"shard_{i:05d}.parquet"
        path.write_bytes(shard) if isinstance(shard, bytes) else pq.write_table(shard, path)
    return train("--dataset", "fineweb-edu")


def corrupt_row_group(texts=tuple(f"document {i} " * 20 for i in range(400))) -> bytes:
    """A parquet shard whose footer is fine but whose row group 2's pages are overwritten."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": list(texts)}), buf, row_group_size=100, compression="zstd")
    data = bytearray(buf.getvalue())
    chunk = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(2).column(0)
    start = chunk.data_page_offset + 20
    data[start:chunk.data_page_offset + chunk.total_compressed_size - 10] = b"U" * (
        chunk.total_compressed_size - 30)
    return bytes(data)


def source(tmp_path, *flags):
    """base_train on a small jsonl file of {id, text} documents, with more flags."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": f"document {i}"}) + "\n" for i in range(20)))
    return train("--dataset", str(path), *flags)


def empty_files(tmp_path, *names):
    """base_train on a folder of files that hold nothing: 0 bytes, or a parquet file of 0 rows."""
    (tmp_path / "empty").mkdir()
    for name in names:
        path = tmp_path / "empty" / name
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
        else:
            path.write_bytes(b"")
    return train("--dataset", str(tmp_path / "empty"))


def corrupt_tokenizer(tmp_path):
    get_tokenizer().save(tmp_path / "t")
    (tmp_path / "t" / "tokenizer.bpe").write_text("garbage\n")
    return lambda: Tokenizer.load(tmp_path / "t")


def edit_meta(edit):
    """A damage() that hand-edits meta.json the way a user might."""
    def damage(d):
        meta = json.loads((d / "meta.json").read_text())
        edit(meta)
        (d / "meta.json").write_text(json.dumps(meta))
    return damage


def resume_edited(base, good, name, edit):
    return train("--resume-from-step", "2", run=damaged(base, good, name, edit_meta(edit)))


def tokenizer_without_byte(tmp_path):
    """A tokenizer whose byte 0x00 has no token (ranks renumbered, so nothing else is wrong with it)."""
    tok = get_tokenizer()
    ranks = sorted((r, t) for t, r in tok.mergeable_ranks.items() if t != b"\x00")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.bpe").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                                          for i, (_, t) in enumerate(ranks)))
    shutil.copy(tokenizer_dir() / "tokenizer.json", tmp_path / "t")
    return lambda: Tokenizer.load(tmp_path / "t")


def own_base(base, tmp_path, monkeypatch):
    """A base dir of its own that shares the tokenizer and the data."""
    for sub in ("tokenizer", "data"):
        (tmp_path / sub).symlink_to(base / sub)
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path))


def locked_run(base, tmp_path, monkeypatch):
    own_base(base, tmp_path, monkeypatch)
    lock_run_dir(tmp_path / "runs" / "busy")  # held by this process until it exits, as another run would
    return train(run="busy")


def run_dir_is_a_file(base, tmp_path, monkeypatch):
    own_base(base, tmp_path, monkeypatch)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "taken").write_text("not a directory")
    return train(run="taken")


def speedrun(tmp_path, mode):
    """speedrun.sh with MODE=mode and its own base dir; a failure becomes a SystemExit of its
    stderr, and nothing may have started before it (no output)."""
    def call():
        env = dict(os.environ, MODE=mode, NANOMUON_BASE_DIR=str(tmp_path / "speedrun"))
        done = subprocess.run(["bash", "speedrun.sh"], env=env, capture_output=True, text=True,
                              timeout=30)
        assert done.stdout == "", f"speedrun.sh started before refusing MODE={mode}: {done.stdout}"
        if done.returncode:
            raise SystemExit(done.stderr.strip())
    return call


def torchrun_env(mp, timeout: str | None):
    """What torchrun sets for rank 0 of 2 (no peer comes), and NANOMUON_RENDEZVOUS_TIMEOUT."""
    from test_dist import _free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(_free_port())).items():
        mp.setenv(key, value)
    if timeout is not None:
        mp.setenv("NANOMUON_RENDEZVOUS_TIMEOUT", timeout)


def rendezvous_timeout(mp, timeout: str, alone: bool = False):
    """base_train with NANOMUON_RENDEZVOUS_TIMEOUT set, under torchrun's variables or alone."""
    if alone:
        mp.setenv("NANOMUON_RENDEZVOUS_TIMEOUT", timeout)
    else:
        torchrun_env(mp, timeout)
    return train("--total-batch-size", "512", run="meet")


def no_wandb_key(mp, tmp):
    """An environment in which wandb finds no API key: none in the environment, an empty netrc."""
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        mp.delenv(key, raising=False)
    (tmp / "netrc").write_text("")
    mp.setenv("NETRC", str(tmp / "netrc"))


def muon_group_without_kind():
    return MuonAdamW([dict(params=[torch.nn.Parameter(torch.ones(4, 4))], lr=0.02)])


# id: (setup(base, good, tmp_path, monkeypatch) -> the call that must fail, phrase of its message)
CASES = {
    # base_train flags
    "depth": (lambda *_: train("--depth", "0"), "--depth must be >= 1"),
    "batch-zero": (lambda *_: train("--device-batch-size", "0"), "expected a number of rows >= 1 or 'auto', got '0'"),
    "batch-multiple": (lambda *_: train("--total-batch-size", "1000"), "is not a multiple of --device-batch-size"),
    "iterations": (lambda *_: train("--num-iterations", "0"), "--num-iterations must be >= 1"),
    "schedule": (lambda *_: train("--warmup-ratio", "0.7", "--warmdown-ratio", "0.7"), "exceed 1"),
    "lr-nan": (lambda *_: train("--matrix-lr", "nan"), "--matrix-lr must be a finite number >= 0"),
    "eval-every": (lambda *_: train("--eval-every", "0"), "--eval-every must be >= 1, or -1"),
    "resume-word": (lambda *_: train("--resume-from-step", "soon"), "expected a step number, 'latest' or 'auto'"),
    "run-name": (lambda *_: train(run="../x"), "argument --run: '../x': use letters, digits"),
    "nonfinite-steps": (lambda *_: train("--max-nonfinite-steps", "0"), "--max-nonfinite-steps must be >= 1"),
    "target-flops-inf": (lambda *_: train("--num-iterations", "-1", "--target-flops", "inf"),
                         "--target-flops must be a finite number"),
    "data-ratio-nan": (lambda *_: train("--target-param-data-ratio", "nan"),
                       "--target-param-data-ratio must be a finite"),
    # a horizon no run reaches: a typo in a ratio or budget, refused before it plans 1e32 steps
    "data-ratio-huge": (lambda *_: train("--num-iterations", "-1", "--target-param-data-ratio", "1e30"),
                        "--target-param-data-ratio 1e+30 plans 5.12e+32 steps of 256 tokens, more than "
                        "the 1,000,000,000 a run may take: give at most 1.95e+06"),
    "target-flops-huge": (lambda *_: train("--num-iterations", "-1", "--target-flops", "1e40"),
                          "--target-flops 1e+40 plans 4.42e+31 steps of 256 tokens, more than the"),
    "iterations-huge": (lambda *_: train("--num-iterations", str(10 ** 12)),
                        "--num-iterations 1000000000000 is more than the 1,000,000,000 steps a run may take"),
    # the flag was given: the way out is a smaller one, not to give it
    "weight-decay-huge": (lambda *_: train("--weight-decay", "1e30"),
                          "--weight-decay 1e+30 x Muon's lr 0.02 >= 1 would flip the weights' sign at "
                          "every step: give a --weight-decay below 50"),
    "seed-huge": (lambda *_: train("--seed", str(2 ** 70)), "--seed must be in [0, 2**64)"),
    "data-seed-negative": (lambda *_: train("--data-seed", "-1"), "--data-seed must be in [0, 2**64)"),
    # so large the optimizer's step scalar overflows fp32 at the first step (a 35-line traceback)
    "lr-multiplier-huge": (lambda *_: train("--lr-multiplier", "1e308"),
                           "--lr-multiplier 1e+308 is over 1,000"),
    "matrix-lr-huge": (lambda *_: train("--matrix-lr", "1e300"),
                       "--matrix-lr 1e+300 x --lr-multiplier 1 = 1e+300 is over 1,000"),
    "lr-times-multiplier-huge": (lambda *_: train("--embedding-lr", "10", "--lr-multiplier", "200"),
                                 "--embedding-lr 10 x --lr-multiplier 200 = 2,000 is over 1,000"),
    "wandb-online-no-key": (lambda b, g, tmp, mp: (no_wandb_key(mp, tmp), train("--wandb", "online"))[1],
                            "--wandb online needs a W&B API key, and wandb finds none here"),
    "eval-wandb-online-no-key": (lambda b, g, tmp, mp: (no_wandb_key(mp, tmp),
                                                        script("base_eval", "--run", "good", "--wandb",
                                                               "online"))[1],
                                 "--wandb online needs a W&B API key, and wandb finds none here"),
    "lr-multiplier-negative": (lambda *_: train("--lr-multiplier", "-2"), "--lr-multiplier must be a finite number"),
    "abbreviation": (lambda *_: train("--num-iter", "3"), "unrecognized arguments: --num-iter"),
    "optimizer": (lambda *_: train("--optimizer", "sgd"), "invalid choice: 'sgd'"),
    "no-cuda": (lambda *_: train("--device-type", "cuda"), "torch sees no CUDA device; use --device-type cpu"),
    "qk-clip-norm": (lambda *_: train("--qk-clip", "50"), "--qk-clip has nothing to do with QK-norm on"),
    "qk-clip-value": (lambda *_: train("--no-qk-norm", "--qk-clip", "-1"), "--qk-clip must be a finite number >= 0"),
    "fsdp-alone": (lambda *_: train("--fsdp"), "--fsdp shards the model over torchrun processes; launch with torchrun"),
    "sample-tokens-negative": (lambda *_: train("--sample-tokens", "-1"),
                               "--sample-tokens must be in [0, 64] (0: none; at most"),
    "sample-tokens-huge": (lambda *_: train("--sample-tokens", str(10 ** 12)),
                           "--sample-tokens must be in [0, 64] (0: none; at most"),
    # --start-over over a finished run with a flag refused after the run dir is locked: nothing moves
    "start-over-window": (lambda b, g, *_: train("--start-over", "--arch", "classic", "--window-pattern", "SL",
                                                 run=damaged(b, g, "over-window", lambda step: None)),
                          "window_pattern='SL' needs arch='nanochat'"),
    "start-over-attention": (lambda b, g, *_: train("--start-over", "--attention", "flex",
                                                    run=damaged(b, g, "over-attention", lambda step: None)),
                             "--attention flex cannot run here"),
    "start-over-head-dim": (lambda b, g, *_: train("--start-over", "--head-dim", "7",
                                                   run=damaged(b, g, "over-head-dim", lambda step: None)),
                            "an even head_dim >= 2"),
    "depth-huge": (lambda *_: train("--depth", str(10 ** 12)), "parameters, over the memory of"),
    "head-dim-huge": (lambda *_: train("--head-dim", str(2 ** 40)),
                      "parameters, over the memory of"),
    "cpu-memory": (lambda b, g, tmp, mp: (mp.setattr("scripts.train_args.available_memory", lambda: (4 << 30, 0)),
                                          train("--depth", "40", "--device-batch-size", "1", "--dtype", "fp32"))[1],
                   "about 9.1 GiB of memory (params 2.9, grads 2.9, optimizer 2.9, activations 0.3 GiB; "
                   "activations at --device-batch-size 1, --max-seq-len 64), and this machine has 4.0 GiB free: "
                   "lower --depth, --device-batch-size or --max-seq-len"),
    "rank-not-int": (lambda b, g, tmp, mp: (mp.setenv("RANK", "abc"), train())[1],
                     "RANK='abc' is not an integer"),
    "rank-outside-world": (lambda b, g, tmp, mp: (mp.setenv("RANK", "3"),
                                                  mp.setenv("WORLD_SIZE", "1"),
                                                  mp.setenv("LOCAL_RANK", "0"), train())[3],
                           "RANK=3 is outside WORLD_SIZE=1"),
    # torchrun sets all three: a stray pair would train unlocked as rank 1, or as one of two alone
    "rank-without-local-rank": (lambda b, g, tmp, mp: (mp.setenv("RANK", "1"), mp.setenv("WORLD_SIZE", "2"),
                                                       train("--total-batch-size", "512", run="half-set-1"))[2],
                                "RANK and WORLD_SIZE are set but LOCAL_RANK is not"),
    "world-size-alone": (lambda b, g, tmp, mp: (mp.setenv("WORLD_SIZE", "2"),
                                                train("--total-batch-size", "512", run="half-set-2"))[1],
                         "WORLD_SIZE is set but RANK and LOCAL_RANK are not"),
    **{f"rendezvous-timeout-{value or 'empty'}": (
        lambda b, g, tmp, mp, value=value: rendezvous_timeout(mp, value),
        f"NANOMUON_RENDEZVOUS_TIMEOUT={value!r} is not a number of seconds in (0, 86,400]")
       for value in ("abc", "", "inf", "1e20", "nan", "-5", "0")},
    # read only under torchrun, but a bad one is a mistake to say, not to ignore
    "rendezvous-timeout-alone": (lambda b, g, tmp, mp: rendezvous_timeout(mp, "10 min", alone=True),
                                 "NANOMUON_RENDEZVOUS_TIMEOUT='10 min' is not a number of seconds"),
    "base-dir-is-a-file": (lambda b, g, tmp, mp: ((tmp / "f").write_text("x"),
                                                  mp.setenv("NANOMUON_BASE_DIR", str(tmp / "f")),
                                                  train())[2],
                           "is not a directory; point NANOMUON_BASE_DIR at a directory"),
    "speedrun-mode": (lambda b, g, tmp, mp: speedrun(tmp, "GPU"),
                      "MODE=GPU: use MODE=gpu or MODE=cpu"),
    "fsdp-torch-muon": (lambda *_: train("--fsdp", "--optimizer", "torch-muon"),
                        "--fsdp needs a nanomuon optimizer variant"),
    # base_train inputs: data, tokenizer, checkpoints
    "no-data": (lambda *_: train("--dataset", "fineweb-edu"), "run `python -m nanomuon.dataset -n 8`"),
    "shard-zero-bytes": (lambda b, g, tmp, mp: own_fineweb(b, tmp, mp, b""),
                         "shard_00000.parquet is not a readable parquet file"),
    "shard-garbage": (lambda b, g, tmp, mp: own_fineweb(b, tmp, mp, b"PAR1 this is not parquet"),
                      "shard_00000.parquet is not a readable parquet file"),
    "shard-text-ints": (lambda b, g, tmp, mp: own_fineweb(b, tmp, mp, pa.table({"text": [1, 2, 3]})),
                        "column 'text' holds int64, not strings"),
    "val-null": (lambda b, g, tmp, mp: own_fineweb(b, tmp, mp, pa.table({"text": ["a document"] * 4}),
                                                   pa.table({"text": pa.array([None, None], pa.string())})),
                 "the fineweb-edu val split has no text: all 2 documents are null"),
    "val-empty": (lambda b, g, tmp, mp: own_fineweb(b, tmp, mp, pa.table({"text": ["a document"] * 4}),
                                                    pa.table({"text": ["", ""]})),
                  "the fineweb-edu val split has no text: all 2 documents are empty"),
    "train-empty": (lambda b, g, tmp, mp: own_fineweb(b, tmp, mp, pa.table({"text": ["", "", ""]})),
                    "the fineweb-edu train split has no text: all 3 documents are empty; rebuild"),
    "train-row-group-corrupt": (lambda b, g, tmp, mp: own_fineweb(b, tmp, mp, corrupt_row_group()),
                                "shard_00000.parquet: row group 2 is unreadable, the shard is corrupt: "
                                "delete it and download or build it again ("),
    "no-tokenizer": (lambda b, g, tmp, mp: (mp.setenv("NANOMUON_BASE_DIR", str(tmp)), train())[1],
                     "python -m scripts.tok_train"),
    "no-checkpoints": (lambda *_: train("--resume-from-step", "latest", run="never"), "no checkpoints in"),
    "no-such-step": (lambda *_: train("--resume-from-step", "7", run="good"), "no checkpoint for step 7"),
    "resume-depth": (lambda *_: train("--depth", "3", "--resume-from-step", "2", run="good"),
                     "--depth was 2, now 3"),
    "resume-arch": (lambda *_: train("--arch", "nanochat", "--resume-from-step", "2", run="good"),
                    "--arch was 'classic', now 'nanochat'; --window-pattern was 'L', now 'SSSL'"),
    "resume-arch-auto": (lambda b, *_: resume_nanochat(b, "--arch", "auto"),
                         "--arch was 'nanochat', now 'classic'; --window-pattern was 'SSSL', now 'L'"),
    "resume-windows": (lambda b, *_: resume_nanochat(b, "--arch", "nanochat", "--window-pattern", "SL"),
                       "--window-pattern was 'SSSL', now 'SL'"),
    "window-pattern-long": (lambda *_: train("--arch", "nanochat", "--window-pattern", "SSSLS"),
                            "window_pattern has 5 letters for 2 layers: give at most 4"),
    "resume-horizon": (lambda *_: train("--num-iterations", "5", "--resume-from-step", "2", run="good"),
                       "pass --num-iterations 2"),
    "resume-batch": (lambda *_: train("--total-batch-size", "512", "--resume-from-step", "2", run="good"),
                     "--total-batch-size was 256, now 512"),
    "resume-optimizer": (lambda *_: train("--optimizer", "adamw", "--resume-from-step", "2", run="good"),
                         "--optimizer was 'muon', now 'adamw'"),
    "resume-eval-tokens": (lambda *_: train("--eval-tokens", "4096", "--resume-from-step", "2", run="good"),
                           "--eval-tokens was 1024, now 4096"),
    "resume-tokenizer": (lambda b, g, tmp, mp: (other_tokenizer(b, tmp, mp), train("--resume-from-step", "2",
                                                                                   run="good"))[1],
                         "trained with a different tokenizer (retrain or restore"),
    "truncated-model": (lambda b, g, *_: train("--resume-from-step", "2", run=damaged(
        b, g, "trunc", lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]))),
        "is incomplete or corrupt"),
    "corrupt-meta": (lambda b, g, *_: train("--resume-from-step", "2", run=damaged(
        b, g, "meta", lambda d: (d / "meta.json").write_text('{"step": 2,'))), "unreadable meta.json"),
    "meta-missing-key": (lambda b, g, *_: resume_edited(b, g, "nokey", lambda m: m.pop("loader")),
                         "is not a valid checkpoint meta.json (no 'loader')"),
    "meta-wrong-type": (lambda b, g, *_: resume_edited(b, g, "strstep", lambda m: m.update(step="2")),
                        "'step' is '2', not an int"),
    "meta-loop-type": (lambda b, g, *_: resume_edited(b, g, "loop", lambda m: m["loop"].update(history=7)),
                       "'loop.history' is 7, not a list of [step, train loss] pairs"),
    "meta-loop-precision": (lambda b, g, *_: resume_edited(b, g, "prec", lambda m: m["loop"].update(
        precision=[[0, "\x1b[2J", None]])), "loop.precision is [[0, '\\x1b[2J', None]] in its meta.json"),
    "meta-loader-position": (lambda b, g, *_: resume_edited(b, g, "pos", lambda m: m["loader"][0].update(doc=10**9)),
                             "data loader state of rank 0 is out of range"),
    "run-dir-locked": (lambda b, g, tmp, mp: locked_run(b, tmp, mp), "is in use by pid"),
    "run-dir-not-writable": (lambda b, g, tmp, mp: run_dir_is_a_file(b, tmp, mp), "cannot write to the run dir"),
    # the other entry points
    "tok-vocab": (lambda *_: script("tok_train", "--dataset", "embedded", "--vocab-size", "100"),
                  "vocab_size must be >= 257"),
    "tok-no-data": (lambda *_: script("tok_train", "--dataset", "fineweb-edu"), "python -m nanomuon.dataset -n 8"),
    "sample-run": (lambda *_: script("sample", "--run", "never", "--device-type", "cpu"), "no checkpoints in"),
    "sample-run-path": (lambda *_: script("sample", "--run", "../good"), "'../good': use letters, digits"),
    "eval-run-path": (lambda *_: script("base_eval", "--run", "/etc"), "'/etc': use letters, digits"),
    "tok-vocab-huge": (lambda *_: script("tok_train", "--dataset", "embedded", "--vocab-size", str(2 ** 33)),
                       "token ids are int32"),
    "ablate-abbreviation": (lambda *_: script("ablate", "--resume", "2"), "are set per run by ablate"),
    "sample-tokens": (lambda *_: script("sample", "--run", "good", "--max-tokens", "0"),
                      "--max-tokens and --num-samples must be >= 1"),
    "eval-tokens": (lambda *_: script("base_eval", "--run", "good", "--eval-tokens", "0"),
                    "--eval-tokens must be >= 1"),
    "sample-temperature-nan": (lambda *_: script("sample", "--run", "good", "--temperature", "nan"),
                               "--temperature must be a finite number >= 0, got nan"),
    "sample-temperature-inf": (lambda *_: script("sample", "--run", "good", "--temperature", "inf"),
                               "--temperature must be a finite number >= 0, got inf"),
    "sample-seed-huge": (lambda *_: script("sample", "--run", "good", "--seed", str(2 ** 70)),
                         "--seed must be in [0, 2**64)"),
    "sample-seed-last": (lambda *_: script("sample", "--run", "good", "--seed", str(2 ** 64 - 1), "--num-samples",
                                           "2"), "sample i is seeded with --seed + i"),
    "export-out-empty": (lambda *_: script("export", "--run", "good", "--out", ""), "argument --out: is empty"),
    "ablate-variant": (lambda *_: script("ablate", "--variants", "muon,nope"), "(unknown: nope)"),
    "ablate-baseline": (lambda *_: script("ablate", "--variants", "muon,adamw", "--baseline", "muon-jordan"),
                        "is not among --variants"),
    "run-name-long": (lambda *_: script("sample", "--run", "a" * 300), "a run name is at most 200"),
    "ablate-run": (lambda *_: script("ablate", "--run", "x"), "use --name, --variants, --seeds and --sweep"),
    "ablate-seed": (lambda *_: script("ablate", "--seed", "3"), "--data-seed are set per run by ablate"),
    "ablate-sweep": (lambda *_: script("ablate", "--sweep", "matrix-lr=1,1"),
                     "'matrix-lr=1,1': give a base_train flag"),
    "ablate-sweep-flag": (lambda *_: script("ablate", "--sweep", "nope=1,2"),
                          "--sweep nope=...: base_train has no --nope"),
    "ablate-sweep-value": (lambda *_: script("ablate", "--sweep", "matrix-lr=-1,2"),
                           "--matrix-lr must be a finite number"),
    "ablate-seeds": (lambda *_: script("ablate", "--seeds", "0"), "give a count of seeds from 1 to 10,000"),
    "download-revision": (lambda *_: lambda: dataset_main(["-n", "1", "--revison", "main"]),
                          "unrecognized arguments: --revison"),
    "eval-column": (lambda *_: script("base_eval", "--run", "good", "--text-column", "body"),
                    "--text-column and --val-fraction go with --dataset"),
    "source-missing": (lambda *_: train("--dataset", "/no/such/dir"), "--dataset /no/such/dir: no such file or "
                       "directory, and no glob; expected fineweb-edu, climbmix, embedded, a local file"),
    "source-hub": (lambda *_: train("--dataset", "hf:just-a-name"), "write a hub dataset as hf:owner/name"),
    "source-empty-glob": (lambda b, g, tmp, mp: train("--dataset", str(tmp / "*.jsonl")), "no .parquet, .jsonl"),
    "source-column": (lambda *_: train("--dataset", "embedded", "--text-column", "body"),
                      "--text-column and --val-fraction apply to custom sources; embedded has"),
    "source-fraction": (lambda b, g, tmp, mp: source(tmp, "--val-fraction", "1"), "--val-fraction must be in (0, 1)"),
    "source-no-column": (lambda b, g, tmp, mp: source(tmp, "--text-column", "body"),
                         "has no column 'body' (columns: id, text): fix --text-column"),
    "source-int-column": (lambda b, g, tmp, mp: source(tmp, "--text-column", "id"),
                          "column 'id' holds int, not text: pick the text column with --text-column"),
    "source-empty-spec": (lambda *_: train("--dataset", ""), "--dataset: an empty value (an unset variable?)"),
    "source-no-such-user": (lambda *_: train("--dataset", "~nonexistentuser/data"),
                            "starts with ~nonexistentuser, but there is no such user"),
    "source-only-empty-files": (lambda b, g, tmp, mp: empty_files(tmp, "a.jsonl", "b.parquet"),
                                "holds no documents: every file is empty (a.jsonl, b.parquet)"),
    # the library
    "tokenizer-corrupt": (lambda b, g, tmp, mp: corrupt_tokenizer(tmp), "is corrupt"),
    "tokenizer-bytes": (lambda b, g, tmp, mp: tokenizer_without_byte(tmp), "single-byte tokens are missing (byte 0x0)"),
    "loader-rank": (lambda *_: lambda: DataLoader(get_tokenizer(), "embedded", "train", 2, 16, rank=2, world_size=2),
                    "rank 2 is outside world_size 2"),
    "loader-state": (lambda *_: lambda: DataLoader(get_tokenizer(), "embedded", "train", 2, 16, world_size=1)
                     .load_state_dict(dict(DataLoader(get_tokenizer(), "embedded", "train", 2, 32).state_dict())),
                     "resume with the same data and sequence length"),
    "gpt-config": (lambda *_: lambda: GPTConfig(n_embd=100, n_head=3, n_kv_head=3),
                   "n_embd=100 is not divisible by n_head=3"),
    "optimizer-group": (lambda *_: muon_group_without_kind, "add kind='adamw' or kind='muon' to the group"),
    "shard-columns": (lambda b, *_: (no_text_shard(b), lambda: DataLoader(get_tokenizer(), "fineweb-edu", "train", 2,
                                                                          16).next_batch())[1],
                      "no 'text' column"),
}


def files(*roots):
    """Every file under roots, but the empty lock files that serialize builds and the cache of source
    files' content hashes (they stay, by design)."""
    return {p for r in roots for p in r.rglob("*")
            if (p.is_file() or p.is_symlink()) and p.name not in (".build.lock", ".hashes.json")}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, base, good, tmp_path, monkeypatch, capsys):
    setup, phrase = CASES[case]
    call = setup(base, good, tmp_path, monkeypatch)
    before = files(base, tmp_path)
    capsys.readouterr()
    with pytest.raises((SystemExit, ValueError, TypeError, FileNotFoundError)) as e:
        call()
    err = capsys.readouterr().err
    if isinstance(e.value, SystemExit):
        message = e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]
    else:
        message = str(e.value)
    assert "\n" not in message.strip() and "Traceback" not in err, f"not one line:\n{message}\n{err}"
    assert phrase in message, message
    assert files(base, tmp_path) == before, "a failed call left files behind"


def test_the_table_is_wide():
    assert len(CASES) >= 60


def test_a_bug_keeps_its_traceback(base, monkeypatch):
    """Only calls that read user input turn a ValueError into a one-line exit: the same exception raised by
    the code itself (a bug) must reach the user with its traceback."""
    from scripts import base_train

    def broken(self):
        raise ValueError("a bug inside the model")

    monkeypatch.setattr(base_train.GPT, "init_weights", broken)
    with pytest.raises(ValueError, match="a bug inside the model"):
        train(run="bug")()


def test_sample_prints_its_text_as_it_comes(base, good, monkeypatch, capsys):
    """A long sample takes minutes on a CPU: each token's text is out before the next is generated, and
    the pieces join to exactly the decoded sample."""
    from nanomuon.gpt import GPT
    from scripts.sample import main

    real, tokens, seen = GPT.generate, [], []

    def generate(self, *args, **kwargs):
        for t in real(self, *args, **kwargs):
            tokens.append(t)
            yield t
            seen.append(capsys.readouterr().out)  # what was printed before the next token

    monkeypatch.setattr(GPT, "generate", generate)
    capsys.readouterr()
    main(["--run", "good", "--prompt", "def", "--max-tokens", "6", "--device-type", "cpu"])
    early, header = "".join(seen[:-1]), "--- 'def'\ndef"
    assert len(tokens) == len(seen) == 6 and header in early and not early.endswith(header), \
        f"no text printed before the last token: {early!r}"
    printed = "".join(seen) + capsys.readouterr().out
    assert printed[printed.index(header) + len(header):] == get_tokenizer().decode(tokens) + "\n"


def test_a_variant_that_sets_an_lr_wins_and_says_so(base, monkeypatch, capsys):
    """A variant's own lr is what it was tuned with: it overrides the flag's (no 'multiple values for
    keyword argument'), and the run says which flag it did not use."""
    from nanomuon.arch import Variant
    from nanomuon.checkpoint import load_checkpoint
    from nanomuon.variants import OPTIMIZER_VARIANTS

    monkeypatch.setitem(OPTIMIZER_VARIANTS, "muon-lr", Variant(lrs=dict(matrix_lr=0.04)))
    capsys.readouterr()
    train("--optimizer", "muon-lr", "--matrix-lr", "0.03", run="variant-lr")()
    assert "--optimizer muon-lr sets matrix_lr 0.04 (--matrix-lr 0.03 is not used)" in capsys.readouterr().out
    saved, _ = load_checkpoint(base / "runs" / "variant-lr", 2, ("optim",))
    matrices = [g for g in saved["optim"]["param_groups"] if g.get("name") == "matrices"]
    assert [g["initial_lr"] for g in matrices] == [0.04]


def test_the_download_check_reads_every_row_group(fake_hub, tmp_path):
    """A shard whose footer is fine but whose row group is corrupt is a corrupt download, fetched
    again and then refused, naming the row group: before, it was kept and killed base_train."""
    name = shard_name(MAX_SHARD)
    good = io.BytesIO()
    pq.write_table(pa.table({"text": ["a document"] * 10}), good)
    fake_hub.files[HF_REPO] = {shard_name(0): good.getvalue(), name: corrupt_row_group()}
    r = fetch(fake_hub, tmp_path, 1, "--retries", "1")
    msg = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert msg.startswith(f"error: {name}: download failed after 2 attempts"), msg
    assert "corrupt download: the file has a corrupt row group 2 (" in msg, msg
    assert not (tmp_path / name).exists() and (tmp_path / shard_name(0)).exists()


def test_a_model_that_fits_only_in_swap_warns(base, monkeypatch, capsys):
    """Training that needs more than the free memory but fits with swap runs, after a warning."""
    monkeypatch.setattr("scripts.train_args.available_memory", lambda: (1 << 20, 64 << 30))
    capsys.readouterr()
    train(run="swap")()
    out = capsys.readouterr().out
    assert "warning: training this model takes about" in out and \
        "more than the 0.0 GiB free, so it will swap (slow) or be killed when memory runs out" in out, out


@pytest.mark.heavy
def test_a_process_group_without_its_peers_is_one_line(tmp_path):
    """WORLD_SIZE without MASTER_ADDR is one line, not a traceback; with MASTER_ADDR and no peer,
    the rendezvous says what it waits for and gives up after NANOMUON_RENDEZVOUS_TIMEOUT with one
    line, instead of torch's silent 30 minutes."""
    from test_dist import _free_port
    from test_train import child_env

    env = dict(child_env(tmp_path), RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    cmd = [sys.executable, "-m", "scripts.base_train", *GOOD, "--run", "alone"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "WORLD_SIZE=2 asks for 2 processes but MASTER_ADDR and MASTER_PORT are not set" \
        in p.stderr and "torchrun" in p.stderr
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               NANOMUON_RENDEZVOUS_TIMEOUT="12")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "rank 0: waiting for all 2 processes to meet at 127.0.0.1:" in p.stdout
    assert "the 2 processes did not all meet at 127.0.0.1:" in p.stderr and "within 12 s" in p.stderr


@pytest.mark.heavy
def test_a_world_of_one_needs_no_master_addr(base):
    """RANK=0 LOCAL_RANK=5 WORLD_SIZE=1 without MASTER_ADDR (a shell's leftovers, or a scheduler's
    one-task job): one process has no peer to meet, so it trains, in a process group of its own."""
    from test_train import child_env

    env = dict(child_env(base), RANK="0", LOCAL_RANK="5", WORLD_SIZE="1")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "scripts.base_train", *GOOD, "--run", "one"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "final val bpb" in p.stdout and "MASTER_ADDR" not in p.stdout + p.stderr


def test_a_rank_whose_peer_never_listens_is_one_line(tmp_path):
    """Rank 1 connects to rank 0's store, which never opens: c10d logs each failed try with its C++
    stack (40-odd lines); the run says what it waited for in one line, nothing more."""
    from test_dist import _free_port
    from test_train import child_env

    env = dict(child_env(tmp_path), RANK="1", LOCAL_RANK="1", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               NANOMUON_RENDEZVOUS_TIMEOUT="1")
    cmd = [sys.executable, "-m", "scripts.base_train", *GOOD, "--run", "peerless"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "rank 1: the 2 processes did not all meet at 127.0.0.1:" in p.stderr, p.stderr
