"""
fp8 matmuls for training, nanochat's --fp8, through torchao's float8 training (the library PyTorch
maintains for it; an optional dependency, `pip install torchao`).

Each nn.Linear whose sizes fp8 matmuls take becomes torchao's Float8Linear, as nanochat's --fp8
picks them: the blocks' and lm_head (the gates' few channels stay). Around every matmul it casts the
input and weight to float8 e4m3 and the output's gradient to e5m2, with scales computed on the fly
per tensor ('tensorwise', nanochat's default) or per row ('rowwise'). The weights stay the same fp32
Parameters, so the optimizer, its groups and the checkpoints do not change: an fp8 run saves what a
plain run saves and resumes, samples and exports without --fp8. The embedding (a lookup, no
matmul) and attention stay in the run's dtype (bf16 autocast on a GPU); evaluation runs every
linear layer in that dtype too (plain_linears, nanochat's disable_fp8), so val bpb compares with a
plain run's. lm_head in fp8 is nanochat 92d63d4's choice: at d12 it is a fifth of the matmul FLOPs.

On a GPU with compute capability 8.9 or more (H100, H200, L4, RTX 40xx) the matmuls run on fp8
tensor cores. On a CPU torchao emulates them: the same rounding, fp32 matmuls, slower than plain:
for tests, not for speed.
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
    """torchao.float8, or one line saying how to get it. torchao logs a warning for each CUDA
    kernel library it cannot load on this machine; none of them is the float8 training path."""
    # (and torch warns once that torchao registers an Enum for compile the old way)
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ValueError(f"--fp8 needs torchao ({e}): `pip install torchao`, or drop --fp8") \
            from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return float8


def check_fp8(device: torch.device) -> None:
    """Refuse --fp8 in one line where neither fp8 tensor cores nor torchao's emulation can run it:
    a GPU older than compute capability 8.9 (emulation there is slower than bf16), MPS (no float8
    dtypes), or no torchao."""
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
    """Which layers go fp8: every Linear whose sizes fp8 matmuls take (multiples of 16), lm_head
    included, as nanochat's --fp8 (which also skips layers under 128 wide: none at d2 and up but
    toy widths, which the CPU's tests use)."""
    return (isinstance(module, nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(model: nn.Module, recipe: str, device: torch.device) -> int:
    """Swap the Linears fp8_linear picks for Float8Linear in place (before torch.compile and FSDP),
    keeping their weight Parameters; emulated off CUDA. Returns how many were swapped."""
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
    """Within: the model's Float8Linear layers compute as plain nn.Linear on their weights (bf16
    under autocast), as nanochat evaluates; fp8 again after. The layers stay in place (their
    forward is overridden on the instance), so FSDP2, which gathers a block's weights into the
    layer objects it was given, still finds them. Nothing to do for a model without them."""
    layers = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    for layer in layers:
        layer.forward = types.MethodType(nn.Linear.forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
