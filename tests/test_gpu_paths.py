"""What a first run on a GPU node needs, checked on the CPU: one batch layout for the compiled model
(no recompiles at epoch ends or at eval's short last batch), the eager loss's block size chosen from
the device's memory, and plots optional everywhere (an offline GPU image may lack matplotlib)."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from nanomuon.common import evaluate_bpb
from nanomuon.dataloader import DataLoader, val_rows
from nanomuon.dataset import data_dir
from nanomuon.gpt import GPT, config_from_depth, loss_block_rows, softcap_cross_entropy
from nanomuon.report import MISSING

REPO = Path(__file__).resolve().parents[1]


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, BOS 256: a tokenizer that needs no training."""

    bos_id = 256

    def _one(self, text, prepend_bos):
        return [256] * prepend_bos + list(text.encode())

    def encode(self, text, prepend_bos=False):
        if isinstance(text, list):
            return [self._one(t, prepend_bos) for t in text]
        return self._one(text, prepend_bos)


def write_split_folder(base, n_train=9, n_val=12):
    """fineweb-edu's layout in `base`: one train shard of a few documents, then the val shard."""
    d = data_dir("fineweb-edu")
    d.mkdir(parents=True, exist_ok=True)
    docs = [f"document {k}: " + "words and more words " * (1 + k % 4)
            for k in range(n_train + n_val)]
    for i, part in enumerate((docs[:n_train], docs[n_train:])):
        table = pa.table({"text": pa.array(part, pa.string())})
        pq.write_table(table, d / f"shard_{i:05d}.parquet")


def train_step(model, x, y):
    loss = model(x, y)
    loss.backward()
    return loss.item()


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_model_never_recompiles_for_a_padded_or_short_batch(tmp_path, monkeypatch):
    """torch.compile(dynamic=False) guards on strides: a padded batch at an epoch's end, or eval's
    short last batch, in another layout than the others would compile the model again (minutes at
    d20 on a GPU). After one train step and one eval batch, training across an epoch boundary and
    evaluating a split whose last batch is short must compile nothing."""
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path))
    write_split_folder(tmp_path)
    tok, B, T = ByteTokenizer(), 2, 32
    torch.manual_seed(0)
    model = GPT(config_from_depth(1, 257, T, aspect_ratio=32, head_dim=16))
    model.init_weights()
    compiled = torch.compile(model, dynamic=False)
    dl = DataLoader(tok, "fineweb-edu", "train", B, T, buffer_size=4)
    rows = val_rows(tok, "fineweb-edu", T, 5 * T)
    assert len(rows) % B, "the val rows must end in a short batch"
    token_bytes = torch.ones(257, dtype=torch.long)
    token_bytes[256] = 0
    torch._dynamo.reset()
    train_step(compiled, *dl.next_batch())
    model.eval()
    evaluate_bpb(compiled, rows[:B], B, token_bytes, "fp32")
    model.train()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(100):  # to a padded batch and into epoch 1
            train_step(compiled, *dl.next_batch())
            if dl.stats["padding"] and 1 in dl.batch_epochs:
                break
        assert dl.stats["padding"] and 1 in dl.batch_epochs, dl.packing()
        train_step(compiled, *dl.next_batch())  # and on, into the next epoch
        model.eval()
        bpb = evaluate_bpb(compiled, rows, B, token_bytes, "fp32")
    assert 0 < bpb < 20


GiB = 2 ** 30
CUDA = torch.device("cuda", 0)


def fake_gpu(monkeypatch, free, cached=0):
    """torch.cuda as an 80 GiB H100 with `free` bytes free to the driver and `cached` bytes idle in
    the caching allocator, on a machine that has no GPU."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GiB + cached)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * GiB)


def blocks(n, vocab, device):
    rows = loss_block_rows(n, vocab, device)
    return -(-n // rows), rows * vocab * 4  # how many, and the fp32 bytes of one block's logits


def test_loss_blocks_on_an_h100_are_as_few_as_a_quarter_of_free_memory_allows(monkeypatch):
    """Eager on CUDA (sample, base_eval, --no-compile): a block's 4 fp32 temporaries (16 bytes per
    logit) within a quarter of the free memory. With 60 GiB free, sample's and a d12 micro-batch's
    logits are one block; an eval batch of 32 x 2048 rows at vocab 32768 has 32 GiB of
    temporaries, over the 15 GiB budget, so 3 blocks; a nearly full GPU still makes progress."""
    fake_gpu(monkeypatch, free=60 * GiB)
    assert blocks(1 * 2048, 32768, CUDA)[0] == 1
    assert blocks(8 * 2048, 32768, CUDA)[0] == 1  # 4 GiB of temporaries
    n, size = blocks(32 * 2048, 32768, CUDA)
    assert n == 3 and 4 * size <= 15 * GiB
    fake_gpu(monkeypatch, free=GiB, cached=3 * GiB)  # the allocator's idle cache is free memory
    assert blocks(32 * 2048, 32768, CUDA)[1] * 4 == GiB
    fake_gpu(monkeypatch, free=2 ** 20)
    assert loss_block_rows(4096, 32768, CUDA) == 1  # not even one row fits: one row at a time


def test_loss_blocks_on_a_cpu_are_a_mib_whatever_the_gpu(monkeypatch):
    """On the CPU a block stays in cache: 1 MiB of fp32 logits, never asking CUDA anything."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: 1 / 0)
    cpu = torch.device("cpu")
    assert blocks(32 * 2048, 32768, cpu) == (32 * 2048 // 8, 2 ** 20)
    assert blocks(5, 4096, cpu) == (1, 5 * 4096 * 4)  # fewer rows than a block
    assert loss_block_rows(10, 2 ** 20, cpu) == 1  # a row over 1 MiB: one row per block


@pytest.mark.parametrize("one_block", [True, False])
def test_softcap_loss_is_the_same_in_one_block_or_many(monkeypatch, one_block):
    """The loss and gradient of SoftcapCrossEntropy against tanh + cross_entropy in float64, with
    the block size CUDA would choose (all rows at once) and a short one (3 rows, 5 blocks)."""
    import nanomuon.gpt

    chosen = []

    def rows(n, vocab, device):
        chosen.append(n if one_block else 3)
        return chosen[-1]

    monkeypatch.setattr(nanomuon.gpt, "loss_block_rows", rows)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(13, 501, generator=gen, dtype=torch.float64) * 20).requires_grad_()
    targets = torch.randint(0, 501, (13,), generator=gen)
    targets[4] = -1
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(15 * torch.tanh(ref_logits / 15), targets, ignore_index=-1)
    ref.backward()
    loss = softcap_cross_entropy(logits, targets, 15.0, "mean", True)
    loss.backward()
    assert chosen == [13 if one_block else 3]
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-12, atol=1e-15)


def hiding(tmp_path, *names) -> str:
    """A PYTHONPATH entry whose sitecustomize makes the modules `names` absent to every Python that
    starts with it: find_spec gives None and import fails, as on an image without them."""
    d = tmp_path / "hide"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{n!r}] = None\n"
                                                                  for n in names))
    return str(d)


def test_speedrun_does_not_install_anything_for_a_missing_matplotlib(tmp_path):
    """On an offline image with everything but matplotlib, speedrun.sh goes straight to its first
    step instead of running pip (which fails offline). Here python -m stands in for the steps and
    pip records that it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ]; then echo "step: python $*"; exit 3; fi
exec {sys.executable} "$@"
""")
    pip_log = tmp_path / "pip.log"
    (bin_dir / "pip").write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {pip_log}\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(PATH=f"{bin_dir}:/usr/bin:/bin", HOME=str(tmp_path), MODE="cpu",
               NANOMUON_BASE_DIR=str(tmp_path / "base"), PYTHONPATH=hiding(tmp_path, "matplotlib"))
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert not pip_log.exists(), p.stdout + p.stderr
    assert p.returncode == 3 and "step: python -m nanomuon.dataset --embedded" in p.stdout, p.stdout


def test_gpu_check_names_every_missing_package_before_it_starts(tmp_path):
    """gpu_check.sh needs torch, tiktoken, pyarrow and pytest (its tests step): one line names those
    missing before any step runs, in the dry run too."""
    env = dict(os.environ, PYTHONPATH=hiding(tmp_path, "pytest", "tiktoken"))
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == "", p.stdout
    assert p.stderr.count("\n") == 1 and "missing here: tiktoken, pytest" in p.stderr, p.stderr


@pytest.mark.slow
def test_gpu_check_runs_its_steps_with_python3_where_python_lacks_torch(tmp_path):
    """An image whose torch lives in a venv's python3 alone: gpu_check.sh's `python` becomes a shim
    for python3 (a script, which keeps the venv), so the dry run imports everything and checks the
    flags. Here `python` is one that can import nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "imports: ok" in p.stdout and "base_train flags: ok" in p.stdout, p.stdout


def test_a_report_without_matplotlib_says_in_one_line_that_it_skipped_the_plots(base, monkeypatch):
    """Plots are optional: base_train without matplotlib trains, and its report says in one line
    that the plots were skipped and why."""
    from scripts.base_train import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    main(["--dataset", "embedded", "--device-type", "cpu", "--depth", "2", "--aspect-ratio", "32",
          "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "4", "--eval-tokens",
          "1024", "--sample-tokens", "0", "--total-batch-size", "256", "--num-iterations", "2",
          "--run", "no-plots"])
    run = base / "runs" / "no-plots"
    said = [line for line in (run / "report.md").read_text().splitlines() if "matplotlib" in line]
    assert len(said) == 1 and "skipped" in said[0] and "not installed" in said[0], said
    assert MISSING in said[0] and not (run / "curves.png").exists()
