"""
The CORE metric (nanomuon/core_eval.py) on a bundle the tests write in nanochat's layout (core.yaml,
eval_meta_data.csv, eval_data/*.jsonl in llm-foundry's item formats), scored by a stub model whose
answers are known by construction: a character-level tokenizer and a bigram model that predicts one
next character per character. Expected accuracies and centered scores are worked out by hand below,
not by the code under test. Also: the prompt layouts, the zip member and path checks, the base dir's
recorded sha256, the offline error, and base_eval's report, summary.json and skip note.
"""

import contextlib
import csv
import io
import json
import os
import random
import re
import signal
import time
import urllib.error
import zipfile
from fractions import Fraction

import pytest
import torch
from test_train import TINY

import nanomuon.core_eval as core_eval
from nanomuon.core_eval import (
    Bundle,
    Task,
    evaluate_core,
    fewshot,
    find_bundle,
    headline,
    load_tasks,
    render,
)

# The stub model predicts, after character c, NEXT.get(c, c) (repeat by default), with logit 10.
NEXT = {" ": "k", ":": " ", "z": " "}

# multiple_choice, delimiter "\nAnswer: ": after " " comes "k", then "k" repeats, so a choice of
# only k's has the lowest loss; any other first letter or change costs. 3 of 4 right.
MC = [dict(query="Which is best?", choices=["kkkk", "abcd"], gold=0),
      dict(query="Pick one.", choices=["xyzw", "kkkk", "kkab"], gold=1),
      dict(query="Again?", choices=["abab", "cdcd", "kkkk", "efef"], gold=2),
      dict(query="Wrong on purpose.", choices=["kkkk", "abcd"], gold=1)]
# schema, delimiter " ": the scored tokens are " " + continuation; " " is cheap only after "z",
# so the context ending in z wins. 2 of 3 right.
SCHEMA = [dict(context_options=["It was z", "It was y"], continuation="done.", gold=0),
          dict(context_options=["So y", "So z"], continuation="fine.", gold=1),
          dict(context_options=["Then z", "Then y"], continuation="ok.", gold=1)]
# language_modeling, delimiter "\nAnswer: ": ':' -> ' ' -> 'k' -> 'k'..., so greedy decoding
# reproduces "kkk" only. 1 of 3 right.
LM = [dict(context="Say it ", continuation="kkk"),
      dict(context="Say it again", continuation="kkj"),
      dict(context=" Or not", continuation="jjj")]
BASELINES = {"mc_task": 25, "schema_task": 50, "lm_task": 0}
ACCURACY = {"mc_task": Fraction(3, 4), "schema_task": Fraction(2, 3), "lm_task": Fraction(1, 3)}
# (acc - b) / (1 - b), b = baseline / 100, by hand: (3/4 - 1/4) / (3/4) = 2/3,
# (2/3 - 1/2) / (1/2) = 1/3, (1/3 - 0) / 1 = 1/3; CORE = (2/3 + 1/3 + 1/3) / 3 = 4/9
CENTERED = {"mc_task": Fraction(2, 3), "schema_task": Fraction(1, 3), "lm_task": Fraction(1, 3)}
CORE = Fraction(4, 9)

CORE_YAML = """\
icl_tasks:
-
  label: mc_task
  dataset_uri: world_knowledge/mc.jsonl
  num_fewshot: [2]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: "
-
  label: schema_task
  dataset_uri: language_understanding/schema.jsonl
  num_fewshot: [0]
  icl_task_type: schema
-
  label: lm_task
  dataset_uri: world_knowledge/lm.jsonl
  num_fewshot: [1]
  icl_task_type: language_modeling
  continuation_delimiter: "\\nAnswer: "
  has_categories: true
"""


def bundle_files() -> dict:
    """{relative name: bytes} of the fixture bundle, as nanochat's eval_bundle/ holds them."""
    meta = io.StringIO()
    w = csv.writer(meta)
    w.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints",
                "Random baseline", "Centered Metric?", "Description"])
    for label, b in BASELINES.items():
        w.writerow([label, "test", "test", 0, 3, b, "", "a task, for the tests"])
    lines = lambda items: "".join(json.dumps(i) + "\n" for i in items).encode()
    return {"core.yaml": CORE_YAML.encode(), "eval_meta_data.csv": meta.getvalue().encode(),
            "eval_data/world_knowledge/mc.jsonl": lines(MC),
            "eval_data/language_understanding/schema.jsonl": lines(SCHEMA),
            "eval_data/world_knowledge/lm.jsonl": lines(LM)}


def write_folder(d, files=None):
    for name, data in (files or bundle_files()).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return d


def write_zip(path, files=None, prefix="eval_bundle/"):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in (files or bundle_files()).items():
            z.writestr(prefix + name, data)
    return path


class CharTokenizer:
    bos_id = 0

    def encode(self, texts, prepend_bos=False):
        assert all(0 < ord(c) < 128 for t in texts for c in t)
        return [[0] * prepend_bos + [ord(c) for c in t] for t in texts]


class BigramStub(torch.nn.Module):
    def __init__(self, sequence_len=4096):
        super().__init__()
        self.config = type("Config", (), {"sequence_len": sequence_len})()
        table = torch.arange(128)
        for a, b in NEXT.items():
            table[ord(a)] = ord(b)
        self.register_buffer("table", table)

    def forward(self, x):
        assert x.size(1) <= self.config.sequence_len
        return 10.0 * torch.nn.functional.one_hot(self.table[x], 128).float()


def run_core(bundle_path, sequence_len=4096, max_per_task=None):
    tasks = load_tasks(Bundle(bundle_path), max_per_task)
    return evaluate_core(BigramStub(sequence_len), CharTokenizer(), tasks, torch.device("cpu"))


def check_scores(result):
    assert list(result["tasks"]) == ["mc_task", "schema_task", "lm_task"]
    for label, row in result["tasks"].items():
        assert row["accuracy"] == pytest.approx(float(ACCURACY[label]), abs=1e-9), label
        assert row["centered"] == pytest.approx(float(CENTERED[label]), abs=1e-9), label
        assert row["baseline"] == BASELINES[label]
    assert result["core"] == pytest.approx(float(CORE), abs=1e-9)


# -- the metric ------------------------------------------------------------------------------------
def test_each_kind_and_the_centering_against_hand_worked_values(tmp_path):
    check_scores(run_core(write_folder(tmp_path)))
    check_scores(run_core(write_zip(tmp_path / "b.zip")))
    check_scores(run_core(write_zip(tmp_path / "flat.zip", prefix="")))


def test_prompts_cut_to_the_window_keep_their_scores(tmp_path):
    """Few-shot prompts longer than the model's window lose their start, not the scored end."""
    result = run_core(write_folder(tmp_path), sequence_len=12)
    check_scores(result)


def test_max_per_task_takes_the_first_items_after_the_seeded_shuffle(tmp_path):
    tasks = load_tasks(Bundle(write_folder(tmp_path)), max_per_task=2)
    assert [len(t.items) for t in tasks] == [2, 2, 2]
    full = load_tasks(Bundle(tmp_path))
    assert [t.items[:2] for t in full] == [t.items for t in tasks]
    assert sorted(map(json.dumps, full[0].items)) == sorted(map(json.dumps, MC))


def test_prompt_layouts():
    """llm-foundry's layout as nanochat renders it: example, delimiter, answer, blank line."""
    mc = Task("m", "multiple_choice", 1, "\nAnswer: ", 25, MC, "x")
    assert render(mc, MC[0], [MC[1]]) == ["Pick one.\nAnswer: kkkk\n\nWhich is best?\nAnswer: kkkk",
                                          "Pick one.\nAnswer: kkkk\n\nWhich is best?\nAnswer: abcd"]
    schema = Task("s", "schema", 1, " ", 50, SCHEMA, "x")
    assert render(schema, SCHEMA[0], [SCHEMA[1]]) == ["So z fine.\n\nIt was z done.",
                                                      "So z fine.\n\nIt was y done."]
    lm = Task("l", "language_modeling", 1, "\nAnswer: ", 0, LM, "x")
    assert render(lm, LM[2], [LM[0]]) == ["Say it\nAnswer: kkk\n\nOr not\nAnswer:",
                                          "Say it\nAnswer: kkk\n\nOr not\nAnswer: jjj"]


def test_fewshot_picks_other_items_deterministically():
    items = list(range(20))
    for idx in range(20):
        picks = fewshot(items, idx, 10)
        assert len(picks) == 10 == len(set(picks)) and idx not in picks
        assert picks == fewshot(items, idx, 10)
    assert sorted(fewshot(items[:3], 0, 10)) == [1, 2]  # fewer items than shots: all the others


def test_headline():
    assert headline(0.2601, 1.6549, 22, None) == ("time to GPT-2: CORE 0.2601 at 1.65 h "
                                                  "(GPT-2: 0.2565)")
    assert headline(0.25, 2.0, 22, None) == "not reached: CORE 0.2500 after 2.00 h"
    assert headline(0.01, None, 19, 50) == ("not reached: CORE 0.0100 after ? h (19 of 22 tasks, "
                                            "at most 50 items per task: not comparable with the "
                                            "leaderboard)")


# -- untrusted bundles -----------------------------------------------------------------------------
@pytest.mark.parametrize("member", ["../x", "eval_bundle/../../x", "/etc/x", "a\\..\\x", "C:x"])
def test_a_zip_member_leaving_the_bundle_refuses_the_zip(tmp_path, member):
    path = write_zip(tmp_path / "b.zip")
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(member, b"x")
    with pytest.raises(ValueError, match="holds a member .*refusing the whole zip"):
        Bundle(path)


def test_a_dataset_path_leaving_the_bundle_is_refused(tmp_path):
    files = bundle_files()
    files["core.yaml"] = CORE_YAML.replace("world_knowledge/mc.jsonl", "../../secret").encode()
    for path in (write_folder(tmp_path / "d", files), write_zip(tmp_path / "b.zip", files)):
        with pytest.raises(ValueError, match="'../../secret' climbs out with '..'"):
            load_tasks(Bundle(path))
    # a link inside a folder bundle that leads outside it
    (tmp_path / "secret.jsonl").write_text(json.dumps(MC[0]) + "\n")
    folder = write_folder(tmp_path / "e")
    (folder / "eval_data/world_knowledge/mc.jsonl").unlink()
    os.symlink(tmp_path / "secret.jsonl", folder / "eval_data/world_knowledge/mc.jsonl")
    with pytest.raises(ValueError, match="leads outside the folder"):
        load_tasks(Bundle(folder))


@pytest.mark.parametrize("edit, message", [
    (lambda f: f.update({"eval_data/world_knowledge/mc.jsonl": b'{"query": "q", "choices": '
                         b'["a"], "gold": 0}\n'}),
     "mc.jsonl line 1: 'choices' is not a list of at least 2"),
    (lambda f: f.update({"eval_data/world_knowledge/lm.jsonl": b"not json\n"}),
     "line 1 is not JSON"),
    (lambda f: f.update({"eval_data/language_understanding/schema.jsonl": b'{"context_options": '
                         b'["a", "b"], "continuation": "c", "gold": 2}\n'}), "'gold' is 2, not an"),
    (lambda f: f.pop("eval_data/world_knowledge/lm.jsonl"), "lm.jsonl is missing"),
    (lambda f: f.update({"core.yaml": CORE_YAML.replace("schema\n", "generation\n").encode()}),
     "task 'schema_task': type 'generation' is not one of"),
    (lambda f: f.update({"eval_meta_data.csv": b"Eval Task,Random baseline\nmc_task,25\n"}),
     "no random baseline for task schema_task"),
    (lambda f: f.update({"core.yaml": b"icl_tasks: {not: a list}\n"}), "has no list of icl_tasks"),
])
def test_bad_bundle_files_are_named_in_one_line(tmp_path, edit, message):
    files = bundle_files()
    edit(files)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_tasks(Bundle(write_zip(tmp_path / "b.zip", files)))


def test_a_bundle_is_bounded_in_what_it_reads_parses_and_nests(tmp_path, monkeypatch):
    """A file many tasks list is read once; what a bundle reads in all is bounded; an item line
    over MAX_ITEM or nested past Python's recursion limit is one line of error; the items a
    --max-per-task cut drops are never parsed (a bad one among them costs nothing)."""
    from nanomuon import core_eval

    many = CORE_YAML + "".join("-\n  label: mc_task\n  dataset_uri: world_knowledge/mc.jsonl\n"
                               "  num_fewshot: [0]\n  icl_task_type: multiple_choice\n"
                               for _ in range(30))
    files = dict(bundle_files(), **{"core.yaml": many.encode()})
    size = sum(len(v) for v in files.values())
    monkeypatch.setattr(core_eval, "MAX_BUNDLE", size)  # 33 reads of mc.jsonl would pass it
    assert len(load_tasks(Bundle(write_zip(tmp_path / "many.zip", files)))) == 33
    files["eval_data/world_knowledge/lm.jsonl"] += b" " * size
    with pytest.raises(ValueError, match=r"takes it over .* MiB in all"):
        load_tasks(Bundle(write_zip(tmp_path / "big.zip", files)))
    monkeypatch.undo()
    for line, says in ((b'{"context": "' + b"x" * (core_eval.MAX_ITEM + 1) + b'"}',
                        r"is [\d,]+ bytes, over the 1024 KiB"),
                       (b"[" * 100_000 + b"]" * 100_000, r"is not JSON \(RecursionError")):
        files = dict(bundle_files(), **{"eval_data/world_knowledge/lm.jsonl": line + b"\n"})
        with pytest.raises(ValueError, match=r"lm.jsonl line 1 " + says):
            load_tasks(Bundle(write_zip(tmp_path / "bad.zip", files)))
    good = bundle_files()["eval_data/world_knowledge/lm.jsonl"].splitlines()
    kept = core_eval.read_items(Bundle(write_zip(tmp_path / "lm.zip")), "world_knowledge/lm.jsonl",
                                "language_modeling", max_per_task=1)
    order = list(range(3))
    random.Random(1337).shuffle(order)
    bad = [line if i == order[0] else b"not json" for i, line in enumerate(good)]
    files = dict(bundle_files(), **{"eval_data/world_knowledge/lm.jsonl": b"\n".join(bad)})
    assert core_eval.read_items(Bundle(write_zip(tmp_path / "cut.zip", files)),
                                "world_knowledge/lm.jsonl", "language_modeling", 1) == kept


def test_a_task_file_is_bounded_in_lines_before_it_is_split(tmp_path, monkeypatch):
    """Lines are counted as nanochat's universal newlines end them (\\n, \\r\\n, \\r; blank ones
    too) before the file is split into a list: a file over MAX_LINES is one line of error, not
    a tuple per line."""
    monkeypatch.setattr(core_eval, "MAX_LINES", 4)
    mixed = [json.dumps(i).encode() for i in LM]
    files = dict(bundle_files(), **{"eval_data/world_knowledge/lm.jsonl":
                                    mixed[0] + b"\r\n" + mixed[1] + b"\r" + mixed[2] + b"\n\n"})
    assert len(load_tasks(Bundle(write_zip(tmp_path / "four.zip", files)))[2].items) == 3
    files["eval_data/world_knowledge/lm.jsonl"] += b"\n"
    with pytest.raises(ValueError, match=r"lm.jsonl has 5 lines, over the 4 any eval task needs"):
        load_tasks(Bundle(write_zip(tmp_path / "five.zip", files)))


def test_a_file_many_tasks_list_is_split_shuffled_and_parsed_once(tmp_path, monkeypatch):
    many = CORE_YAML + "".join("-\n  label: mc_task\n  dataset_uri: world_knowledge/mc.jsonl\n"
                               "  num_fewshot: [0]\n  icl_task_type: multiple_choice\n"
                               for _ in range(30))
    bundle = Bundle(write_zip(tmp_path / "many.zip", dict(bundle_files(),
                                                         **{"core.yaml": many.encode()})))
    seeds, parsed, real_random, real_loads = [], [], random.Random, json.loads

    class Random(real_random):
        def __init__(self, seed=None):
            seeds.append(seed)
            super().__init__(seed)

    monkeypatch.setattr(core_eval.random, "Random", Random)
    monkeypatch.setattr(core_eval.json, "loads", lambda s: parsed.append(s) or real_loads(s))
    tasks = load_tasks(bundle)
    monkeypatch.undo()
    assert len(tasks) == 33 and seeds.count(1337) == 3  # one shuffle per file, not per task
    assert len(parsed) == len(MC) + len(SCHEMA) + len(LM)
    assert all(t.items == tasks[0].items for t in tasks[3:])
    check_scores(evaluate_core(BigramStub(), CharTokenizer(), tasks[:3], torch.device("cpu")))


def test_fewshot_samples_as_nanochat_does_without_listing_the_others():
    """nanochat samples from the list of the other indices; the picks are the same, item by
    item, for every task size and shot count."""
    def nanochat(items, idx, shots):
        others = [i for i in range(len(items)) if i != idx]
        return [items[i] for i in random.Random(1234 + idx).sample(others, min(shots, len(others)))]

    for n in (1, 2, 3, 21, 22, 60, 1000):
        for shots in (0, 1, 5, 6, 10, 100):
            assert all(fewshot(list(range(n)), idx, shots) == nanochat(list(range(n)), idx, shots)
                       for idx in range(0, n, max(1, n // 25)))


def test_an_item_s_options_and_prompts_are_bounded(tmp_path, monkeypatch):
    """An item has at most MAX_OPTIONS options, and its prompts (an option each, each with the
    few-shot examples) at most MAX_PROMPT characters: all are tokenized before any cropping."""
    many = dict(query="q", choices=[f"c{i}" for i in range(core_eval.MAX_OPTIONS + 1)], gold=0)
    files = dict(bundle_files(), **{"eval_data/world_knowledge/mc.jsonl":
                                    (json.dumps(many) + "\n").encode()})
    with pytest.raises(ValueError, match=r"mc.jsonl line 1: 'choices' has 101 options, over the "
                                         r"100 any item has \(a multiple_choice item\)"):
        load_tasks(Bundle(write_zip(tmp_path / "many.zip", files)))
    tasks = load_tasks(Bundle(write_zip(tmp_path / "b.zip")))
    for task in tasks:  # what render() makes, padded to the longest (lm contexts are stripped)
        for idx, item in enumerate(task.items):
            prompts = render(task, item, fewshot(task.items, idx, task.shots))
            rendered = len(prompts) * max(map(len, prompts))
            bound = core_eval.prompt_chars(task, idx)
            assert bound == rendered if task.kind != "language_modeling" else bound >= rendered
    largest = max(core_eval.prompt_chars(t, i) for t in tasks for i in range(len(t.items)))
    monkeypatch.setattr(core_eval, "MAX_PROMPT", largest)
    load_tasks(Bundle(tmp_path / "b.zip"))
    monkeypatch.setattr(core_eval, "MAX_PROMPT", largest - 1)
    with pytest.raises(ValueError, match=rf"task \w+ \(eval_data/[\w/]+.jsonl\): an item's "
                                         rf"prompts, \d-shot, come to {largest:,} characters, "
                                         r"over the [\d,]+ .*lower its num_fewshot"):
        load_tasks(Bundle(tmp_path / "b.zip"))


@pytest.mark.parametrize("name, item, message", [
    ("mc", dict(query="q", choices=["", ""], gold=0), "'choices' holds an empty option"),
    ("mc", dict(query="q", choices=["kkkk", ""], gold=0), "'choices' holds an empty option"),
    ("mc", dict(query="q", choices=["ab", "ab", "ab"], gold=1), "'choices' are all the same"),
    ("schema", dict(context_options=["", ""], continuation="c", gold=0),
     "'context_options' holds an empty option"),
    ("schema", dict(context_options=["a", "b"], continuation="", gold=0),
     "'continuation' is empty"),
    ("lm", dict(context="c", continuation=""), "'continuation' is empty")])
def test_an_item_that_would_score_whatever_the_model_says_is_refused(tmp_path, name, item,
                                                                       message):
    """Empty options leave identical prompts, which tie, and a tie goes to the first option:
    a bundle of such items scored CORE 1.0 with any model."""
    path = next(k for k in bundle_files() if k.endswith(f"/{name}.jsonl"))
    files = dict(bundle_files(), **{path: (json.dumps(item) + "\n").encode()})
    with pytest.raises(ValueError, match=rf"{name}.jsonl line 1: {message}"):
        load_tasks(Bundle(write_zip(tmp_path / "b.zip", files)))


def test_core_yaml_and_eval_meta_data_are_bounded(tmp_path):
    """Bounded in bytes before they are parsed (YAML parses at ~25 KB/s, a CSV row becomes a
    dict), and core.yaml in tasks."""
    for name, limit in (("core.yaml", core_eval.MAX_CONFIG),
                        ("eval_meta_data.csv", core_eval.MAX_META)):
        files = bundle_files()
        files[name] += (b"# " if name == "core.yaml" else b"x,1\n") * (limit // 2)
        for path in (write_zip(tmp_path / f"{name}.zip", files), write_folder(tmp_path / name,
                                                                              files)):
            with pytest.raises(ValueError, match=rf"{name} is over {limit:,} bytes, more than "
                                                 "any eval bundle's .* needs: use nanochat's"):
                load_tasks(Bundle(path))
    extra = "".join("-\n  label: mc_task\n  dataset_uri: world_knowledge/mc.jsonl\n"
                    "  num_fewshot: [0]\n  icl_task_type: multiple_choice\n"
                    for _ in range(core_eval.MAX_TASKS - 2))
    files = dict(bundle_files(), **{"core.yaml": (CORE_YAML + extra).encode()})
    with pytest.raises(ValueError, match=r"core.yaml lists 101 tasks, over the 100 an eval "
                                         r"bundle needs \(CORE has 22\)"):
        load_tasks(Bundle(write_zip(tmp_path / "tasks.zip", files)))


@contextlib.contextmanager
def no_hang(seconds: int = 30):
    """A call that waits on a FIFO fails the test instead of hanging it."""
    def stop(*_):
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_bundle_that_is_no_file_or_folder_or_a_loop_is_one_line(tmp_path):
    """A FIFO or a device as the bundle, or as a file of a folder bundle, is refused at a stat,
    never opened; a symlink loop in a folder bundle is one line, not a traceback."""
    os.mkfifo(tmp_path / "fifo")
    for path, kind in ((tmp_path / "fifo", "FIFO"), ("/dev/null", "character device"),
                       ("/dev/zero", "character device")):
        with no_hang(), pytest.raises(ValueError) as e:
            Bundle(path)
        assert str(e.value).startswith(f"CORE bundle {path} is a {kind}, not a zip file or a "
                                       "folder: use nanochat's eval_bundle.zip (the zip, or a")
        assert "place it at" not in str(e.value) and "\n" not in str(e.value)
    folder = write_folder(tmp_path / "d")
    (folder / "core.yaml").unlink()
    os.mkfifo(folder / "core.yaml")
    with no_hang(), pytest.raises(ValueError, match=r"core.yaml is a FIFO, not a file of an eval "
                                                    "bundle: use nanochat's eval_bundle.zip"):
        load_tasks(Bundle(folder))
    folder = write_folder(tmp_path / "e")
    target = folder / "eval_data/world_knowledge/mc.jsonl"
    target.unlink()
    os.symlink(folder / "loop", target)
    os.symlink(target, folder / "loop")
    with pytest.raises(ValueError, match=r"e: eval_data/world_knowledge/mc.jsonl cannot be "
                                         r"followed \(\w+Error: "):
        load_tasks(Bundle(folder))
    os.symlink(tmp_path / "loop2", tmp_path / "loop1")
    os.symlink(tmp_path / "loop1", tmp_path / "loop2")
    with pytest.raises(ValueError, match=r"loop1 cannot be read \(OSError: .*Too many levels"):
        Bundle(tmp_path / "loop1")


# -- the base dir's bundle -------------------------------------------------------------------------
@pytest.fixture
def base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMUON_BASE_DIR", str(tmp_path / "base"))
    return tmp_path / "base"


def test_a_placed_zip_is_recorded_then_checked(base_dir):
    assert find_bundle(None, fetch=False) is None
    zip_path = write_zip(base_dir / "eval_bundle.zip")
    bundle = find_bundle(None, fetch=False)
    record = json.loads((base_dir / "eval_bundle.json").read_text())
    assert record["size"] == zip_path.stat().st_size and len(record["sha256"]) == 64
    assert bundle.digest() == record["sha256"]
    check_scores(evaluate_core(BigramStub(), CharTokenizer(), load_tasks(bundle),
                               torch.device("cpu")))
    with zipfile.ZipFile(zip_path, "a") as z:
        z.writestr("eval_bundle/extra.txt", b"changed")
    with pytest.raises(ValueError, match="is not the file recorded in eval_bundle.json"):
        find_bundle(None, fetch=False)


def test_a_fifo_for_the_record_is_refused_in_one_line(base_dir):
    base_dir.mkdir()
    write_zip(base_dir / "eval_bundle.zip")
    os.mkfifo(base_dir / "eval_bundle.json")
    with no_hang(), pytest.raises(ValueError) as e:
        find_bundle(None, fetch=False)
    assert str(e.value) == (f"{base_dir / 'eval_bundle.json'} is a FIFO, not the record "
                            "nanomuon writes: delete it and eval_bundle.zip to download the "
                            "bundle again")


def test_an_unzipped_bundle_in_the_base_dir_is_found(base_dir):
    write_folder(base_dir / "eval_bundle")
    assert find_bundle(None, fetch=False).zip is None


def test_download_records_the_zip_and_offline_says_what_to_do(base_dir, tmp_path, monkeypatch):
    payload = write_zip(tmp_path / "served.zip").read_bytes()

    class Opener:
        def __init__(self, fail):
            self.fail = fail

        def open(self, url, timeout):
            assert url == core_eval.BUNDLE_URL
            if self.fail:
                raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
            return io.BytesIO(payload)

    monkeypatch.setattr(core_eval.urllib.request, "build_opener", lambda *h: Opener(True))
    with pytest.raises(ValueError) as e:
        find_bundle(None, fetch=True)
    line = str(e.value)
    assert "\n" not in line and "cannot download the CORE bundle" in line
    assert f"place it at {base_dir / 'eval_bundle.zip'}, or pass --core-bundle PATH" in line
    assert not list(base_dir.glob("eval_bundle*"))
    monkeypatch.setattr(core_eval.urllib.request, "build_opener", lambda *h: Opener(False))
    bundle = find_bundle(None, fetch=True)
    assert (base_dir / "eval_bundle.zip").read_bytes() == payload
    assert json.loads((base_dir / "eval_bundle.json").read_text())["size"] == len(payload)
    assert bundle.prefix == "eval_bundle/"


def test_redirects_to_plain_http_are_refused():
    handler = core_eval._HttpsOnly()
    with pytest.raises(urllib.error.URLError, match="not https"):
        handler.redirect_request(None, None, 302, "Found", {}, "http://example.com/eval_bundle.zip")


# -- base_eval -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(base):
    """A finished 1-step run."""
    from scripts.base_train import main

    main([*TINY, "--total-batch-size", "256", "--num-iterations", "1", "--eval-every", "-1",
          "--run", "c"])
    return base / "runs" / "c"


def base_eval(*argv):
    from scripts.base_eval import main

    return main(["--run", "c", "--device-type", "cpu", "--device-batch-size", "4",
                 "--sample-tokens", "0", *argv])


def test_base_eval_core_report_and_summary(run, tmp_path, capsys):
    bundle = write_zip(tmp_path / "b.zip")
    assert base_eval("--eval", "core", "--core-bundle", str(bundle)) is None
    out = capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    core = summary["core"]
    assert set(summary["core_tasks"]) == set(BASELINES) and summary["core_step"] == 1
    rows = summary["core_tasks"].values()
    assert core == pytest.approx(sum(r["centered"] for r in rows) / 3)
    for r in rows:
        b = r["baseline"] / 100
        assert r["centered"] == pytest.approx((r["accuracy"] - b) / (1 - b))
    section = (run / "report.md").read_text().split("## base_eval, step 1")[-1]
    first = section.strip().splitlines()[0]
    assert first == summary["core_headline"] and first.startswith("not reached: CORE")
    assert "(3 of 22 tasks: not comparable with the leaderboard)" in first
    assert all(f"| {label} |" in section for label in BASELINES)
    assert "val bpb" not in section and first in out
    # the report opens with the same line, under its title, and a second evaluation replaces it
    report = (run / "report.md").read_text().splitlines()
    assert report[0].startswith("# ") and report[1] == "> CORE: " + first
    base_eval("--eval", "core", "--core-bundle", str(bundle))
    assert sum(x.startswith("> CORE: ") for x in (run / "report.md").read_text().splitlines()) == 1


def wandb_records(path) -> list:
    """The wandb Record protobufs a .wandb file holds. The file is a LevelDB-style log (a 7-byte
    file header, 32 KiB blocks, each record a 7-byte header then data, split across blocks as
    first/middle/last pieces); wandb 0.31 ships the protobuf classes but no reader of the log."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pieces, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # still being written
            break
        pieces, pos = pieces + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pieces))
            pieces = b""
    return records


def wandb_history(path, timeout_s: float = 60.0) -> dict:
    """Every history item of a finished run's .wandb file, key -> JSON value. wandb's service
    process may still be writing the file when run.finish() returns, so this waits for the run's
    exit record (the last one it writes) before reading the history."""
    deadline = time.monotonic() + timeout_s
    records = wandb_records(path)
    while not any(r.HasField("exit") for r in records):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)
        records = wandb_records(path)
    return {"/".join([item.key, *item.nested_key]).strip("/"): item.value_json
            for r in records for item in r.history.item}


@pytest.mark.slow  # two real (offline) wandb runs: about 30 s
def test_base_eval_logs_core_into_the_training_wandb_run(base, tmp_path, monkeypatch):
    """base_train records its wandb run's id in summary.json; base_eval --wandb resumes that run
    (offline: a second offline-run dir of the same id) and logs eval/core and each task's centered
    accuracy, the values summary.json holds, into it."""
    from scripts.base_train import main

    monkeypatch.setenv("WANDB_SILENT", "true")
    main([*TINY, "--total-batch-size", "256", "--num-iterations", "1", "--eval-every", "-1",
          "--run", "cw", "--wandb", "offline"])
    run = base / "runs" / "cw"
    wandb_id = json.loads((run / "summary.json").read_text())["wandb_id"]
    bundle = write_zip(tmp_path / "b.zip")
    from scripts.base_eval import main as base_eval_main

    base_eval_main(["--run", "cw", "--device-type", "cpu", "--device-batch-size", "4",
                    "--sample-tokens", "0", "--eval", "core", "--core-bundle", str(bundle),
                    "--wandb", "offline"])
    runs = sorted((run / "wandb").glob(f"offline-run-*-{wandb_id}"))
    assert len(runs) == 2  # the training, then the evaluation resuming it
    logged = wandb_history(runs[1] / f"run-{wandb_id}.wandb")
    summary = json.loads((run / "summary.json").read_text())
    expected = {"eval/core": summary["core"]}
    expected.update({f"eval/core/{k}": t["centered"] for k, t in summary["core_tasks"].items()})
    assert len(expected) == 4 and any(abs(v) > 0.1 for v in expected.values())
    assert {k: json.loads(logged[k]) for k in expected} == expected


def test_base_eval_refuses_a_bundle_that_is_a_device_in_one_line(run):
    with no_hang(), pytest.raises(SystemExit) as e:
        base_eval("--eval", "core", "--core-bundle", "/dev/null")
    assert str(e.value).startswith("error: CORE bundle /dev/null is a character device, not a "
                                   "zip file or a folder: use nanochat's eval_bundle.zip (")
    assert "place it at" not in str(e.value) and "\n" not in str(e.value)


def test_a_fifo_for_summary_json_is_refused_before_core_is_evaluated(run, tmp_path, capsys):
    """base_eval adds CORE to summary.json after evaluating: a FIFO there stops it before, in one
    line; read for the wandb run's id, it is noted, not waited on."""
    from scripts.base_eval import training_wandb_id

    bundle = write_zip(tmp_path / "b.zip")
    summary, report = run / "summary.json", (run / "report.md").read_text()
    os.rename(summary, tmp_path / "summary.json")
    os.mkfifo(summary)
    try:
        with no_hang(120), pytest.raises(SystemExit) as e:
            base_eval("--eval", "core", "--core-bundle", str(bundle))
        assert str(e.value) == (f"error: {summary} is a FIFO, not the summary base_train writes: "
                                "remove it (base_eval adds CORE to it)")
        assert (run / "report.md").read_text() == report and "CORE" not in capsys.readouterr().out
        with no_hang():
            assert training_wandb_id(summary) is None
        assert f"note: {summary} is unreadable (ValueError: {summary} is a FIFO" in (
            capsys.readouterr().out)
    finally:
        summary.unlink()
        os.rename(tmp_path / "summary.json", summary)


def test_base_eval_without_a_bundle_skips_core_in_one_line(run, capsys):
    bpb = base_eval("--eval-tokens", "512")
    out = capsys.readouterr().out
    assert bpb > 0 and "CORE skipped: no eval bundle in" in out and "`--eval core` downloads" in out
    assert "CORE skipped" in (run / "report.md").read_text().split("## base_eval")[-1]


def test_base_eval_asked_for_core_offline_stops_in_one_line(run, monkeypatch, capsys):
    def offline(*a, **k):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(core_eval.urllib.request.OpenerDirector, "open", offline)
    with pytest.raises(SystemExit) as e:
        base_eval("--eval", "core,bpb")
    assert str(e.value).startswith("error: cannot download the CORE bundle (URLError: ")
    assert "place it at" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flag, message", [
    (["--eval", "core,loss"], "'loss' is not one of core"),
    (["--eval", ","], "name at least one of"),
    (["--max-per-task", "0"], "--max-per-task must be >= 1")])
def test_base_eval_flags(flag, message, capsys):
    with pytest.raises(SystemExit):
        base_eval(*flag)
    assert message in capsys.readouterr().err


def test_all_tasks_together_are_bounded_in_items_and_characters(tmp_path, monkeypatch):
    """A bundle whose tasks hold more items, or more prompt characters, than WORK_MULTIPLE times
    CORE's own is one line of error naming both, said as its tasks are read (before the items over
    the bound are parsed)."""
    path = write_zip(tmp_path / "b.zip")
    tasks = load_tasks(Bundle(path))
    items = sum(len(t.items) for t in tasks)
    chars = sum(core_eval.prompt_chars(t, i) for t in tasks for i in range(len(t.items)))
    monkeypatch.setattr(core_eval, "WORK_MULTIPLE", 1)
    monkeypatch.setattr(core_eval, "CORE_ITEMS", items)
    monkeypatch.setattr(core_eval, "CORE_WORK", chars)
    assert len(load_tasks(Bundle(path))) == 3  # at the bounds: accepted
    monkeypatch.setattr(core_eval, "CORE_ITEMS", items - 1)
    with pytest.raises(ValueError, match=rf"its first 3 tasks hold {items:,} items, over 1x the "
                                         rf"{items - 1:,} of CORE's 22"):
        load_tasks(Bundle(path))
    monkeypatch.setattr(core_eval, "CORE_ITEMS", items)
    monkeypatch.setattr(core_eval, "CORE_WORK", chars - 1)
    with pytest.raises(ValueError, match=rf"first 3 tasks come to {chars:,} characters, over 1x"):
        load_tasks(Bundle(path))


def many_tasks(tmp_path, name, item, lines, tasks, shots):
    """A zip whose `tasks` tasks (each `shots`-shot) all list one file of `lines` copies of item:
    it compresses to a few KB, and is read and parsed once."""
    files = bundle_files()
    files["core.yaml"] = ("icl_tasks:\n" + "".join(
        f"- {{label: t{i}, dataset_uri: many.jsonl, num_fewshot: [{shots}], "
        "icl_task_type: multiple_choice}\n" for i in range(tasks))).encode()
    files["eval_meta_data.csv"] = ("Eval Task,Random baseline\n" + "".join(
        f"t{i},50\n" for i in range(tasks))).encode()
    files["eval_data/many.jsonl"] = (json.dumps(item) + "\n").encode() * lines
    return Bundle(write_zip(tmp_path / name, files))


def test_a_small_zip_asks_at_most_twice_core_s_work(tmp_path):
    """A few-KB zip within every other bound asked hours of scoring: 190,000 tiny items (2.1x
    CORE's 91,033), or 1.4e9 characters of 10-shot prompts (2x CORE's ~7e8). Each is refused in
    one line naming its numbers and CORE's before a task over the bound is parsed."""
    tiny = dict(query="q", choices=["a", "b"], gold=0)
    with pytest.raises(ValueError, match=r"its first 4 tasks hold 190,000 items, over 2x the "
                                         r"91,033 of CORE's 22: use nanochat's eval_bundle.zip"):
        load_tasks(many_tasks(tmp_path, "items.zip", tiny, 47_500, 4, 0))
    long = dict(query="q" * 10_000, choices=["a", "b"], gold=0)  # 2 x 11 x 10 KB an item
    with pytest.raises(ValueError, match=r"prompts of its first 7 tasks come to 1,5\d\d,\d{3},\d{3} "
                                         r"characters, over 2x the ~7.0e\+08 of CORE's 22"):
        load_tasks(many_tasks(tmp_path, "chars.zip", long, 1000, 10, 10))


def test_reading_and_scoring_say_how_far_they_are(tmp_path, monkeypatch, capsys):
    """What a bundle takes long to read or score shows a line at least every PROGRESS_S seconds:
    the tasks read, and each task's items scored with the time left."""
    monkeypatch.setattr(core_eval, "PROGRESS_S", 0)
    check_scores(run_core(write_zip(tmp_path / "b.zip")))
    out = capsys.readouterr().out
    assert "CORE: read 1 of 3 tasks" in out and "CORE: read 3 of 3 tasks" in out, out
    assert re.search(r"CORE mc_task: 1 of \d+ items on this rank, ~[\d.]+ min left", out), out
