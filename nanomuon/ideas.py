"""
Ideas that live outside the library, and what a variant's settings are by value.

A file of the user's own (`--ideas my_ideas.py`, for base_train and ablate) registers stages and
variants by adding to the registries: `from nanomuon.variants import OPTIMIZER_VARIANTS`, then
`OPTIMIZER_VARIANTS["mine"] = Variant(...)` (stages: nanomuon.stages' PRECONDITIONERS, ... and
MUON_OPTIONS; kinds of update: nanomuon.kinds.KINDS). load() runs it as the user's code and
records which variants it defined or changed: only their runs load the file and are keyed by its
contents, so editing it re-runs those alone. A file that changes an existing stage, option or
kind changes every variant: each then counts as its.

settings_key() is a variant's settings by value (a function or class by its qualified name, source,
defaults and closure), never by a memory address, so a cache can key runs by them.
with_options() is a variant with fields set by their paths (base_train --variant-option KEY=VALUE):
what ablate sweeps to tune one variant's own settings.
"""

import ast
import functools
import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import NamedTuple

from nanomuon import kinds, stages
from nanomuon.arch import Variant
from nanomuon.common import shown
from nanomuon.gpt import GPT, config_from_depth
from nanomuon.recipe import PeakLRs
from nanomuon.variants import OPTIMIZER_VARIANTS


class Ideas(NamedTuple):
    """A loaded ideas file: its path, a hash of it and the user modules it imported (`files`), and
    the variants it defined or changed (their runs load it)."""
    path: Path
    digest: str
    variants: frozenset
    files: tuple


LOADED: dict[Path, Ideas] = {}  # a file loads once per process: a second run would re-register
PLAIN = (type(None), bool, int, float, str)


def settings_key(obj):
    """obj as JSON by value: containers through, a function or class by its module, qualified name
    and source (with a function's defaults and closure), other objects by type and attributes."""
    if isinstance(obj, PLAIN):
        return obj
    if isinstance(obj, dict):
        return {"dict": sorted([str(settings_key(k)), settings_key(v)] for k, v in obj.items())}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [settings_key(v) for v in obj]
        return {type(obj).__name__: sorted(items, key=repr) if isinstance(obj, (set, frozenset))
                else items}
    if isinstance(obj, functools.partial):
        return {"partial": [settings_key(obj.func), settings_key(obj.args),
                            settings_key(obj.keywords)]}
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj):
        code = getattr(obj, "__code__", None)
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):  # no file (exec'd): the bytecode and constants stand in
            source = repr(code and (code.co_code, code.co_consts, code.co_names))
        cells = [c.cell_contents for c in getattr(obj, "__closure__", None) or ()]
        return {"code": f"{obj.__module__}.{obj.__qualname__}", "source": source,
                "defaults": settings_key([getattr(obj, "__defaults__", None),
                                          getattr(obj, "__kwdefaults__", None), cells])}
    if callable(obj) and not hasattr(obj, "__dict__"):  # a builtin: torch's version keys it
        return {"builtin": f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', obj)}"}
    if hasattr(obj, "__dict__"):
        return {"object": settings_key(type(obj)), "state": settings_key(vars(obj))}
    if " at 0x" in (shown := repr(obj)):
        raise ValueError(f"{type(obj).__qualname__} {shown[:80]} has no value to key a run by (its "
                         "repr holds a memory address); give a function, a class or plain data")
    return {"repr": f"{type(obj).__module__}.{type(obj).__qualname__} {shown}"}


def registries() -> dict:
    """What an ideas file may add to: the variants, each stage registry, the Muon options and the
    kinds of update (kinds.KINDS)."""
    return {"variants": OPTIMIZER_VARIANTS, "options": stages.MUON_OPTIONS, "kinds": kinds.KINDS,
            **{f"stages {key}": reg for key, reg in stages.STAGE_KEYS.items()}}


def snapshot() -> dict:
    """Each registry entry: a variant (a dict, changed in place) by value, a stage or an option
    (immutable tuples, replaced to change) as itself, kept so its identity stays its own."""
    return {(where, name): settings_key(v) if where == "variants" else v
            for where, reg in registries().items() for name, v in reg.items()}


def user_files(names) -> list[Path]:
    """The files of modules in `names` outside the library and Python's own (its prefixes)."""
    skip = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    skip.add(Path(__file__).resolve().parent)
    files = [Path(f).resolve() for n in names if (f := getattr(sys.modules[n], "__file__", None))]
    return sorted(f for f in files if f.is_file() and not any(f.is_relative_to(s) for s in skip))


def load(path: str) -> Ideas:
    """Run the ideas file at path as the user's code, once, saying so in a line; ValueError: no
    such file."""
    p = Path(path)
    if not p.is_file():
        what = "not a regular file" if p.exists() else "no such file"
        raise ValueError(f"--ideas {shown(str(path), 300, quote=False)}: {what}; name a Python "
                         "file that registers your stages and variants")
    if (resolved := p.resolve()) in LOADED:
        return LOADED[resolved]
    before, modules = snapshot(), set(sys.modules)
    print(f"== --ideas {path}: running it as your code, to register its stages and variants",
          flush=True)
    name = f"nanomuon_ideas_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    after = snapshot()
    changed = {k for k in before.keys() | after.keys()
               if (before.get(k) != after.get(k) if k[0] == "variants" else
                   before.get(k) is not after.get(k))}
    variants = {n for where, n in changed if where == "variants" and n in OPTIMIZER_VARIANTS}
    if any(where != "variants" and (where, n) in before for where, n in changed):
        variants = set(OPTIMIZER_VARIANTS)  # an existing stage or option changed: every variant
    files = (resolved, *user_files(set(sys.modules) - modules - {name}))
    LOADED[resolved] = Ideas(resolved, digest(files), frozenset(variants), files)
    return LOADED[resolved]


def digest(files) -> str:
    """sha256 over the paths and contents of files (an ideas file and the modules it imported)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f} {hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def ideas_of(variant: str) -> list[Ideas]:
    """The loaded ideas files that defined or changed `variant`: its runs load them."""
    return [i for i in LOADED.values() if variant in i.variants]


def with_options(name: str, options: list[str] | None) -> Variant:
    """Variant `name` with each KEY=VALUE of `options` set, by its field path: a field (per_head,
    weight_decay), a Muon option by its name (precondition_frequency) or an lr (matrix_lr), or a
    dotted path into a dict field (muon_options.beta2, lrs.matrix_lr, roles.attn.proj.lr_factor:
    the role is what lies between). VALUE is a Python literal (5, 0.5, True, None, 'soap'), else
    a string."""
    variant = OPTIMIZER_VARIANTS[name]
    if not isinstance(variant, Variant):
        raise ValueError(f"OPTIMIZER_VARIANTS[{name!r}] is a {type(variant).__name__}: a variant "
                         "is a record now, Variant(muon_options=dict(...)) (nanomuon.arch)")
    for option in options or []:
        key, eq, text = option.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--variant-option {option!r}: give KEY=VALUE, like "
                             "precondition_frequency=10 or roles.mlp.fc.lr_factor=2")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            value = text.strip()
        variant = _set(variant, key.strip(), value, option)
    return variant


def _set(variant: Variant, key: str, value, option: str) -> Variant:
    """A new record with `value` at the field path `key` (a bare name: a field, an lr or a Muon
    option); the dicts on the way are copied, so the registry's record stays as it was."""
    top, *rest = key.split(".")
    if top == "schedule":  # the loop reads it from the registry, once a step
        raise ValueError(f"--variant-option {option!r}: a variant's lr schedule is not an "
                         "option; give base_train --schedule to a variant without one")
    if not rest and top not in Variant._fields:
        top, rest = "lrs" if top in PeakLRs._fields[:-1] else "muon_options", [top]
    if not rest:
        return variant._replace(**{top: value})
    if top not in ("muon_options", "lrs", "roles") or (len(rest) > 1) != (top == "roles"):
        raise ValueError(f"--variant-option {option!r}: a path goes into muon_options, lrs or "
                         "roles, one key deep; a role's key is roles.ROLE.KEY")
    inner = outer = dict(getattr(variant, top) or {})
    if top == "roles":  # a role's name holds dots: roles.attn.proj.lr_factor
        role = ".".join(rest[:-1])
        inner = outer[role] = dict(outer.get(role) or {})
    inner[rest[-1]] = value
    return variant._replace(**{top: outer})


def check_settings(variant: Variant, arch: str) -> None:
    """ValueError (or TypeError) where param_groups refuses this variant, on a tiny GPT of
    `arch`: a role, an option or a value it cannot take, said before a run builds."""
    model = GPT(config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16, arch=arch))
    model.init_weights()
    model.setup_optimizer(variant, horizon=50, compile=False)
