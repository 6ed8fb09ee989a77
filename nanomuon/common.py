"""
Plumbing shared by the library and the scripts: the base dir, atomic writes, bounded reads
(read_regular: never a FIFO, a link or a huge file), cached content hashes, process groups,
device choice, rank-0 printing, and the bits-per-byte evaluation.
"""

import atexit
import contextlib
import ctypes
import datetime
import errno
import functools
import hashlib
import json
import math
import netrc
import os
import shutil
import socket
import stat
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from nanomuon.hardware import bf16_matmuls_fast

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support: no DTensors to meet
    DTensor = ()


def get_base_dir() -> Path:
    """$NANOMUON_BASE_DIR if set, else ~/.cache/nanomuon; created if missing."""
    env = os.environ.get("NANOMUON_BASE_DIR")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "nanomuon"
    where = f"NANOMUON_BASE_DIR={env}" if env else str(base)
    if base.exists() and not base.is_dir():
        raise SystemExit(f"error: {where} is not a directory; point NANOMUON_BASE_DIR at a "
                         "directory (or unset it for ~/.cache/nanomuon)")
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, a read-only filesystem
        raise SystemExit(f"error: cannot create {where} ({e.strerror}); point "
                         "NANOMUON_BASE_DIR at a directory you can write") from None
    return base


def fsync_path(path: Path) -> None:
    """Make a directory's (or file's) entries durable: a rename is only as safe as this."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write, sync: bool = False) -> None:
    """write(tmp_path), or the text `write`, then rename into place (sync: fsynced first); the
    temporary NAME.PID.tmp is made anew, so a file or link left there is never written through."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        tmp.write_text(write) if isinstance(write, str) else write(tmp)
        if sync:
            fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


RACY_NS = 2_000_000_000  # a file changed this recently may change again within its timestamps' tick


def file_hash(path: Path, h=None) -> str:
    """A file's hash by h (a hashlib object; by default blake2b, 160 bits), read 1 MiB at a time."""
    h = h or hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


FILE_KINDS = ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
              (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
              (stat.S_ISSOCK, "socket"))


def file_kind(mode: int) -> str:
    """What a non-regular file is, by its lstat mode, for error lines."""
    return next((name for test, name in FILE_KINDS if test(mode)), "special file")


def check_regular(path: Path, what: str = "the regular file nanomuon wrote",
                  fix: str = "remove it", mode: int | None = None) -> Path:
    """path if a regular file by its lstat (or `mode`), else `path is a FIFO, not {what}: {fix}`."""
    mode = os.lstat(path).st_mode if mode is None else mode
    if not stat.S_ISREG(mode):  # a FIFO would hang an open, a link read what is not ours
        raise ValueError(f"{path} is a {file_kind(mode)}, not {what}: {fix}")
    return Path(path)


def read_regular(path: Path, limit: int, what: str = "the regular file nanomuon wrote",
                 fix: str = "remove it") -> bytes:
    """The bytes of a regular file (check_regular) of at most limit bytes; never waits on a FIFO."""
    check_regular(path, what, fix)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        check_regular(path, what, fix, info.st_mode)
        if info.st_size > limit:  # a sparse file's size costs no disk: never read it whole
            raise ValueError(f"{path} is over {limit:,} bytes ({info.st_size:,}), more than "
                             f"{what} ever holds: {fix}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is over {limit:,} bytes, more than {what} ever holds: {fix}")
    return data


def load_json(path: Path, limit: int, what: str = "the regular file nanomuon wrote",
              fix: str = "remove it"):
    """The JSON value in path, by read_regular; ValueError naming path if not JSON or too deep."""
    try:
        return json.loads(read_regular(path, limit, what, fix))
    except RecursionError:
        raise ValueError(f"{path} nests too deep to be {what}: {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not {what} ({e.msg} at byte {e.pos}): {fix}") from None


def content_hashes(paths: list[Path], memo: Path, note: str | None = None) -> list[str]:
    """file_hash of each path, cached in memo by size, mtime, ctime, inode (not within RACY_NS)."""
    try:
        cache = load_json(memo, 1 << 26, "a memo of content hashes")
    except (OSError, ValueError):
        cache = {}
    before = cache if isinstance(cache, dict) else {}
    cache, out = dict(before), []
    for p in paths:
        st, now, key = p.stat(), time.time_ns(), str(Path(p).resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = cache.get(key)
        if not (isinstance(entry, list) and len(entry) == 5 and entry[:4] == stamp):
            if note:
                print(note, flush=True)
                note = None
            entry = [*stamp, file_hash(p)]
            cache[key] = entry if now - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS else None
        out.append(entry[4])
    kept = {k: v for k, v in cache.items() if v and os.path.exists(k)}  # forget deleted files
    if kept != before:  # something new to keep, or something to forget
        with contextlib.suppress(OSError):  # read-only: hashed again next time
            memo.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(memo, json.dumps(kept))
    return out


def shown(text, limit: int = 200, quote: bool = True) -> str:
    """text to quote in a message: repr'd (any value: a loaded one) or escaped (a str), so that no
    byte may move the cursor, cut to limit."""
    out = repr(text) if quote else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[:limit] + "..."


def one_line(e: BaseException) -> str:
    """An exception's type and its message's first line, escaped and bounded by shown()."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {shown(first, 300, quote=False)}"


def size_str(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"


# the errors of a write that found no more room: a full disk, a spent quota, a file-size limit
FILLED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def causes(e: BaseException):
    """e, its contexts and causes, and (DCP) every rank's failure, transitively (at most 50)."""
    todo, seen = [e], 0
    while todo and seen < 50:
        e, seen = todo.pop(), seen + 1
        yield e
        todo += ([f[0] for f in getattr(e, "failures", {}).values()]
                 + [c for c in (e.__context__, e.__cause__) if c])


def filled(e: BaseException) -> int | None:
    """The FILLED errno of e or of any of its causes (DCP: any rank's), else None."""
    return next((c.errno for c in causes(e) if getattr(c, "errno", None) in FILLED), None)


def what_filled(code: int, where: Path) -> tuple[str, str]:
    """(what filled up, what to do about it), for a FILLED errno met while writing in `where`."""
    if code == errno.EFBIG:
        import resource  # Unix only, as EFBIG from a limit is

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit == resource.RLIM_INFINITY:
            return (f"a file grew past the largest one the filesystem of {where} holds",
                    "put it on another filesystem")
        size = f"{limit:,} bytes" if limit < 1e6 else size_str(limit)
        return (f"a file in {where} reached this process's file-size limit ({size}, ulimit -f)",
                "raise the limit (ulimit -f unlimited)")
    if code == errno.EDQUOT:
        return f"the disk quota of {where} ran out", "free some space or raise the quota"
    try:
        free = f" ({size_str(shutil.disk_usage(where).free)} free now)"
    except OSError:
        free = ""
    return f"no space left on the device of {where}", f"free some space{free}"


@contextlib.contextmanager
def user_errors():
    """Inside, a FileNotFoundError or ValueError (a user input's) ends the program in one line."""
    try:
        yield
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


WANDB_HOST = "https://api.wandb.ai"  # wandb's cloud, unless WANDB_BASE_URL names another


def wandb_key_problem(mode: str) -> str | None:
    """Why --wandb `mode` cannot log (online: no API key where wandb looks), else None."""
    if mode != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get(
            "WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        entry = netrc.netrc(path).authenticators(host) if host else None
    except (OSError, netrc.NetrcParseError):  # none, or unreadable: wandb finds no key there either
        entry = None
    if entry and entry[2]:
        return None
    return (f"--wandb online needs a W&B API key, and wandb finds none here (no WANDB_API_KEY, "
            f"nor a key for {shown(host, 80, quote=False)} in {shown(str(path), 120, quote=False)})"
            ": run `wandb login` or set WANDB_API_KEY, or use --wandb offline")


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def per_seed(fn, *values):
    """fn of the values, or where they are lists (--seeds: one entry per seed), of each seed's."""
    if isinstance(values[0], list):
        return [fn(*vs) for vs in zip(*values)]
    return fn(*values)


def numbers_text(value, fmt: str = "{:.4f}") -> str:
    """A number for a log line, or each seed's as their mean and range."""
    if not isinstance(value, list):
        return fmt.format(value)
    return (f"{fmt.format(statistics.fmean(value))} (mean of {len(value)} seeds, "
            f"{fmt.format(min(value))} to {fmt.format(max(value))})")


def wandb_values(key: str, value, seeds: list[int] | None) -> dict:
    """wandb keys of a number, or of each seed's (key/seed_N) and their mean (key)."""
    if not isinstance(value, list):
        return {key: value}
    return {key: statistics.fmean(value), **{f"{key}/seed_{s}": v for s, v in zip(seeds, value)}}


def check_device_type(device_type: str) -> str:
    """'auto' -> the best device here; an explicit device that is not here -> a one-line error."""
    # the accelerators, best first: whether each is here, and how its absence reads
    accelerators = dict(cuda=(torch.cuda.is_available, "torch sees no CUDA device"),
                        mps=(torch.backends.mps.is_available, "MPS is not available"))
    if device_type == "auto":
        return next((d for d, (here, _) in accelerators.items() if here()), "cpu")
    if device_type in accelerators and not accelerators[device_type][0]():
        raise SystemExit(f"error: --device-type {device_type}, but "
                         f"{accelerators[device_type][1]}; use --device-type cpu")
    return device_type


def compute_init(device_type: str = "auto"):
    """Set up the device and any process group: (distributed, rank, local_rank, world, device)."""
    device_type = check_device_type(device_type)
    rank, local_rank, world_size = process_env()
    timeout = rendezvous_timeout()
    distributed = "RANK" in os.environ  # process_env: all three set, or none
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"error: local rank {local_rank} but only {torch.cuda.device_count()} "
                             "CUDA devices; lower torchrun --nproc_per_node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (if any) use tensor cores
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device(device_type)
        if device_type == "cpu":
            reuse_freed_memory()
    if distributed:
        store = rendezvous(rank, world_size, timeout)
        if device_type == "cuda":
            dist.init_process_group("nccl", device_id=device, store=store, rank=rank,
                                    world_size=world_size)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
            atexit.register(compute_cleanup, barrier=False)
    return distributed, rank, local_rank, world_size, device


RENDEZVOUS_TIMEOUT_S = 600  # how long the processes may take to meet (NANOMUON_RENDEZVOUS_TIMEOUT)
MAX_RENDEZVOUS_TIMEOUT_S = 86_400  # a day: longer is a hung job, and c10d counts it in int32 ms


def rendezvous_timeout() -> float:
    """NANOMUON_RENDEZVOUS_TIMEOUT in seconds; anything but a number in (0, a day] is refused."""
    raw = os.environ.get("NANOMUON_RENDEZVOUS_TIMEOUT")
    if raw is None:
        return RENDEZVOUS_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_RENDEZVOUS_TIMEOUT_S:  # nan too
        raise SystemExit(f"error: NANOMUON_RENDEZVOUS_TIMEOUT={shown(raw)} is not a number of "
                         f"seconds in (0, {MAX_RENDEZVOUS_TIMEOUT_S:,}]: how long torchrun's "
                         "processes may take to meet; set one (the default is "
                         f"{RENDEZVOUS_TIMEOUT_S}), or unset it")
    return seconds


def rendezvous(rank: int, world_size: int, timeout: float = RENDEZVOUS_TIMEOUT_S):
    """The processes' shared store, met at MASTER_ADDR:MASTER_PORT within `timeout` seconds."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and world_size == 1:  # one process meets no other: a store of its own
        return dist.HashStore()
    if missing:
        raise SystemExit(f"error: WORLD_SIZE={world_size} asks for {world_size} processes but "
                         f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                         "set: launch with torchrun (it sets them), or unset RANK, LOCAL_RANK and "
                         "WORLD_SIZE to run one process")
    where = shown(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", quote=False)
    note = threading.Timer(10, lambda: print(
        f"rank {rank}: waiting for all {world_size} processes to meet at {where} (giving up "
        f"after {timeout:g} s: NANOMUON_RENDEZVOUS_TIMEOUT)", flush=True))
    note.daemon = True
    note.start()
    sys.stderr.flush()
    saved = os.dup(2)  # stderr's fd writes nowhere: c10d logs each failed try with its C++ stack
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 2)
            store, _, _ = next(dist.rendezvous("env://", rank, world_size,
                                               timeout=datetime.timedelta(seconds=timeout)))
    except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
        raise SystemExit(f"error: rank {rank}: the {world_size} processes did not all meet at "
                         f"{where} within {timeout:g} s ({one_line(e)}): start every rank, check "
                         "MASTER_ADDR and MASTER_PORT, or raise NANOMUON_RENDEZVOUS_TIMEOUT"
                         ) from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        note.cancel()
    store.set_timeout(dist.constants.default_pg_timeout)
    return store


ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def process_env() -> tuple[int, int, int]:
    """RANK, LOCAL_RANK and WORLD_SIZE (0, 0, 1 unset), checked: all three set, or none."""
    values = {}
    for name, default in zip(ENV_NAMES, (0, 0, 1)):
        raw = os.environ.get(name, str(default))
        try:
            values[name] = int(raw)
        except ValueError:
            raise SystemExit(f"error: {name}={raw!r} is not an integer; unset it, or launch with "
                             "torchrun, which sets it") from None
    given = [k for k in ENV_NAMES if k in os.environ]
    if given and len(given) < len(ENV_NAMES):
        missing = [k for k in ENV_NAMES if k not in given]
        are = lambda names: f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'}"
        raise SystemExit(f"error: {are(given)} set but {are(missing)} not: torchrun sets all "
                         f"three; launch with torchrun, or unset {' and '.join(given)} to run "
                         "one process")
    rank, local_rank, world_size = values.values()
    wrong = (f"WORLD_SIZE={world_size} must be >= 1" if world_size < 1
             else f"RANK={rank} is outside WORLD_SIZE={world_size} (need 0 <= RANK < WORLD_SIZE)"
             if not 0 <= rank < world_size
             else f"LOCAL_RANK={local_rank} must be >= 0" if local_rank < 0 else None)
    if wrong:
        raise SystemExit(f"error: {wrong}; unset RANK, LOCAL_RANK and WORLD_SIZE, or launch with "
                         "torchrun, which sets them")
    return rank, local_rank, world_size


def available_memory() -> tuple[int, int] | None:
    """(bytes of memory free, as MemAvailable or a cgroup v2 limit, bytes of swap free); None."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free, swap = (int(info[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, ValueError, KeyError):
        return None
    with contextlib.suppress(OSError, ValueError):  # "max": no limit
        cgroup = Path("/sys/fs/cgroup")
        limit, used = (int((cgroup / f).read_text()) for f in ("memory.max", "memory.current"))
        free = min(free, limit - used)
    return free, swap


def process_status(field: str) -> int | None:
    """A /proc/self/status field in bytes (VmRSS: held now; VmHWM: the peak); None off Linux."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def reuse_freed_memory() -> None:
    """Have glibc keep what is freed, not mmap 32 MiB+ allocations afresh (1.3x a CPU step)."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):  # glibc; elsewhere (macOS) nothing to do
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no allocation through mmap
        libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD -1: never hand the heap's free top back


def compute_cleanup(barrier: bool = True):
    """Destroy the process group, if any (at exit: with no barrier, as a gloo group left alive can
    abort in its destructors at interpreter finalization)."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def _with_hosts(value) -> list:
    """Every rank's (value, hostname), in rank order: a collective."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (value, socket.gethostname()))
    return seen


def exit_if_any_failed(error: str | None) -> None:
    """Stop every process if any has an error, with the first one's message and where it ran."""
    if dist.is_available() and dist.is_initialized():
        failed = [(r, e, host) for r, (e, host) in enumerate(_with_hosts(error)) if e]
        error = None
        if failed:
            r, e, host = failed[0]
            more = f", and {len(failed) - 1} more" if len(failed) > 1 else ""
            error = f"{e} (rank {r} on {host}{more})"
    if error:
        compute_cleanup()
        raise SystemExit(f"error: {error}")


def on_every_rank(fn):
    """fn() on every rank; a user error on any rank stops every rank with its line."""
    error, out = None, None
    try:
        with user_errors():
            out = fn()
    except SystemExit as e:
        error = str(e.code).removeprefix("error: ")
    exit_if_any_failed(error)
    return out


def exit_unless_ranks_agree(value, what: str, fix: str) -> None:
    """Stop every process if the ranks hold different values, naming two ranks, hosts and values."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    seen = _with_hosts(value)
    r = next((r for r, (v, _) in enumerate(seen) if v != seen[0][0]), None)
    if r is not None:  # every rank saw the same list, so every rank stops here, with the same line
        compute_cleanup()
        raise SystemExit(f"error: {what} differ between processes: rank 0 on {seen[0][1]} has "
                         f"{seen[0][0]}, rank {r} on {seen[r][1]} has {seen[r][0]}; {fix}")


DTYPES = ("auto", "bf16", "fp32")  # base_train's --dtype: what the forward and backward compute in


def resolve_dtype(device: torch.device, dtype: str = "auto") -> str:
    """'auto' is bf16 where bf16 matmuls are fast (hardware.bf16_matmuls_fast), else fp32."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    return ("bf16" if bf16_matmuls_fast(device) else "fp32") if dtype == "auto" else dtype


def resolve_compile(compile: bool | None, device: torch.device) -> bool:
    """--compile's default (None): on for CUDA, where it pays; off elsewhere."""
    return device.type == "cuda" if compile is None else compile


def autocast(device: torch.device, dtype: str = "auto"):
    """bf16 autocast (params and optimizer stay fp32) or plain fp32, as resolve_dtype decides."""
    bf16 = resolve_dtype(device, dtype) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def synchronizer(device: torch.device) -> Callable[[], None]:
    """The call that waits for `device`'s queued work, so step times time the work itself."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return torch.mps.synchronize if device.type == "mps" else torch.cpu.synchronize


@torch.no_grad()
def evaluate_bpb(model, rows: torch.Tensor, batch_size: int, token_bytes: torch.Tensor,
                 dtype: str = "auto") -> float | list[float]:
    """Bits per byte over all `rows`, rank r taking rows r, r + N, ... (the same at any world
    size); padding (-1) and special tokens count in neither sum. Batched seeds: a list."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = token_bytes.device
    mine = rows[rank::world_size]
    parts, batched = [], False  # per batch: (nats of each model, bytes)
    # every rank runs the same number of batches (a sharded model's forward is a collective)
    steps = math.ceil(math.ceil(len(rows) / world_size) / batch_size)
    for i in range(0, steps * batch_size, batch_size):
        batch = mine[i:i + batch_size].to(device)
        # a padded row's -1 inputs: any id serves, its targets are ignored; both contiguous, as a
        # padded last batch comes out: a compiled model guards on strides
        x, y = batch[:, :-1].clamp(min=0), batch[:, 1:].contiguous()
        if len(batch) < batch_size:
            pad = batch_size - len(batch)
            x = torch.cat([x, x.new_zeros(pad, x.size(1))])
            y = torch.cat([y, y.new_full((pad, y.size(1)), -1)])
        with autocast(device, dtype):
            loss = model(x, y, loss_reduction="none")
        b = token_bytes[y.clamp(min=0)] * (y >= 0)
        batched, nats = loss.dim() == 3, loss.float() * (b > 0)
        nats = nats.sum((-2, -1)) if batched else nats.sum().reshape(1)
        parts.append(torch.cat([nats, b.sum().float().reshape(1)]))
    *nats, nbytes = ([math.fsum(col) for col in zip(*torch.stack(parts).tolist())] if parts
                     else [0.0, 0.0])
    if distributed:  # in double: torch.distributed runs on CUDA and CPU, which have float64
        sums = torch.tensor([*nats, nbytes], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        *nats, nbytes = sums.tolist()
    if nbytes == 0:
        raise ValueError("evaluation saw no text bytes; is the validation split empty?")
    bpb = [n / (math.log(2) * nbytes) for n in nats]
    return bpb if batched else bpb[0]
