"""
fp8 matmuls for training (nanochat's --fp8) through torchao's float8 training, an optional
dependency (`pip install torchao`).

The Linears fp8_linear picks (the blocks' and lm_head, as nanochat's) become torchao's Float8Linear,
which casts input and weight to e4m3 and the output's gradient to e5m2, scaled per tensor
('tensorwise', nanochat's default) or per row ('rowwise'). The weights stay the same fp32
Parameters, so optimizer and checkpoints do not change: an fp8 run resumes, samples and exports
without --fp8. Embedding and attention stay in the run's dtype, and evaluation runs every linear
layer in it (plain_linears), so val bpb compares with a plain run's.

fp8 tensor cores need compute capability 8.9 (H100, H200, L4, RTX 40xx); on a CPU torchao emulates
them with the same rounding: for tests, not speed.
"""

import contextlib
import dataclasses
import logging
import types

import torch
import torch.nn as nn

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada and Hopper


def import_torchao():
    """torchao.float8, or one line saying how to get it. Its warnings about kernel libraries it
    cannot load (none on the float8 path) and torch's about its Enum are silenced."""
    with contextlib.ExitStack() as restore:
        for log in map(logging.getLogger, ("torchao", "torch.utils._pytree")):
            restore.callback(log.setLevel, log.level)
            log.setLevel(logging.ERROR)
        try:
            import torchao.float8 as float8
        except ImportError as e:
            raise ValueError(f"--fp8 needs torchao ({e}): `pip install torchao`, or drop --fp8") \
                from None
    return float8


def check_fp8(device: torch.device) -> None:
    """Refuse --fp8 in one line on a GPU below compute capability 8.9 (emulation is slower than
    bf16), MPS (no float8 dtypes), or without torchao."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ValueError(f"--fp8 needs fp8 tensor cores (compute capability 8.9+: H100, H200, "
                             f"L4, RTX 40xx); {name} has {capability[0]}.{capability[1]}: drop "
                             "--fp8 (bf16 autocast is the default)")
    elif device.type != "cpu":
        raise ValueError(f"--fp8 runs on CUDA (fp8 tensor cores) or the CPU (torchao's emulation), "
                         f"not {device.type}: drop --fp8")
    import_torchao()


def fp8_linear(module: nn.Module, fqn: str) -> bool:
    """Which layers go fp8: every Linear whose sizes are multiples of 16, lm_head included
    (nanochat's also skips layers under 128 wide: only toy widths have them)."""
    return (isinstance(module, nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(model: nn.Module, recipe: str, device: torch.device) -> int:
    """Swap the Linears fp8_linear picks for Float8Linear in place (before compile and FSDP),
    emulated off CUDA; how many were swapped."""
    if recipe not in RECIPES:
        raise ValueError(f"--fp8-recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=fp8_linear)
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")


@contextlib.contextmanager
def plain_linears(model: nn.Module):
    """Within: Float8Linear layers compute as plain nn.Linear, as nanochat evaluates. The layers
    stay in place (forward is overridden on the instance), so FSDP2 still finds them."""
    with contextlib.ExitStack() as restore:
        for layer in [m for m in model.modules() if type(m).__name__ == "Float8Linear"]:
            layer.forward = types.MethodType(nn.Linear.forward, layer)
            restore.callback(delattr, layer, "forward")
        yield
