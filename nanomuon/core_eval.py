"""
The CORE metric of the DCLM paper (arXiv 2406.11794), as nanochat reports it for "time to GPT-2":
22 in-context tasks (multiple_choice, schema, language_modeling), each scored few-shot as its
config says and centered by its random baseline, (acc - b/100) / (1 - b/100); CORE is their mean.
The eval bundle is nanochat's eval_bundle.zip (or a folder or zip of its layout), downloaded once
over https and checked against its recorded sha256 and size. It is untrusted input: read straight
from the zip, no path in it may leave it, every file is bounded (MAX_*) before it is parsed, and
core.yaml goes through PyYAML's safe loader. Items, few-shot picks and prompts follow nanochat's
core_eval (seeds 1337 and 1234 + index), so the numbers compare with its leaderboard (docs/core.md).
"""

import csv
import hashlib
import io
import json
import math
import os
import random
import re
import stat
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanomuon.common import (
    autocast,
    file_hash,
    file_kind,
    get_base_dir,
    load_json,
    one_line,
    print0,
    read_regular,
    write_atomic,
)
from nanomuon.dataset import build_lock

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
BUNDLE_ZIP = "eval_bundle.zip"  # in the base dir, with its record next to it
RECORD = "eval_bundle.json"  # {url, sha256, size} of the zip's first download (or first use)
BUNDLE_DIR = "eval_bundle"  # an unzipped bundle in the base dir (nanochat keeps it so)
# each kind of task, and the fields its items hold besides gold
FIELDS = {"multiple_choice": ("query", "choices"), "schema": ("context_options", "continuation"),
          "language_modeling": ("context", "continuation")}
GPT2_CORE = 0.256525  # GPT-2 1.6B's CORE, nanochat's leaderboard line
CORE_TASKS = 22
MAX_FILE = 256 << 20  # bytes of one bundle file (the largest real one is ~20 MB)
MAX_BUNDLE = 1 << 30  # bytes read from one bundle in all, each file once (the real one: ~100 MB)
MAX_ITEM = 1 << 20  # bytes of one task item's line (the longest real one is ~20 KB)
# Bounds on what the small files make the loader build; the real bundle sits far inside each
MAX_CONFIG = 64 << 10  # bytes of core.yaml (nanochat's: ~4 KB; YAML parses slowly)
MAX_META = 1 << 20  # bytes of eval_meta_data.csv (nanochat's: ~10 KB)
MAX_TASKS = 100  # tasks core.yaml lists (CORE: 22)
MAX_LINES = 50_000  # lines of one task file (the largest real task: ~20,000 items)
# CORE's own bundle, the work a bundle may ask a multiple of: its 22 tasks' items (nanochat's
# per-task counts) and their prompts' characters as prompt_chars counts them: 2.6e8 for the 18
# tasks whose files llm-foundry holds (nanochat's bundle is made of them), ~4.2e8 estimated for
# HellaSwag (0- and 10-shot), SQuAD and CoQA from their item counts and lengths
CORE_ITEMS, CORE_WORK = 91_033, 7 * 10 ** 8
# scoring takes a time per item and per character, so a bundle within this multiple of both takes
# at most this multiple of CORE's time (a CPU miniature's d4: about an hour for CORE)
WORK_MULTIPLE = 2
PROGRESS_S = 30  # a line at least this often while a bundle is read or scored
MAX_OPTIONS = 100  # choices or context options of one item (real ones: a dozen at most)
MAX_PROMPT = 1 << 20  # characters of one item's prompts, examples and options (real: ~0.2M)
SIZE_LIMITS = {"core.yaml": MAX_CONFIG, "eval_meta_data.csv": MAX_META}
MAX_DOWNLOAD = 1 << 30
LAYOUT = "the zip, or a folder holding core.yaml, eval_meta_data.csv and eval_data/"
USE = f"use nanochat's eval_bundle.zip ({LAYOUT})"


@dataclass
class Task:
    label: str
    kind: str
    shots: int
    delimiter: str
    baseline: float  # percent, as eval_meta_data.csv gives it
    items: list
    uri: str


def name_problem(name) -> str | None:
    """Why a path inside the bundle (a zip member, a dataset_uri) could leave it, or None."""
    if not isinstance(name, str) or not name or not name.isprintable():
        return "is not a printable, non-empty name"
    if name.startswith(("/", "~")) or "\\" in name or re.match(r"[A-Za-z]:", name):
        return "is absolute or has a backslash"
    if ".." in name.split("/"):
        return "climbs out with '..'"


class Bundle:
    """The files of an eval bundle read by relative name, from a folder or a zip whose files sit
    at its root or in one top folder (nanochat's has eval_bundle/)."""

    def __init__(self, path: Path):
        self.path, self.zip, self.prefix = Path(path), None, ""
        self._read, self._total = {}, 0  # name -> bytes, and their sum
        self._lines, self._items = {}, {}  # a task file's shuffled lines, and its parsed items
        try:  # stat, not open: a FIFO or a device would hang the open or read forever
            mode = os.stat(self.path).st_mode
            if stat.S_ISDIR(mode):
                self.root = self.path.resolve(strict=True)
                return
        except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, before Python 3.13
            raise ValueError(f"CORE bundle {self.path} cannot be read ({one_line(e)}): "
                             f"{USE}") from None
        if not stat.S_ISREG(mode):
            raise ValueError(f"CORE bundle {self.path} is a {file_kind(mode)}, not a zip file or "
                             f"a folder: {USE}")
        try:
            self.zip = zipfile.ZipFile(self.path)
            names = self.zip.namelist()
        except (OSError, zipfile.BadZipFile, ValueError) as e:
            raise ValueError(f"CORE bundle {self.path} is not a readable zip file or folder "
                             f"({one_line(e)}): {USE}") from None
        for name in names:
            if problem := name_problem(name):
                raise ValueError(f"CORE bundle {self.path} holds a member {name!r} that {problem}; "
                                 "refusing the whole zip: use nanochat's eval_bundle.zip")
        tops = [n[:-len("core.yaml")] for n in names
                if n == "core.yaml" or (n.endswith("/core.yaml") and n.count("/") == 1)]
        if len(tops) != 1:
            raise ValueError(f"CORE bundle {self.path} has {len(tops)} core.yaml at its root or "
                             "in one top folder, not 1: is it an eval bundle?")
        self.prefix = tops[0]

    def read(self, name: str) -> bytes:
        """A file's bytes, read once however many tasks list it, at most MAX_BUNDLE bytes in all."""
        if name not in self._read:
            data = self._read_file(name, SIZE_LIMITS.get(name, MAX_FILE))
            self._total += len(data)
            if self._total > MAX_BUNDLE:
                raise ValueError(f"CORE bundle {self.path}: reading {name} takes it over "
                                 f"{MAX_BUNDLE / 2 ** 20:g} MiB in all, which no eval bundle needs")
            self._read[name] = data
        return self._read[name]

    def _read_file(self, name: str, limit: int) -> bytes:
        if problem := name_problem(name):
            raise ValueError(f"CORE bundle {self.path}: the path {name!r} {problem}")
        where = f"{self.path}: {name}"
        over = (f"CORE bundle {where} is over {limit:,} bytes, more than any eval bundle's "
                f"{name.rpartition('/')[0] or name} needs: {USE}")
        missing = f"CORE bundle {where} is missing"
        if self.zip is None:
            try:
                path = (self.root / name).resolve()
            except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, before 3.13
                raise ValueError(f"CORE bundle {where} cannot be followed ({one_line(e)}): "
                                 f"{USE}") from None
            if not path.is_relative_to(self.root):
                raise ValueError(f"CORE bundle {where} leads outside the folder (a link)")
            try:
                if path.stat().st_size > limit:
                    raise ValueError(over)
                return read_regular(path, limit, "a file of an eval bundle", USE)
            except FileNotFoundError:
                raise FileNotFoundError(missing) from None
            except OSError as e:
                raise ValueError(f"CORE bundle {where} cannot be read ({one_line(e)})") from None
        try:
            info = self.zip.getinfo(self.prefix + name)
        except KeyError:
            raise FileNotFoundError(missing) from None
        if info.file_size > limit:
            raise ValueError(over)
        try:
            with self.zip.open(info) as f:
                data = f.read(limit + 1)
        except (OSError, RuntimeError, zipfile.BadZipFile, EOFError, ValueError) as e:
            raise ValueError(f"CORE bundle {where} does not unzip ({one_line(e)}); get the "
                             "bundle again") from None
        if len(data) > limit:  # the size its header gave was a lie
            raise ValueError(over)
        return data

    def digest(self) -> str:
        """sha256 of the zip (what the report names), or 'folder'."""
        return "folder" if self.zip is None else file_hash(self.path, hashlib.sha256())


class _HttpsOnly(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.lower().startswith("https://"):
            raise urllib.error.URLError(f"redirected to {newurl}, which is not https")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def download_bundle(dest: Path) -> None:
    """BUNDLE_URL -> dest (https only, at most MAX_DOWNLOAD bytes, whole or not at all), then
    recorded."""
    print0(f"downloading the CORE eval bundle {BUNDLE_URL} -> {dest}")

    def fetch(tmp: Path) -> None:
        with urllib.request.build_opener(_HttpsOnly).open(BUNDLE_URL, timeout=60) as r, \
                open(tmp, "wb") as f:
            size = 0
            while block := r.read(1 << 20):
                size += len(block)
                if size > MAX_DOWNLOAD:
                    raise ValueError(f"the CORE bundle at {BUNDLE_URL} is over "
                                     f"{MAX_DOWNLOAD >> 20} MiB")
                f.write(block)
        if not zipfile.is_zipfile(tmp):
            raise ValueError(f"{BUNDLE_URL} did not send a zip file")
    try:
        write_atomic(dest, fetch)
    except (OSError, urllib.error.URLError) as e:
        raise ValueError(f"cannot download the CORE bundle ({one_line(e)}): download {BUNDLE_URL} "
                         f"on a machine with network and place it at {dest}, or pass "
                         f"--core-bundle PATH ({LAYOUT})") from None
    record(dest, BUNDLE_URL)


def record(zip_path: Path, url: str) -> None:
    sha, size = file_hash(zip_path, hashlib.sha256()), zip_path.stat().st_size
    text = json.dumps(dict(url=url, sha256=sha, size=size)) + "\n"
    write_atomic(zip_path.with_name(RECORD), text)
    print0(f"CORE bundle {zip_path}: sha256 {sha}, {size:,} bytes (recorded in {RECORD})")


def check_record(zip_path: Path) -> None:
    """The zip must be what its record says; a zip placed by hand is recorded at first use."""
    path = zip_path.with_name(RECORD)
    redo = f"delete it and {zip_path.name} to download the bundle again"
    try:  # a FIFO or a device there is refused in one line (ValueError), never waited on
        want = load_json(path, 1 << 16, "the record nanomuon writes", redo)
    except FileNotFoundError:
        return record(zip_path, "placed by hand")
    except OSError as e:
        raise ValueError(f"{path} is unreadable ({one_line(e)}): {redo}") from None
    sha, size = file_hash(zip_path, hashlib.sha256()), zip_path.stat().st_size
    if not isinstance(want, dict) or [want.get("sha256"), want.get("size")] != [sha, size]:
        raise ValueError(f"{zip_path} (sha256 {sha[:16]}, {size:,} bytes) is not the file recorded "
                         f"in {RECORD} at its first download: delete both to download it again")


def find_bundle(path: str | None, fetch: bool) -> Bundle | None:
    """path if given, else the base dir's zip (checked against its record), else its unzipped
    folder, else the download if fetch, else None."""
    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--core-bundle {path}: no such file or folder")
        return Bundle(Path(path))
    base = get_base_dir()
    with build_lock(base):  # under torchrun: one rank downloads, the others then find it
        if (base / BUNDLE_ZIP).is_file():
            check_record(base / BUNDLE_ZIP)
            return Bundle(base / BUNDLE_ZIP)
        if (base / BUNDLE_DIR / "core.yaml").is_file():
            return Bundle(base / BUNDLE_DIR)
        if not fetch:
            return None
        download_bundle(base / BUNDLE_ZIP)
        return Bundle(base / BUNDLE_ZIP)


def item_problem(kind: str, item) -> str | None:
    """What is wrong with one task item for its kind, or None. An item whose answer is scored on
    nothing (an empty option or continuation) or whose options all tie (all the same) would count
    as right for the first option whatever the model says: it is refused, not scored."""
    if not isinstance(item, dict):
        return "is not a JSON object"
    for key in FIELDS[kind]:
        value = item.get(key)
        if key in ("choices", "context_options"):
            if not (isinstance(value, list) and len(value) >= 2
                    and all(isinstance(v, str) for v in value)):
                return f"'{key}' is not a list of at least 2 strings"
            if len(value) > MAX_OPTIONS:
                return f"'{key}' has {len(value):,} options, over the {MAX_OPTIONS} any item has"
            if "" in value:
                return f"'{key}' holds an empty option, which leaves nothing to score"
            if len(set(value)) == 1:
                return f"'{key}' are all the same option, so they all tie"
        elif not isinstance(value, str):
            return f"'{key}' is not a string"
        elif key == "continuation" and not value:
            return "'continuation' is empty, which leaves nothing to score"
    if kind != "language_modeling":
        options = item["choices" if kind == "multiple_choice" else "context_options"]
        gold = item.get("gold")
        if not (isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(options)):
            return f"'gold' is {gold!r}, not an index into its {len(options)} options"


def task_lines(bundle: Bundle, uri: str) -> list:
    """A task file's non-blank lines, numbered from 1 and shuffled as nanochat shuffles its items,
    once per file; over MAX_LINES lines is refused before the split."""
    if uri not in bundle._lines:
        where = f"CORE bundle {bundle.path}: eval_data/{uri}"
        data = bundle.read(f"eval_data/{uri}")
        # universal newlines, as nanochat reads the file: \n, \r\n or \r ends a line
        ends = data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")
        count = ends + (not data.endswith((b"\n", b"\r")))
        if count > MAX_LINES:
            raise ValueError(f"{where} has {count:,} lines, over the {MAX_LINES:,} any eval task "
                             f"needs (the largest real one has ~20,000 items): {USE}")
        lines = [(n, line) for n, line in enumerate(data.splitlines(), 1) if line.strip()]
        if not lines:
            raise ValueError(f"{where} holds no items")
        random.Random(1337).shuffle(lines)  # the permutation nanochat applies to the parsed items
        bundle._lines[uri] = lines
    return bundle._lines[uri]


def read_items(bundle: Bundle, uri: str, kind: str, max_per_task: int | None = None) -> list:
    """A task's items shuffled and cut to max_per_task, once per file and kind; only the lines
    kept are parsed, each at most MAX_ITEM bytes: a huge or deeply nested line is one error."""
    key = (uri, kind, max_per_task)
    if key in bundle._items:
        return list(bundle._items[key])
    where = f"CORE bundle {bundle.path}: eval_data/{uri}"
    lines, items = task_lines(bundle, uri), []
    for n, line in lines[:max_per_task] if max_per_task else lines:
        if len(line) > MAX_ITEM:
            raise ValueError(f"{where} line {n} is {len(line):,} bytes, over the "
                             f"{MAX_ITEM >> 10} KiB any eval item needs")
        try:
            item = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{where} line {n} is not UTF-8 ({e.reason})") from None
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise ValueError(f"{where} line {n} is not JSON ({one_line(e)})") from None
        if problem := item_problem(kind, item):
            raise ValueError(f"{where} line {n}: {problem} (a {kind} item)")
        items.append(item)
    bundle._items[key] = items
    return list(items)


def read_baselines(bundle: Bundle) -> dict:
    """{task label: random baseline in percent} from eval_meta_data.csv."""
    where = f"CORE bundle {bundle.path}: eval_meta_data.csv"
    data = bundle.read("eval_meta_data.csv")
    try:
        rows = list(csv.DictReader(io.StringIO(data.decode("utf-8"))))
        out = {row["Eval Task"]: float(row["Random baseline"]) for row in rows}
    except (UnicodeDecodeError, KeyError, TypeError, ValueError, csv.Error) as e:
        raise ValueError(f"{where} lacks a readable 'Eval Task' and numeric 'Random baseline' "
                         f"column ({one_line(e)})") from None
    if bad := [k for k, b in out.items() if not 0 <= b < 100]:
        raise ValueError(f"{where}: the random baseline of {bad[0]} is {out[bad[0]]}, not in "
                         "[0, 100)")
    return out


def task_configs(bundle: Bundle) -> list[dict]:
    """core.yaml's icl_tasks, each checked: label, dataset_uri, num_fewshot, icl_task_type."""
    import yaml  # the eval bundle's core.yaml; datasets and huggingface_hub need it too

    where = f"CORE bundle {bundle.path}: core.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, when built: 6x faster
    try:
        config = yaml.load(bundle.read("core.yaml").decode("utf-8"), Loader=loader)
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
        raise ValueError(f"{where} is not YAML ({one_line(e)})") from None
    tasks = config.get("icl_tasks") if isinstance(config, dict) else None
    if not (isinstance(tasks, list) and tasks and all(isinstance(t, dict) for t in tasks)):
        raise ValueError(f"{where} has no list of icl_tasks")
    if len(tasks) > MAX_TASKS:
        raise ValueError(f"{where} lists {len(tasks):,} tasks, over the {MAX_TASKS} an eval "
                         f"bundle needs (CORE has {CORE_TASKS}): {USE}")
    for t in tasks:
        shots = t.get("num_fewshot")
        shots = shots[0] if isinstance(shots, list) and len(shots) == 1 else shots
        label = t.get("label")
        problem = ("has no label" if not (isinstance(label, str) and label.isprintable()) else
                   f"type {t.get('icl_task_type')!r} is not one of {', '.join(FIELDS)}"
                   if t.get("icl_task_type") not in FIELDS else
                   f"num_fewshot {t.get('num_fewshot')!r} is not a count (or a list of one)"
                   if not (isinstance(shots, int) and 0 <= shots <= 100) else
                   "continuation_delimiter is not a string"
                   if not isinstance(t.get("continuation_delimiter", " "), str) else
                   f"dataset_uri {t.get('dataset_uri')!r} {name_problem(t.get('dataset_uri'))}"
                   if name_problem(t.get("dataset_uri")) else None)
        if problem:
            raise ValueError(f"{where}: task {label!r}: {problem}")
        t["num_fewshot"] = shots
    return tasks


def load_tasks(bundle: Bundle, max_per_task: int | None = None) -> list[Task]:
    """Every task core.yaml lists, its items cut to max_per_task; an item's prompts within
    MAX_PROMPT characters (few-shot examples and options multiply its size), all items (counted
    before they are parsed) and all prompts' characters within WORK_MULTIPLE times CORE's."""
    baselines, tasks, configs = read_baselines(bundle), [], task_configs(bundle)
    count, work, tick = 0, 0, every(PROGRESS_S)
    for t in configs:
        where = f"CORE bundle {bundle.path}"
        if t["label"] not in baselines:
            raise ValueError(f"{where}: eval_meta_data.csv has no random baseline for task "
                             f"{t['label']}")
        count += min(len(task_lines(bundle, t["dataset_uri"])), max_per_task or MAX_LINES)
        if count > WORK_MULTIPLE * CORE_ITEMS:
            raise ValueError(f"{where}: its first {len(tasks) + 1} tasks hold {count:,} items, over "
                             f"{WORK_MULTIPLE}x the {CORE_ITEMS:,} of CORE's {CORE_TASKS}: {USE}")
        items = read_items(bundle, t["dataset_uri"], t["icl_task_type"], max_per_task)
        task = Task(t["label"], t["icl_task_type"], t["num_fewshot"],
                    t.get("continuation_delimiter", " "), baselines[t["label"]], items,
                    t["dataset_uri"])
        tasks.append(task)
        for idx in range(len(items)):  # every prompt is tokenized before the window crops it
            if (n := prompt_chars(task, idx)) > MAX_PROMPT:
                raise ValueError(f"{where}: task {task.label} (eval_data/{task.uri}): an item's "
                                 f"prompts, {task.shots}-shot, come to {n:,} characters, over the "
                                 f"{MAX_PROMPT:,} any eval item needs: shorten its items or lower "
                                 "its num_fewshot")
            work += n
        if work > WORK_MULTIPLE * CORE_WORK:
            raise ValueError(f"{where}: the prompts of its first {len(tasks)} tasks come to "
                             f"{work:,} characters, over {WORK_MULTIPLE}x the ~{CORE_WORK:.1e} of "
                             f"CORE's {CORE_TASKS}: {USE}")
        if tick():
            print0(f"CORE: read {len(tasks)} of {len(configs)} tasks, {count:,} items")
    bundle._lines.clear()  # the split lines are not needed while the tasks are scored
    return tasks


def every(seconds: float):
    """A function that answers True at most once every `seconds` (the first call: False)."""
    last = [time.monotonic()]

    def due() -> bool:
        if time.monotonic() - last[0] < seconds:
            return False
        last[0] = time.monotonic()
        return True
    return due


def prompt_chars(task: Task, idx: int) -> int:
    """The characters of item idx's prompts as render() lays them out (at most: it strips some),
    from the fields' lengths, each as long as the longest: score_item pads them to it."""
    item, d = task.items[idx], len(task.delimiter)
    examples = fewshot(task.items, idx, task.shots) if task.shots else []
    if task.kind == "multiple_choice":
        head = sum(len(e["query"]) + d + len(e["choices"][e["gold"]]) + 2 for e in examples)
        stem, options = len(item["query"]) + d, item["choices"]
    elif task.kind == "schema":
        head = sum(len(e["context_options"][e["gold"]]) + d + len(e["continuation"]) + 2
                   for e in examples)
        stem, options = d + len(item["continuation"]), item["context_options"]
    else:
        head = sum(len(e["context"]) + d + len(e["continuation"]) + 2 for e in examples)
        stem, options = len(item["context"]) + d, ["", item["continuation"]]
    return len(options) * (head + stem + max(map(len, options)))


def fewshot(items: list, idx: int, shots: int) -> list:
    """nanochat's pick: `shots` other items (or all there are), seeded by the item's index."""
    # nanochat samples the list of the other indices; range(n), each pick past idx shifted by
    # one, is the same to sample() without building that list for every item
    n = len(items) - 1
    picks = random.Random(1234 + idx).sample(range(n), min(shots, n))
    return [items[i + (i >= idx)] for i in picks]


def render(task: Task, item: dict, examples: list) -> list[str]:
    """One item's prompts as llm-foundry lays them out, each example then a blank line: one per
    option, or for language_modeling the context alone (stripped) and with its continuation."""
    d = task.delimiter
    if task.kind == "multiple_choice":
        head = "".join(f"{e['query']}{d}{e['choices'][e['gold']]}\n\n" for e in examples)
        return [f"{head}{item['query']}{d}{c}" for c in item["choices"]]
    if task.kind == "schema":
        head = "".join(f"{e['context_options'][e['gold']]}{d}{e['continuation']}\n\n"
                       for e in examples)
        return [f"{head}{c}{d}{item['continuation']}" for c in item["context_options"]]
    head = "".join(f"{e['context'].strip()}{d}{e['continuation']}\n\n" for e in examples)
    stem = f"{head}{item['context'].strip()}{d}"
    return [stem.strip(), stem + item["continuation"]]


def spans(kind: str, seqs: list[list[int]]) -> tuple[list, list, list]:
    """(sequences to score, start, end): tokens start..end-1 of each are the ones scored, at
    least one each. multiple_choice: after the shared prefix. schema: the shared suffix.
    language_modeling: the continuation, one sequence."""
    prefix = len(os.path.commonprefix(seqs))  # of any sequences, not only strings
    ends = [len(s) for s in seqs]
    if kind == "language_modeling":  # seqs: the context alone, and with its continuation
        return seqs[1:], [min(prefix, ends[1] - 1)], ends[1:]
    if kind == "multiple_choice":
        return seqs, [min(prefix, e - 1) for e in ends], ends
    suffix = max(1, len(os.path.commonprefix([s[::-1] for s in seqs])))
    return seqs, [max(1, e - suffix) for e in ends], ends


@torch.no_grad()
def score_item(model, tokenizer, task: Task, idx: int, device, dtype: str) -> bool:
    """Whether the model gets item idx of task right: the option with the lowest mean loss over
    its scored tokens is gold, or greedy decoding reproduces the whole continuation."""
    item = task.items[idx]
    prompts = render(task, item, fewshot(task.items, idx, task.shots) if task.shots else [])
    seqs, starts, ends = spans(task.kind, tokenizer.encode(prompts, prepend_bos=True))
    # over the window: the first tokens go (the scored ones are last), but one of context stays
    cuts = [max(0, len(s) - model.config.sequence_len) for s in seqs]
    seqs = [s[c:] for s, c in zip(seqs, cuts)]
    starts = [max(1, a - c) for a, c in zip(starts, cuts)]
    ends = [b - c for b, c in zip(ends, cuts)]
    x = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True,
                                        padding_value=tokenizer.bos_id).to(device)
    with autocast(device, dtype):
        logits = model(x)
    if task.kind == "language_modeling":
        a, b = starts[0], ends[0]
        return bool((logits[0, a - 1:b - 1].argmax(-1) == x[0, a:b]).all())
    losses = [F.cross_entropy(logits[i, a - 1:b - 1].float(), x[i, a:b]).item()
              for i, (a, b) in enumerate(zip(starts, ends))]
    return losses.index(min(losses)) == item["gold"]


def evaluate_task(model, tokenizer, task: Task, device, dtype: str = "auto") -> float:
    """Accuracy over the task's items, which the ranks share (rank r takes r, r + N, ...)."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    right = torch.zeros(len(task.items), dtype=torch.float32, device=device)
    tick, t0, mine = every(PROGRESS_S), time.perf_counter(), range(rank, len(task.items), world)
    for done, idx in enumerate(mine, 1):
        right[idx] = float(score_item(model, tokenizer, task, idx, device, dtype))
        if tick():  # rank 0's share, as the others pace alike
            left = (time.perf_counter() - t0) / done * (len(mine) - done)
            print0(f"CORE {task.label}: {done:,} of {len(mine):,} items on this rank, "
                   f"~{left / 60:.1f} min left for the task")
    if distributed:
        dist.all_reduce(right)
    return right.sum().item() / len(task.items)


def evaluate_core(model, tokenizer, tasks: list[Task], device, dtype: str = "auto") -> dict:
    """{'core': mean centered accuracy, 'tasks': {label: {kind, shots, items, accuracy, baseline,
    centered, seconds}}}, printing a line per task."""
    out = {}
    for task in tasks:
        t0 = time.perf_counter()
        acc = evaluate_task(model, tokenizer, task, device, dtype)
        chance = 0.01 * task.baseline  # centered: chance is 0, perfect is 1
        row = out[task.label] = dict(kind=task.kind, shots=task.shots, items=len(task.items),
                                     accuracy=acc, baseline=task.baseline,
                                     centered=(acc - chance) / (1.0 - chance),
                                     seconds=time.perf_counter() - t0)
        print0(f"CORE {task.label:<34} {task.kind:<17} {task.shots:>2}-shot {len(task.items):>6} "
               f"items: accuracy {acc:.4f}, centered {row['centered']:+.4f}, "
               f"{row['seconds']:.1f} s")
    return dict(core=math.fsum(r["centered"] for r in out.values()) / len(out), tasks=out)


def headline(core: float, hours: float | None, tasks: int, max_per_task: int | None) -> str:
    """The speedrun's line: 'time to GPT-2: CORE X at H h' past GPT-2's CORE, else 'not reached'."""
    when = "?" if hours is None else f"{hours:.2f}"
    line = (f"time to GPT-2: CORE {core:.4f} at {when} h (GPT-2: {GPT2_CORE:.4f})"
            if core > GPT2_CORE else f"not reached: CORE {core:.4f} after {when} h")
    partial = ([f"{tasks} of {CORE_TASKS} tasks"] if tasks != CORE_TASKS else []) + (
        [f"at most {max_per_task} items per task"] if max_per_task else [])
    return line + (f" ({', '.join(partial)}: not comparable with the leaderboard)"
                   if partial else "")
