"""
What a process read: the source of every module it ran from outside Python's install, hashed as
it ran (not as the tree stands before or after), and what user code read that no key can hold (a
file it opened, an environment variable). scripts/__init__.py starts it before any other import
in a run ablate launches (NANOMUON_RECORD_READS=1), so the run's summary says which code produced
it (ablate's cache keys runs by that) and whether anything else decided it (then it is not cached).

How, and its limits: a module counts when Python executes its code (the `exec` audit event; its
file is hashed then, microseconds after import read it); one imported before start() is hashed at
start(). User code is a frame of a file outside the library (nanomuon/, scripts/), sys.prefix
(stdlib, site-packages) and torch.compile's caches (compile_caches): an ideas file and the
modules it reaches. Its reads are the `open` audit events (reading) and os.environ lookups made
while such a frame is on the stack, an import's own opens aside. Not seen: reads in C (an
extension's getenv or fopen), os.environb.
"""

import functools
import getpass
import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

INSTALLED = tuple({os.path.realpath(p) + os.sep
                   for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
LIBRARY = tuple(os.path.realpath(p) + os.sep
                for p in (Path(__file__).parent, Path(__file__).parents[1] / "scripts"))


def compile_caches() -> tuple[str, ...]:
    """torch.compile's caches, as torch names them (inductor's runtime.cache_dir_utils, Triton's):
    the code torch writes there is made from the library's own, hashed as it runs, and torch's
    version, which a cache key holds; it is not user code, whatever it reads."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    triton = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton")
    return tuple(os.path.realpath(p) + os.sep for p in (inductor, triton))


GENERATED = compile_caches()
SOURCES: dict[str, str] = {}  # a module's file -> sha256 of its contents as the process ran it
OUTSIDE: dict[str, str] = {}  # what user code read that no key holds -> the user file that read it
_started = []


def file_hash(path: str) -> str | None:
    """sha256 of the file at path, or None where it is gone or unreadable."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


@functools.lru_cache(maxsize=4096)
def real_file(name: str) -> str | None:
    """A code object's file as a real path, or None: no file ('<string>', '<frozen ...>')."""
    return os.path.realpath(name) if os.path.isabs(name) and os.path.isfile(name) else None


@functools.lru_cache(maxsize=4096)
def is_user(name: str) -> bool:
    """Whether a code object's file is user code: a file outside the library and the install."""
    real = real_file(name)
    return real is not None and not real.startswith(INSTALLED + LIBRARY + GENERATED)


def note_source(name: str | None) -> None:
    """Hash a module's file as it runs; one that runs again with other contents is said."""
    real = real_file(name) if isinstance(name, str) else None
    if real is None or real.startswith(INSTALLED + GENERATED):
        return
    digest = file_hash(real)
    if SOURCES.setdefault(real, digest) != digest:
        OUTSIDE[f"{real}, which changed while it ran"] = real


def user_reader() -> str | None:
    """The innermost user file on the stack, or None (also where an import is what reads)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib"):
            return None
        if is_user(name):
            return real_file(name)
        frame = frame.f_back
    return None


def reading(path, mode, flags) -> bool:
    """Whether an `open` audit event reads a named file (not a write, not a descriptor)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    if mode is None:  # os.open: its flags say
        return (flags & os.O_ACCMODE) != os.O_WRONLY
    return "r" in mode or "+" in mode


def hook(event: str, args: tuple) -> None:
    """The audit hook: a module's code as it runs, and a file user code opens to read."""
    if event == "exec" and getattr(args[0], "co_name", None) == "<module>":
        note_source(args[0].co_filename)
    elif event == "open" and reading(*args) and (who := user_reader()):
        OUTSIDE.setdefault(f"the file {os.path.realpath(os.fsdecode(args[0]))}", who)


class WatchedEnviron(type(os.environ)):
    """os.environ, noting each variable user code reads (os.getenv and `in` come here too)."""

    def __getitem__(self, key):
        if who := user_reader():
            OUTSIDE.setdefault(f"the environment variable {key}", who)
        return super().__getitem__(key)

    def __iter__(self):
        if who := user_reader():
            OUTSIDE.setdefault("the whole environment", who)
        return super().__iter__()


def start() -> None:
    """Record from now on (once a process): the modules already run are hashed now."""
    if _started:
        return
    _started.append(True)
    for module in list(sys.modules.values()):
        note_source(getattr(module, "__file__", None))
    sys.addaudithook(hook)
    os.environ.__class__ = WatchedEnviron


def record() -> dict | None:
    """What this process read so far: sources, file -> sha256; outside, 'what (read by FILE)' for
    each read no key holds (a module's own file read again, a traceback's say, is not one). None
    where start() was not called."""
    if not _started:
        return None
    for module in list(sys.modules.values()):  # not executed as Python code: an extension's
        if (name := getattr(module, "__file__", None)) and real_file(name) not in SOURCES:
            note_source(name)
    outside = [f"{what} (read by {who})" for what, who in OUTSIDE.items()
               if what.removeprefix("the file ") not in SOURCES]
    return dict(sources=dict(sorted(SOURCES.items())), outside=sorted(outside))


def changed(sources: dict) -> list[str]:
    """The files of `sources` (a record's) whose contents are not those it ran, or are gone."""
    return [path for path, digest in sources.items() if file_hash(path) != digest]
