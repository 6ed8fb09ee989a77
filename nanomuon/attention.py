"""
Which kernel computes attention. The model calls scaled_dot_product_attention (SDPA, gpt.sdpa)
everywhere; on a Hopper GPU (compute capability 9.x) training in bf16, a faster flash attention
takes its place where one is installed, tried in this order:

- fa3: Flash Attention 3 through PyTorch's flash attention registry: activate_flash_attention_impl
  ("FA3") loads FA3's Hopper build (its flash_attn_interface module) into SDPA's flash backend;
- fa4: Flash Attention 4 (CuTe DSL; Blackwell's 10.x too) through the same registry ("FA4"), from
  PyPI's flash-attn-4 (`pip install 'nanomuon[fa4]'`);
- fa3-hub: the FA3 build nanochat loads from the Hugging Face kernel hub with the `kernels`
  package (varunneal/flash-attention-3), called in place of SDPA;
- sdpa: PyTorch's own kernels, everywhere else.

None is a dependency: each is imported only when tried, on a GPU that can run it. A choice stands
only after a forward and backward pass of the model's head shape through it (probe), so a kernel
that refuses the shape falls back here, with its reason, rather than failing at step 1.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanomuon.gpt import sdpa

CHOICES = ("auto", "fa3", "fa4", "fa3-hub", "sdpa")
# the compute capabilities (major) each kernel is built for
MAJORS = {"fa3": (9,), "fa4": (9, 10), "fa3-hub": (9,)}
REGISTRY = {"fa3": "FA3", "fa4": "FA4"}
HUB_KERNEL = "varunneal/flash-attention-3"  # nanochat's FA3 for Hopper
INSTALL = {"fa3": "build FA3 from flash-attention's hopper/ folder",
           "fa4": "pip install 'nanomuon[fa4]'", "fa3-hub": "pip install kernels"}


@dataclass(frozen=True)
class Attention:
    name: str  # one of CHOICES but auto
    why: str  # one line: what runs, and why not something faster
    # fa3-hub's call, (q, k, v) as (B, T, heads, head_dim) -> the same; None: SDPA, whose flash
    # backend is the registry's kernel where one is active
    func: Callable | None = None


def choose_attention(device: torch.device, dtype: str, heads: tuple[int, int, int],
                     want: str = "auto") -> Attention:
    """The attention `want` names, or for 'auto' the first of fa3, fa4 and fa3-hub that loads on
    this GPU and passes probe at heads = (n_head, n_kv_head, head_dim), else SDPA with the reason
    for each. A kernel asked for by name that cannot run is a ValueError with its reason."""
    if want not in CHOICES:
        raise ValueError(f"attention {want!r} is unknown; use one of {', '.join(CHOICES)}")
    if want == "sdpa":
        return Attention("sdpa", "sdpa, as asked (--attention sdpa)")
    if device.type != "cuda":
        reasons = [f"flash kernels need a CUDA GPU, this is {device.type}"]
    elif dtype != "bf16":
        reasons = ["flash kernels need bf16, this run trains in fp32"]
    else:
        reasons = []
        major, minor = torch.cuda.get_device_capability(device)
        for name in MAJORS if want == "auto" else (want,):
            if major not in MAJORS[name]:
                reasons.append(f"{name} needs compute capability "
                               f"{' or '.join(f'{m}.x' for m in MAJORS[name])}, not {major}.{minor}")
                continue
            try:
                attention = load_hub() if name == "fa3-hub" else activate(name)
                probe(attention, device, *heads)
                return attention
            except Exception as e:  # a kernel that will not load or run here: the next one
                deactivate()
                reasons.append(f"{name}: {failure(name, e)}")
    if want != "auto":
        raise ValueError(f"--attention {want} cannot run here: {'; '.join(reasons)}")
    return Attention("sdpa", f"sdpa ({'; '.join(reasons)})")


def failure(name: str, e: Exception) -> str:
    """Why a kernel did not load or run, in one line."""
    if isinstance(e, ModuleNotFoundError):
        return f"{e.name} is not installed ({INSTALL[name]})"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def activate(name: str) -> Attention:
    """The registry's kernel `name` in SDPA's flash backend, for this process."""
    from torch.nn import attention as registry

    impl = REGISTRY[name]
    if impl not in getattr(registry, "list_flash_attention_impls", list)():
        raise RuntimeError(f"torch {torch.__version__} has no {impl} in its flash attention "
                           "registry")
    registry.activate_flash_attention_impl(impl)
    return Attention(name, f"{name}: Flash Attention {impl[-1]} in SDPA's flash backend, through "
                     "torch's flash attention registry")


def deactivate() -> None:
    """SDPA's own flash kernel back, if a registry kernel is active."""
    from torch.nn import attention as registry

    if getattr(registry, "current_flash_attention_impl", lambda: None)() is not None:
        registry.restore_flash_attention_impl()


def load_hub() -> Attention:
    """nanochat's FA3 from the kernel hub (downloaded once into the Hugging Face cache)."""
    from kernels import get_kernel

    fa3 = get_kernel(HUB_KERNEL).flash_attn_interface

    def attend(q, k, v, window=None):
        if v.dtype not in (torch.bfloat16, torch.float16):  # fp32 outside autocast: no FA3
            return sdpa(q, k, v, window)
        # under autocast q and k leave their RMS norm in fp32
        out = fa3.flash_attn_func(q.to(v.dtype), k.to(v.dtype), v, causal=True,
                                  window_size=(-1 if window is None else window, 0))
        return out[0] if isinstance(out, tuple) else out  # some builds add the log-sum-exp

    return Attention("fa3-hub", f"fa3-hub: Flash Attention 3 from the kernel hub ({HUB_KERNEL}), "
                     "as nanochat loads it", attend)


def probe(attention: Attention, device: torch.device, n_head: int, n_kv_head: int,
          head_dim: int, seq_len: int = 256) -> None:
    """A causal forward and backward in bf16 of the model's head shape through `attention`; for a
    registry kernel with SDPA held to its flash backend, so what passes is what will run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(heads):
        return torch.randn(1, seq_len, heads, head_dim, device=device, dtype=torch.bfloat16,
                           requires_grad=True)

    q, k, v = make(n_head), make(n_kv_head), make(n_kv_head)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = (attention.func or sdpa)(q, k, v)
    if out.shape != q.shape:
        raise RuntimeError(f"{attention.name} returned shape {tuple(out.shape)} for "
                           f"{tuple(q.shape)}")
    out.float().sum().backward()
