"""
Which kernel computes attention. The model calls SDPA (gpt.sdpa); on a Hopper GPU training in bf16
a faster flash attention takes its place where one is installed, tried in this order:

- fa3: Flash Attention 3 in SDPA's flash backend through torch's flash attention registry
  (activate_flash_attention_impl("FA3"), FA3's Hopper build);
- fa4: Flash Attention 4 (Blackwell's 10.x too) the same way, from `pip install 'nanomuon[fa4]'`;
- fa3-hub: nanochat's FA3 from the Hugging Face kernel hub (`kernels`), called in SDPA's place;
- sdpa: PyTorch's own kernels, everywhere else.

None is a dependency. A choice stands only after a forward and backward of the model's head shape
(probe), so a kernel that refuses the shape falls back here, with its reason, not at step 1.

Sliding windows (arch 'nanochat'): SDPA takes a window only as a mask, which rules out its flash
backend and computes all T x T scores, so windowed layers go through:
- fa3, fa4: varlen_attn's window_size, which reaches the registry kernel (SDPA's flash call takes
  no window); a torch whose varlen_attn takes none passes them over;
- fa3-hub: FA3's own window_size;
- flex: on CUDA without those (or in fp32), compiled flex_attention with a sliding-window BlockMask;
- chunked: off CUDA, SDPA over chunks of queries, each against its own and the previous chunk's
  keys: about half the masked SDPA's scores (flex_attention has no CPU backward).
SDPA with the window as a mask is the last resort, or what --attention sdpa asks for.
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanomuon.gpt import sdpa

CHOICES = ("auto", "fa3", "fa4", "fa3-hub", "flex", "chunked", "sdpa")
FLASH = ("fa3", "fa4", "fa3-hub")
# the compute capabilities (major) each kernel is built for
MAJORS = {"fa3": (9,), "fa4": (9, 10), "fa3-hub": (9,)}
REGISTRY = {"fa3": "FA3", "fa4": "FA4"}
HUB_KERNEL = "varunneal/flash-attention-3"  # nanochat's FA3 for Hopper
# its commit, as the datasets' revisions are pinned: the code it runs never changes under a run.
# nanochat 92d63d4 pins none; this is the commit public code pins it at (the default of sglang's
# diffusion benchmark's LIGHTX2V_FA3_HF_REVISION, and a nanochat finalist validator's
# PINNED_KERNEL_REVISIONS)
HUB_REVISION = "de87b9b5af06dd9984df595bef90b2eba44b181a"
INSTALL = {"fa3": "build FA3 from flash-attention's hopper/ folder",
           "fa4": "pip install 'nanomuon[fa4]'", "fa3-hub": "pip install kernels"}
# the fewest queries in a chunk: smaller chunks cost more calls than they save
CHUNK_MIN = 64


@dataclass(frozen=True)
class Attention:
    name: str  # one of CHOICES but auto
    why: str  # one line: what runs, and why not something faster
    # what replaces gpt.sdpa, with its arguments; None: SDPA (the registry's kernel where active)
    func: Callable | None = None


class Unsupported(RuntimeError):
    """A kernel that cannot run this model here, said in words."""


def choose_attention(device: torch.device, dtype: str, heads: tuple[int, int, int],
                     want: str = "auto", windowed: bool = False) -> Attention:
    """The attention `want` names, or for 'auto' the first flash kernel that loads and passes probe
    at heads = (n_head, n_kv_head, head_dim), else SDPA with each reason. windowed: the model has
    sliding-window layers (without flash: flex on CUDA, chunked elsewhere). A kernel named that
    cannot run is a ValueError with its reason."""
    if want not in CHOICES:
        raise ValueError(f"attention {want!r} is unknown; use one of {', '.join(CHOICES)}")
    if want == "sdpa":
        return Attention("sdpa", "sdpa, as asked (--attention sdpa)")
    reasons = []
    if want in ("auto", *FLASH):
        attention, reasons = first_flash(device, dtype, heads, want, windowed)
        if attention is not None:
            return attention
        if want != "auto":
            raise ValueError(f"--attention {want} cannot run here: {'; '.join(reasons)}")
        if not windowed:
            return Attention("sdpa", f"sdpa ({'; '.join(reasons)})")
    name = want if want != "auto" else "flex" if device.type == "cuda" else "chunked"
    return windows_without_flash(name, device, dtype, heads, reasons, asked=want != "auto")


def first_flash(device: torch.device, dtype: str, heads: tuple[int, int, int], want: str,
                windowed: bool) -> tuple[Attention | None, list[str]]:
    """The first flash kernel (`want`, or any for 'auto') passing probe, or None; and why not."""
    if device.type != "cuda":
        return None, [f"flash kernels need a CUDA GPU, this is {device.type}"]
    if dtype != "bf16":
        return None, ["flash kernels need bf16, this run trains in fp32"]
    reasons = []
    major, minor = torch.cuda.get_device_capability(device)
    for name in FLASH if want == "auto" else (want,):
        if major not in MAJORS[name]:
            reasons.append(f"{name} needs compute capability "
                           f"{' or '.join(f'{m}.x' for m in MAJORS[name])}, not {major}.{minor}")
            continue
        try:
            attention = load_hub() if name == "fa3-hub" else activate(name, windowed)
            probe(attention, device, *heads, windows=(None, 128) if windowed else (None,))
            return attention, reasons
        except Exception as e:  # a kernel that will not load or run here: the next one
            deactivate()
            reasons.append(f"{name}: {failure(name, e)}")
    return None, reasons


def windows_without_flash(name: str, device: torch.device, dtype: str,
                          heads: tuple[int, int, int], reasons: list[str],
                          asked: bool) -> Attention:
    """flex (probed) or chunked for a windowed model no flash kernel runs; flex that cannot run
    leaves SDPA with the window as a mask, or a ValueError if asked."""
    behind = f" ({'; '.join(reasons)})" if reasons else ""
    if name == "chunked":
        return Attention("chunked", "chunked: windowed layers as SDPA over chunks of queries, each "
                         "against its own and the previous chunk's keys, not the whole context"
                         f"{behind}", chunked_attend)
    try:
        if device.type != "cuda":
            raise Unsupported(f"flex_attention has no backward on {device.type} in torch "
                              f"{torch.__version__}; it trains on a CUDA GPU")
        attention = Attention("flex", "flex: windowed layers through flex_attention with a "
                              f"sliding-window block mask, compiled{behind}", windowed_flex())
        probe(attention, device, *heads, windows=(128,),
              dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        return attention
    except Exception as e:
        if asked:
            raise ValueError(f"--attention flex cannot run here: {failure('flex', e)}") from e
        reasons = [*reasons, f"flex: {failure('flex', e)}"]
    return Attention("sdpa", f"sdpa, windows as a mask ({'; '.join(reasons)})")


def failure(name: str, e: Exception) -> str:
    """Why a kernel did not load or run, in one line."""
    if isinstance(e, Unsupported):
        return str(e)
    if isinstance(e, ModuleNotFoundError):
        return f"{e.name} is not installed" + (f" ({INSTALL[name]})" if name in INSTALL else "")
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def activate(name: str, windowed: bool = False) -> Attention:
    """The registry's kernel `name` in SDPA's flash backend; windowed: also registry_attend."""
    from torch.nn import attention as registry

    impl = REGISTRY[name]
    if impl not in getattr(registry, "list_flash_attention_impls", list)():
        raise RuntimeError(f"torch {torch.__version__} has no {impl} in its flash attention "
                           "registry")
    if windowed and not varlen_windows():
        raise Unsupported(f"torch {torch.__version__} reaches it through SDPA only, which takes a "
                          "window as a mask that rules out the flash backend (its varlen_attn "
                          "has no window_size)")
    registry.activate_flash_attention_impl(impl)
    why = (f"{name}: Flash Attention {impl[-1]} in SDPA's flash backend, through torch's flash "
           "attention registry")
    if not windowed:
        return Attention(name, why)
    return Attention(name, why + "; its windows through varlen_attn's window_size (SDPA's flash "
                     "call takes none)", registry_attend)


def deactivate() -> None:
    """SDPA's own flash kernel back, if a registry kernel is active."""
    from torch.nn import attention as registry

    if getattr(registry, "current_flash_attention_impl", lambda: None)() is not None:
        registry.restore_flash_attention_impl()


def load_hub() -> Attention:
    """nanochat's FA3 from the kernel hub at HUB_REVISION (downloaded once)."""
    from kernels import get_kernel

    fa3 = get_kernel(HUB_KERNEL, revision=HUB_REVISION).flash_attn_interface

    def attend(q, k, v, window=None):
        qkv = half(q, k, v)
        if qkv is None:  # fp32 outside autocast: no FA3
            return sdpa(q, k, v, window)
        out = fa3.flash_attn_func(*qkv, causal=True,
                                  window_size=(-1 if window is None else window, 0))
        return out[0] if isinstance(out, tuple) else out  # some builds add the log-sum-exp

    return Attention("fa3-hub", f"fa3-hub: Flash Attention 3 from the kernel hub ({HUB_KERNEL} "
                     f"at {HUB_REVISION[:12]}), as nanochat loads it", attend)


def probe(attention: Attention, device: torch.device, n_head: int, n_kv_head: int,
          head_dim: int, windows: tuple = (None,), dtype: torch.dtype = torch.bfloat16) -> None:
    """A causal forward and backward of the model's head shape through `attention` per window, SDPA
    held to its flash backend, so that what passes is what will run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for window in windows:  # 256 tokens: the 128-token window probed cuts them
        q, k, v = (torch.randn(1, 256, h, head_dim, device=device, dtype=dtype,
                               requires_grad=True) for h in (n_head, n_kv_head, n_kv_head))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = (attention.func or sdpa)(q, k, v, window)
        if out.shape != q.shape:
            raise RuntimeError(f"{attention.name} returned shape {tuple(out.shape)} for "
                               f"{tuple(q.shape)}")
        out.float().sum().backward()


def half(q, k, v) -> tuple | None:
    """q, k and v in autocast's 16-bit dtype (else v's; None for fp32): they can arrive in fp32,
    and autocast does not cast a kernel it does not know."""
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else v.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return q.to(dtype), k.to(dtype), v.to(dtype)


def cuts(window: int | None, T: int) -> bool:
    """Whether a window hides some of a T-token causal context."""
    return window is not None and window < T - 1


# The windowed kernels take gpt.sdpa's arguments and send a layer without a window to SDPA.


def varlen_windows() -> bool:
    """Whether this torch's varlen_attn (to the registry's kernel) takes a window and GQA."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return {"window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters)


def registry_attend(q, k, v, window=None):
    """A window through the registry's kernel (varlen_attn); the rest and fp32 through SDPA."""
    from torch.nn.attention import varlen

    B, T, H, D = q.shape
    qkv = half(q, k, v) if cuts(window, T) else None
    if qkv is None:
        return sdpa(q, k, v, window)
    starts = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    q, k, v = (x.reshape(B * T, x.size(2), D) for x in qkv)
    out = varlen.varlen_attn(q, k, v, starts, starts, T, T, window_size=(window, 0),
                             enable_gqa=k.size(1) != H)
    return out.view(B, T, H, D)


def windowed_flex(compiled: bool = True) -> Callable:
    """A window through flex_attention with window_block_mask, compiled (uncompiled it
    materializes every score: for tests); a compiled model traces into it."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention) if compiled else flex_attention

    def attend(q, k, v, window=None):
        T = q.size(1)
        if not cuts(window, T):
            return sdpa(q, k, v, window)
        q, k, v = half(q, k, v) or (q, k, v)  # fp32 outside autocast: as they are
        out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                   block_mask=window_block_mask(T, window, q.device),
                   enable_gqa=k.size(2) != q.size(2))
        return out.transpose(1, 2)

    return attend


def cached_unless_compiling(make):
    """make, cached in eager runs; compiled, made in the graph (no cache reads while tracing)."""
    cached = functools.lru_cache(maxsize=64)(make)

    def get(*args):
        return make(*args) if torch.compiler.is_compiling() else cached(*args)
    return get


def make_block_mask(T: int, window: int, device: torch.device):
    """flex_attention's BlockMask for query i seeing keys i - window .. i."""
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding(b, h, q, k):
        return (k <= q) & (q - k <= window)

    return create_block_mask(sliding, None, None, T, T, device=device)


window_block_mask = cached_unless_compiling(make_block_mask)


def chunked_attend(q, k, v, window=None):
    """A window as SDPA over chunks of c = max(window, CHUNK_MIN) queries, each against its own
    and the previous chunk's keys (chunk_mask): 2c T scores instead of T^2. Chunks go as SDPA's
    heads, chunk by chunk, so that GQA pairs each with its own."""
    B, T, H, D = q.shape
    c = max(window or 0, CHUNK_MIN)
    if not cuts(window, T) or 2 * c >= T:  # two chunks or fewer: no scores to save
        return sdpa(q, k, v, window)
    n, Hk = -(-T // c), k.size(2)
    pad = n * c - T

    def chunks(x):  # (B, T, h, D) -> (B, n, h, c, D)
        x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
        return x.reshape(B, n, c, x.size(2), D).transpose(2, 3)

    def pairs(x):  # (B, n, h, 2c, D): the chunk before (zeros for the first), then the chunk
        x = chunks(x)
        return torch.cat([F.pad(x[:, :-1], (0, 0, 0, 0, 0, 0, 1, 0)), x], dim=3)

    y = F.scaled_dot_product_attention(
        chunks(q).reshape(B, n * H, c, D), pairs(k).reshape(B, n * Hk, 2 * c, D),
        pairs(v).reshape(B, n * Hk, 2 * c, D), attn_mask=chunk_mask(n, c, window, H, q.device),
        enable_gqa=Hk != H)
    return y.view(B, n, H, c, D).transpose(2, 3).reshape(B, n * c, H, D)[:, :T]


def make_chunk_mask(n: int, c: int, window: int, heads: int, device: torch.device):
    """chunked_attend's (1, n * heads, c, 2c) bool mask: query a of chunk j (token jc + a) sees key
    b of its pair (token (j - 1)c + b) when 0 <= a + c - b <= window and the key is no padding."""
    a = torch.arange(c, device=device)[:, None]
    b = torch.arange(2 * c, device=device)
    behind = a + c - b
    padding = (torch.arange(n, device=device) == 0)[:, None, None] & (b < c)
    seen = (behind >= 0) & (behind <= window) & ~padding  # (n, c, 2c)
    return seen[:, None].expand(n, heads, c, 2 * c).reshape(1, n * heads, c, 2 * c)


chunk_mask = cached_unless_compiling(make_chunk_mask)
