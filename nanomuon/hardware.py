"""
What the hardware does fast: whether bf16 matmuls beat fp32 (the rule both Newton-Schulz's 'auto'
precision and training's bf16 autocast follow) and each GPU's peak bf16 FLOP/s, for MFU. It imports
only torch, so the update math needs no other nanomuon module.
"""

import functools

import torch

# torch.cpu's probes of the CPU
CPU_BF16_FLAGS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")


@functools.cache  # keyed by the device; the CPU's flags are fixed for the life of the process
def bf16_matmuls_fast(device) -> bool:
    """Whether bf16 matmuls beat fp32 here: on CUDA and CPUs with AVX512-BF16 or AMX, not on other
    CPUs (20-100x slower) nor MPS. Hardware flags, not timing, so every rank agrees."""
    kind = torch.device(device).type
    return kind == "cuda" or kind == "cpu" and any(getattr(torch.cpu, f, lambda: False)()
                                                   for f in CPU_BF16_FLAGS)


# Dense bf16 tensor-core peak per GPU, from vendor data sheets. Most specific names first.
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("GH200", 989e12), ("H200", 989e12),
                   ("H100", 989e12), ("H800", 989e12), ("H20", 148e12), ("B200", 2250e12),
                   ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
                   ("L40", 181e12), ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12),
                   ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("V100", 125e12)]


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of this device, or None when unknown (MFU is omitted, never guessed)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)
