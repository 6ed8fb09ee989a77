"""
nanomuon's CUDA-only code run on a fake 'cuda' device, on a machine with no GPU.

No GPU is at hand to test the GPU paths (tests/test_cuda.py needs one), so these tests run them
with FakeTensorMode: tensors on device 'cuda' that carry shapes, dtypes and devices but no data.
That is enough to catch what breaks a first GPU run before any number is computed: a tensor made on
the CPU inside a CUDA path (a device mismatch at step 1), autocast leaving bf16 where fp32 is meant,
a non-pinned or blocking host-to-device copy, a batch auto-fit that runs out of memory, an MFU
looked up under the wrong GPU name. Values, speed and real collectives stay GPU-only.

How: a CUDA build of torch (the PyPI wheel for Linux) has CUDA's autocast and fake kernels, but its
autograd asks the CUDA driver for streams and contexts and aborts without one. A small C++ shim
(SHIM below, built with g++ against the installed torch in about 2 s) answers instead: CUDA hooks
that report one device and no primary context, registered before torch loads its own, and c10's
fake device guard, registered after. Pinning host memory still asks the driver, so the loader's
test stands a recorder in for Tensor.pin_memory. Each test runs its case in a fresh child process
(this file run as a script), which loads the shim before `import torch`. torch.cuda's Python
queries (is_available, mem_get_info, the device name) are patched to an 80 GB H100's. A CPU
build of torch cannot make fake 'cuda' tensors with autograd at all: there the tests skip.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# An 80 GB H100 SXM as torch reports it: the name, and the bytes mem_get_info returns on an idle
# GPU (total as nvidia-smi's 81559 MiB; free less the CUDA context's ~500 MiB)
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_TOTAL = 81559 * 2 ** 20
H100_FREE = H100_TOTAL - 500 * 2 ** 20

SHIM = r"""
// Fake CUDA for FakeTensorMode on a machine without a GPU (see tests/test_fake_cuda.py).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
namespace {
// One CUDA device that never has a primary context: the autograd engine then leaves its streams
// alone. Registered with a higher priority than libtorch_cuda's, which is then skipped.
struct FakeCUDAHooks : CUDAHooksInterface {
  FakeCUDAHooks(CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  void init() const override {}
};
}  // namespace
C10_REGISTER_CLASS_WITH_PRIORITY(CUDAHooksRegistry, CUDAHooks, c10::REGISTRY_PREFERRED,
                                 FakeCUDAHooks);
}  // namespace at

// c10's fake device guard in place of CUDA's, whose streams need the driver. Called after
// `import torch`: libtorch_cuda registers its own guard as it loads, and the last one wins.
extern "C" void use_fake_cuda_guard() {
  static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
  static c10::impl::DeviceGuardImplRegistrar registrar(c10::DeviceType::CUDA, &guard);
}
"""


def why_not_here() -> str | None:
    """Why the fake-CUDA tests cannot run in this environment, or None when they can."""
    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU build, which cannot make fake 'cuda' tensors "
                "with autograd; a CUDA build (the PyPI wheel) runs these tests")
    if not shutil.which("g++"):
        return "no g++ to build the fake-CUDA shim (apt-get install g++)"
    return None


if __name__ != "__main__":  # a child process must not import torch before the shim
    pytestmark = [pytest.mark.heavy,  # a child process a test: CI runs them in legs of their own
                  pytest.mark.skipif(bool(why_not_here()), reason=str(why_not_here()))]


def skip_before_compile_under_fake() -> None:
    """Skip a compiled case on a torch before 2.10 (CI's floor leg); CI's fake-GPU leg runs it."""
    import torch

    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 10):
        pytest.skip("torch < 2.10: its fake tensors have no kernels for c10d's collectives, and "
                    "dynamo cannot trace under an outer fake mode")


def skip_without_flash_registry() -> None:
    """Skip where torch has no flash attention registry: choose_attention there falls back to
    SDPA saying so, and the cases have no registry to stand in for."""
    import torch
    from torch.nn import attention

    if not hasattr(attention, "activate_flash_attention_impl"):
        pytest.skip(f"torch {torch.__version__} has no flash attention registry")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    """SHIM built against the installed torch."""
    import torch

    out = tmp_path_factory.mktemp("fake_cuda")
    src, lib = out / "fake_cuda.cpp", out / "fake_cuda.so"
    src.write_text(SHIM)
    tdir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    for std in ("c++17", "c++20"):  # torch's headers ask for C++20 from 2.10 on
        built = subprocess.run(["g++", "-O1", "-shared", "-fPIC", f"-std={std}",
                                f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(tdir / "include"),
                                str(src), "-o", str(lib), "-L", str(tdir / "lib"), "-lc10",
                                "-ltorch_cpu", f"-Wl,-rpath,{tdir / 'lib'}"],
                               capture_output=True, text=True, timeout=300)
        if built.returncode == 0:
            return lib
    raise AssertionError(f"the fake-CUDA shim did not build:\n{built.stderr[-3000:]}")


def run_case(shim: Path, case: str, *args: str, timeout: int = 300) -> str:
    """Run CASES[case] in a child process on the fake GPU; its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, __file__, str(shim), case, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{case} failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-6000:]}"
    return r.stdout


# The tests: each runs a case below in a child process, and says which GPU failure it stands for.


def test_forward_and_backward_under_bf16_autocast_stay_on_the_gpu(shim):
    """Stands in for: a tensor made on the CPU in the model's forward or backward (a device
    mismatch at the first step), or autocast('cuda') off or leaving bf16 gradients."""
    run_case(shim, "model")


def test_one_eager_muon_adamw_step_makes_every_tensor_on_the_gpu(shim):
    """Stands in for: optimizer state or a temporary made on the CPU (a device mismatch, or a
    silent host round trip every step) in MuonAdamW's update on CUDA params."""
    run_case(shim, "step", "0")


def test_dist_muon_adamw_on_nccl_makes_every_tensor_on_the_gpu(shim):
    """Stands in for: DistMuonAdamW's nccl setup (AVG, reduce-scatter) or its step making a
    tensor or keeping state on the CPU. World 1 only: torch 2.9's fake tensors have no fake
    kernels for c10d's collectives, which a larger world runs."""
    run_case(shim, "step", "1")


def test_loader_pins_its_batches_and_copies_them_without_blocking(shim, tmp_path):
    """Stands in for: pin_memory() failing in the prefetch thread, or a copy from pageable memory
    (synchronous on a GPU, so loading stalls every step) instead of a pinned, non-blocking one."""
    run_case(shim, "loader", str(tmp_path))


def test_d24_auto_batch_on_an_80gb_h100_fits_what_the_model_allocates(shim):
    """Stands in for: the speedrun's d24 (nanochat's shape, 2048 tokens a row, 1M-token steps)
    running out of GPU memory at step 1 under --device-batch-size auto. One process: with more,
    fake mode would copy auto-fit's torch.tensor(..., device='cuda') to a real GPU."""
    out = run_case(shim, "autofit", "1")
    assert f"GiB free on {H100_NAME}" in out, out


def test_d24_eager_activations_on_a_gpu_fit_the_estimate(shim):
    """Stands in for: an eager (--compile off) d24 on a GPU saving more for backward than
    train_memory counts, so auto-fit picks a batch that runs out of memory."""
    run_case(shim, "autofit", "1", "1")


def test_device_setup_and_mfu_peak_by_gpu_name(shim):
    """Stands in for: --device-type auto picking the CPU on a GPU node, compute_init's CUDA
    branch, or an MFU computed against another GPU's peak."""
    run_case(shim, "setup")


def test_attention_on_a_fake_h100_is_the_first_flash_kernel_that_runs(shim):
    """Stands in for: a GPU node with FA3 or FA4 (torch's flash attention registry) or nanochat's
    hub kernel installed still training through SDPA's own kernels, a Hopper-only kernel tried on
    another GPU, or the hub kernel given the wrong layout or dtype."""
    skip_without_flash_registry()
    run_case(shim, "attention_choice")


def test_attention_on_a_fake_h100_falls_back_to_sdpa_saying_why(shim):
    """Stands in for: a GPU node without a flash kernel, or with one that fails to load or refuses
    the model's shape, stopping at step 1 instead of training through SDPA, or not saying why."""
    skip_without_flash_registry()
    run_case(shim, "attention_fallback")


def test_windowed_attention_on_a_fake_h100_runs_each_kernel_with_its_windows(shim):
    """Stands in for: a model with sliding windows (arch 'nanochat') on a GPU node attending its
    windows through SDPA with a mask (no flash backend, every score computed) while a flash kernel
    or flex_attention could run them: FA3 from torch's registry given its windows through
    varlen_attn, the hub's FA3 through window_size, flex_attention (compiled) without either;
    a kernel that gets fp32 under autocast (a value embedding in v) and falls back; a full-context
    model no longer choosing as before."""
    skip_without_flash_registry()
    run_case(shim, "attention_windows")


def test_batched_seeds_on_a_fake_h100_fold_into_the_single_runs_kernel(shim):
    """Stands in for: batched seeds' compiled graph on a GPU handing attention to vmap's rule for
    SDPA, which picks its own kernel for the stacked shape (cuDNN's on an H200, whose compiled
    graph failed), rather than the flash kernel a single run's graph calls."""
    skip_before_compile_under_fake()
    run_case(shim, "seed_fold")


@pytest.mark.parametrize("fp8", ["plain", "fp8", "seeds"])
def test_base_train_whole_on_a_fake_h100(shim, base, fp8):
    """Stands in for: base_train's main failing on a GPU node after its parts pass: the compiled
    model and update as base_train sets them up, DistMuonAdamW under torchrun's variables, the
    device batch fitted to the H100, MFU in the step lines and the summary, the report's GPU name;
    with --fp8, torchao's float8 layers on the GPU path (no emulation); with --seeds 1,2,3, the
    batched seeds (vmap over the compiled model, each seed's memory in the batch fit, each layer's
    kernel called once on every seed's rows). The plain run's node has FA3 in torch's registry,
    which also runs the windows of arch 'nanochat' (auto on CUDA); the others no flash kernel:
    their windows run through flex_attention. The step lines and the report say so. CI's
    fake-GPU leg runs it."""
    skip_before_compile_under_fake()
    if fp8 == "fp8":
        pytest.importorskip("torchao.float8", reason="--fp8 needs torchao")
    out = run_case(shim, "train", str(base), fp8, timeout=600)
    assert f"GiB free on {H100_NAME}" in out and "(compiled)" in out, out
    assert re.search(r"step 00004/00004 .*\| mfu \d+\.\d+%", out), out
    assert "throughput:" in out and ", mfu " in out, out
    if fp8 == "seeds":
        assert "(batched seeds: each call takes every seed's rows)" in out, out
        assert "(mean of 3 seeds" in out, out
    attn = dict(plain="fa3", fp8="flex", seeds="flex")[fp8]
    assert f"attention: {attn}: " in out, out
    assert ("its windows through varlen_attn's window_size" in out) == (fp8 == "plain"), out
    steps = re.findall(r"^step \d+/\d+ .*$", out, re.M)
    assert len(steps) == 4 and all(f" | attn {attn}" in line for line in steps), steps
    report = (base / "runs" / f"fake-h100-{fp8}" / "report.md").read_text()
    assert f"cuda ({H100_NAME})" in report and f"attention {attn}" in report, report
    assert ("fp8: 13 linear layers in fp8, lm_head among them (tensorwise scales); the "
            "embedding and attention in bf16" in out) == (fp8 == "fp8"), out


def cast_as_new_params(module, *, dtype):
    """Module.to(dtype=...) with new parameters in place of the old, not swapped in."""
    import torch

    for m in module.modules():
        for key, p in m._parameters.items():
            if p is not None:
                m._parameters[key] = torch.nn.Parameter(p.to(dtype), p.requires_grad)
    return module


def plan_flags(step: str) -> list[str]:
    """bench_nanochat's flags in gpu_check's plan for `step`, but --nanochat."""
    plan = subprocess.run(["bash", "scripts/gpu_check.sh", "--plan", "--only", step], cwd=REPO,
                          capture_output=True, text=True, timeout=120).stdout
    cmd = re.search(rf"^  {step} .*-m scripts\.bench_nanochat (.*)$", plan, re.M)[1]
    words = cmd.split()
    at = words.index("--nanochat")
    return words[:at] + words[at + 2:]


@pytest.mark.parametrize("step", ["h2h_d24_fp8", "h2h_d24_bf16"])
def test_the_plans_head_to_head_on_a_fake_h100(shim, step):
    """Stands in for: the GPU kit's first two steps, the speedrun's model beside nanochat, failing
    on the GPU in their first minutes where a CPU could have seen it: a flag the plan gives,
    nanomuon's build, its fp8 conversion, its windows through flex_attention (the lent image has
    no flash kernel), compile, the optimizer step; with a nanochat checkout (NANOCHAT, else
    /tmp/nanochat), nanochat's side and the summary too. The plan's flags at d2, one step after
    one warmup: a d24 traces the same code for many minutes."""
    skip_before_compile_under_fake()
    if step.endswith("fp8"):
        pytest.importorskip("torchao.float8", reason="nanomuon's fp8 needs torchao")
    checkout = next((raw for raw in (os.environ.get("NANOCHAT"), "/tmp/nanochat")
                     if raw and (Path(raw) / "nanochat" / "gpt.py").is_file()), "")
    flags = [*plan_flags(step), "--depth", "2", "--steps", "1", "--warmup", "1"]
    out = run_case(shim, "h2h", checkout, *flags, timeout=900)
    precision = step.rsplit("_", 1)[1]
    if not checkout:
        assert f"nanomuon {precision}: attention flex" in out, out
        return
    line = re.search(rf"^h2h d2 {precision}: nanomuon (.*); nanochat (.*); nanomuon/nanochat ",
                     out, re.M)
    assert line and "FAILED" not in line[0], out
    assert line[1].endswith("attention flex"), line[1]
    assert line[2].endswith("attention sdpa with windows as a mask"), line[2]


# The child process: loads the shim, then torch, then runs one case on the fake GPU.


def load_shim(lib: str):
    """The shim's CUDA hooks must be registered before libtorch_cuda's, so they load with the
    libraries they need, ahead of `import torch`."""
    import ctypes
    import importlib.util

    tlib = Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "lib"
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(tlib / name), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def fake_gpu(free: int = H100_FREE, total: int = H100_TOTAL, name: str = H100_NAME,
             capability: tuple[int, int] = (9, 0)):
    """torch.cuda's Python queries answered as one idle GPU would; a FakeTensorMode to enter."""
    import types

    import torch
    from torch._subclasses import fake_tensor

    props = types.SimpleNamespace(name=name, total_memory=total, major=capability[0],
                                  minor=capability[1], multi_processor_count=132)
    c = torch.cuda
    c.is_available, c.device_count, c.current_device = lambda: True, lambda: 1, lambda: 0
    c.is_bf16_supported = lambda *a, **k: True
    c.get_device_name = lambda device=None: name
    c.get_device_properties = lambda device=None: props
    c.mem_get_info = lambda device=None: (free, total)
    # what the caching allocator holds: nothing yet. One function per name: dynamo keeps a rule
    # per function object, and refuses one object under two names
    c.memory_reserved, c.memory_allocated = lambda device=None: 0, lambda device=None: 0
    c.set_device, c.synchronize = lambda device=None: None, lambda device=None: None
    # fake tensors make one real CUDA tensor first where CUDA looks available: not here
    fake_tensor.init_gpu_context = lambda device: None
    # choosing among SDPA's fused kernels reads the real GPU's properties: the flash kernel that
    # an H100 picks for bf16 is called directly
    torch.nn.functional.scaled_dot_product_attention = flash_attention
    return fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)


# flash_attention's calls (whether SDPA's math backend was on for each), what it raises instead,
# and its masked calls (their shapes)
FLASH = dict(calls=[], fail=None, masked=[])


def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """F.scaled_dot_product_attention as an H100 runs the model's call: autocast's cast to bf16
    (SDPA is on its lower-precision list), then the flash kernel, which saves only its output and
    the log-sum-exp for backward. A mask (a sliding window in gpt.sdpa) rules the flash kernel
    out: such a call is counted and runs as SDPA's math path (the shapes and dtypes of the fused
    kernel an H100 picks then, which keeps every score)."""
    import torch

    if torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if attn_mask is not None:
        if not torch.compiler.is_compiling():
            FLASH["masked"].append(tuple(q.shape))
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
    assert not dropout_p and q.size(-3) == k.size(-3), \
        "the model's attention changed: its flash stand-in needs updating"
    if not torch.compiler.is_compiling():  # counted in eager runs only: no side effects to trace
        FLASH["calls"].append(torch.backends.cuda.math_sdp_enabled())
        if FLASH["fail"]:
            raise FLASH["fail"]
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
                                                              scale=scale)[0]


def device_log():
    """A dispatch mode that lists every tensor an op makes off the GPU, but 0-D CPU tensors: the
    compiled update's hparams are 0-D CPU scalars by design (muon.scalars), which CUDA
    kernels take as arguments without a copy."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class DeviceLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.strays = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append(str(func))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "cuda" and t.dim() > 0:
                    self.strays.append(f"{func} made a {tuple(t.shape)} tensor on {t.device}")
            return out

    return DeviceLog()


def meta_gpt(depth: int, seq_len: int, vocab: int = 32768, arch: str = "classic"):
    """base_train's first half of building: the GPT on the meta device (outside fake mode: a fake
    mode cannot swap an nn.Module's parameters it made itself)."""
    import torch

    from nanomuon.gpt import GPT, config_from_depth

    with torch.device("meta"):
        return GPT(config_from_depth(depth, vocab, seq_len, arch=arch))


def on_gpu(model):
    """base_train's second half, inside fake mode: storage on the GPU, then the init."""
    model.to_empty(device="cuda")
    model.init_weights()
    return model


def batch(model, rows: int):
    import torch

    c = model.config
    return [torch.randint(0, c.vocab_size, (rows, c.sequence_len), device="cuda")
            for _ in range(2)]


def check_grads(model):
    import torch

    for name, p in model.named_parameters():
        g = p.grad
        assert g is not None, f"{name}: no grad"
        assert (g.device, g.dtype, g.shape) == (p.device, torch.float32, p.shape), \
            f"{name}: grad {g.device} {g.dtype} {tuple(g.shape)} for param {p.device} {p.dtype}"


def case_model():
    """Forward, loss and backward of a d2 under the bf16 autocast base_train resolves for CUDA;
    then the branch torch.compile traces (plain softcap and cross_entropy) the same way."""
    import torch

    from nanomuon.common import autocast, resolve_dtype

    dev = torch.device("cuda")
    assert resolve_dtype(dev) == "bf16", "'auto' must train in bf16 on a GPU"
    model = meta_gpt(2, 256)
    with fake_gpu():
        on_gpu(model)
        logits_dtype = []
        model.lm_head.register_forward_hook(lambda m, i, out: logits_dtype.append(out.dtype))
        for compiling in (False, True):
            x, y = batch(model, 2)
            log = device_log()
            torch.compiler.is_compiling = lambda c=compiling: c
            with log:
                with autocast(dev):
                    loss = model(x, y)
                loss.backward()
            assert loss.is_cuda and loss.dtype == torch.float32 and loss.dim() == 0, \
                (loss.device, loss.dtype, loss.shape)
            # autocast('cuda') silently turns itself off where CUDA looks unavailable
            assert logits_dtype.pop() == torch.bfloat16, "the matmuls did not run in bf16"
            assert any("mm" in op for op in log.ops[len(log.ops) // 2:]), "no backward seen"
            assert not log.strays, log.strays
            check_grads(model)
            model.zero_grad(set_to_none=True)
    print("model ok")


def fake_nccl(world: int, init=None) -> None:
    """torch's 'fake' process group (no communication), reporting itself as nccl so that
    DistMuonAdamW takes its GPU branch; `init` is init_process_group where that is patched."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    (init or dist.init_process_group)("fake", store=FakeStore(), rank=0, world_size=world)
    dist.get_backend = lambda group=None: "nccl"


def case_step(world: str):
    """One eager optimizer step of a d2 (MuonAdamW; DistMuonAdamW over `world` nccl ranks when
    world > 0): every tensor it makes, and the state it keeps, on the GPU."""
    import torch

    from nanomuon.common import autocast
    from nanomuon.optim import DistMuonAdamW, MuonAdamW

    world = int(world)
    if world:
        fake_nccl(world)
    model = meta_gpt(2, 256)
    with fake_gpu():
        on_gpu(model)
        x, y = batch(model, 2)
        with autocast(torch.device("cuda")):
            model(x, y).backward()
        opt = model.setup_optimizer(compile=False)
        if world:
            assert type(opt) is DistMuonAdamW and opt._use_avg and opt._scatter, type(opt)
        else:
            assert type(opt) is MuonAdamW, type(opt)
            assert model.setup_optimizer().compiled, "CUDA params compile the update by default"
        log = device_log()
        with log:
            opt.step()
    assert log.ops and not log.strays, log.strays
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state, "the step kept no state"
    off = [(tuple(t.shape), t.device) for t in state if not t.is_cuda and t.dim() > 0]
    assert not off, f"optimizer state off the GPU: {off}"
    assert all(p.is_cuda and p.dtype == torch.float32 for p in model.parameters())
    print(f"step ok: {len(log.ops)} ops, {len(state)} state tensors")


def case_loader(base: str):
    """base_train's loader on CUDA: the prefetch thread pins each batch, the consumer copies it to
    the GPU without blocking."""
    import torch
    from test_gpu_paths import ByteTokenizer, write_split_folder
    from torch.utils._python_dispatch import TorchDispatchMode

    from nanomuon.dataloader import DataLoader

    os.environ["NANOMUON_BASE_DIR"] = base
    write_split_folder(Path(base))
    pinned, copies = set(), []  # the host buffers pin_memory() made; (op, pinned, non_blocking)

    def pin_memory(t, device=None):  # pinning needs the driver: a copy, remembered
        out = t.clone()
        pinned.add(out.data_ptr())
        return out

    torch.Tensor.pin_memory = pin_memory

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            src = args[0] if args else None
            if isinstance(src, torch.Tensor) and src.device.type == "cpu":
                copies.append((str(func), src.data_ptr() in pinned,
                               kwargs.get("non_blocking", False)))
                # made fake first: fake mode copies a real tensor to 'cuda' for real (a limit of
                # its constant propagation, not the loader's)
                args = (fake.from_tensor(src), *args[1:])
            return func(*args, **kwargs)

    with fake_gpu() as fake:
        dl = DataLoader(ByteTokenizer(), "fineweb-edu", "train", 2, 32, device="cuda",
                        buffer_size=4, prefetch=2)
        try:
            with Copies():
                for _ in range(3):
                    x, y = dl.next_batch()
                    assert all(t.is_cuda and t.dtype == torch.long and t.shape == (2, 32)
                               for t in (x, y)), (x.device, x.dtype, x.shape)
        finally:
            dl.close()
    assert len(copies) == 6, copies
    assert all(was_pinned and non_blocking for _, was_pinned, non_blocking in copies), copies
    print("loader ok:", copies[0])


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under these tensors (views of one stack count once)."""
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def case_autofit(world: str, activations: str = "0"):
    """speedrun.sh's GPU flags at d24 on an idle 80 GB H100, `world` GPUs: the rows auto-fit
    picks, and train_memory's estimate there checked against what the model really allocates:
    its params, grads and optimizer state on the fake GPU, and (activations "1") the tensors
    autograd saves in the eager model's forward."""
    import torch

    from nanomuon.arch import fit_device_batch, train_memory
    from nanomuon.common import autocast, resolve_dtype
    from scripts.base_train import auto_device_batch
    from scripts.train_args import parse_args

    world, dev = int(world), torch.device("cuda")
    flags = ["--depth", "24", "--device-batch-size", "auto", "--target-param-data-ratio", "8",
             "--total-batch-size", "1048576", "--device-type", "cuda"]
    with fake_gpu():
        args = parse_args(flags)
        args.dtype = resolve_dtype(dev, args.dtype)  # as base_train's build
        # the speedrun's model, built outside fake mode
        model = on_gpu(unfaked(meta_gpt, 24, args.max_seq_len, arch="nanochat"))
        rows = auto_device_batch(args, model.config, dev, world, compiled=True)
        per_step = args.total_batch_size // (args.max_seq_len * world)
        assert rows & (rows - 1) == 0 and per_step % rows == 0, (rows, per_step)
        # the eager model at the rows auto-fit picks for it, measured
        eager_rows = fit_device_batch(model.config, H100_FREE, per_step, compiled=False)
        saved = []
        keep = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                        lambda t: t)
        with keep, autocast(dev):
            loss = model(*batch(model, eager_rows))
        loss.backward()
        opt = model.setup_optimizer(compile=False)
        opt.step()
    params = list(model.parameters())
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    measured = dict(params=storage_bytes(params), grads=storage_bytes(p.grad for p in params),
                    optimizer=storage_bytes(t for t in state if t.dim() > 0),
                    activations=storage_bytes(t for t in saved if t.is_cuda))
    est = train_memory(model.config, eager_rows, compiled=False, bf16=True)
    for part in ("params", "grads", "optimizer"):
        assert abs(measured[part] - est[part]) <= 0.02 * est[part], (part, measured, est)
    if activations == "1":  # autograd also saves the bf16 weight copies
        assert measured["activations"] <= est["activations"] + est["bf16_copies"], (measured, est)
    fitted = sum(train_memory(model.config, rows, compiled=True, bf16=True).values())
    assert fitted <= 0.85 * H100_FREE - 2 ** 30 < 2 * fitted, (rows, fitted / 2 ** 30)
    print(f"autofit ok: {rows} rows compiled, {eager_rows} eager; measured {measured}, "
          f"estimated {est}")


def case_train(base: str, fp8: str):
    """scripts.base_train's main on the fake H100 for 4 steps of a d2, as torchrun's one process
    (RANK, LOCAL_RANK, WORLD_SIZE set: DistMuonAdamW over the fake nccl group), compiled by
    default with dynamo and AOTAutograd (aot_eager: inductor needs a real GPU to build kernels),
    the device batch auto-fitted, eval, MFU, the report. Stand-ins, each a limit of fake tensors,
    none a change to what base_train does: values read back to the host (.item() and .tolist())
    answer 1, pinning is the identity (it needs the driver), the loader's host batches become
    fakes, the meta model is built outside fake mode, checkpoints are counted, not written."""
    import torch
    from test_dist import _free_port
    from torch._subclasses.fake_tensor import FakeTensor

    import nanomuon.dataloader as dataloader
    import nanomuon.seeds as seeds
    import scripts.base_train as base_train
    from nanomuon.optim import DistMuonAdamW

    os.environ.update(NANOMUON_BASE_DIR=base, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    hide_flash_packages()
    if fp8 == "plain":
        fa3 = stub_registry("FA3")
    # batched seeds: each seed's init, before fake mode's model is stacked
    seed_flags = ["--seeds", "1,2,3"] if fp8 == "seeds" else []
    mode = fake_gpu()
    stand_in(torch.Tensor, "item", lambda t: 1.0 if t.dtype.is_floating_point else 1)
    stand_in(torch.Tensor, "tolist", lambda t: torch.ones(t.shape, dtype=t.dtype).tolist())
    torch.Tensor.pin_memory = lambda t, device=None: t
    tensor = torch.tensor  # data for the GPU: fake mode would make it on a real one first
    torch.tensor = lambda data, *a, device=None, **k: (
        tensor(data, *a, device=device, **k) if device is None or torch.device(device).type != "cuda"
        else mode.from_tensor(unfaked(tensor, data, *a, **k)).to(device))
    make_batch = dataloader.DataLoader._make_batch
    dataloader.DataLoader._make_batch = lambda self: fake_rows(mode, make_batch(self))
    gpt = base_train.GPT
    base_train.GPT = seeds.GPT = lambda config: unfaked(gpt, config)
    saved, steps = [], []
    base_train.checkpoint.save_checkpoint = lambda run_dir, step, *a, **k: (
        saved.append(step) or base_train.checkpoint.step_dir(run_dir, step))
    real_step = DistMuonAdamW.step

    def counted_step(opt, *args, **kwargs):
        steps.append(type(opt))
        return real_step(opt, *args, **kwargs)

    DistMuonAdamW.step = counted_step
    init = torch.distributed.init_process_group
    nccl = []
    torch.distributed.init_process_group = lambda backend, **kw: (  # after a real rendezvous
        nccl.append((backend, kw.get("device_id"))) or fake_nccl(1, init))
    # one rank gathers its own object (the fake group moves no bytes; the object goes through
    # a tensor that fake mode would make fake)
    torch.distributed.all_gather_object = lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj] * len(out))
    compile_on_fake_gpu()
    flags = ["--dataset", "embedded", "--depth", "2", "--max-seq-len", "256",
             "--total-batch-size", "4096", "--num-iterations", "4", "--eval-every", "2",
             "--eval-tokens", "4096", "--log-every", "1", "--sample-tokens", "0",
             "--run", f"fake-h100-{fp8}"] + ["--fp8"] * (fp8 == "fp8") + seed_flags
    with mode:
        summary = base_train.main(flags)
    assert nccl == [("nccl", torch.device("cuda", 0))], nccl
    assert steps == [DistMuonAdamW] * 4 and saved == [4], (steps, saved)
    assert summary["mfu"] > 0 and summary["tok_per_s"] > 0, summary
    assert not any(isinstance(v, FakeTensor) for v in summary.values()), summary
    assert fp8 != "plain" or fa3 == ["activated"], fa3
    print("train ok")


def case_seed_fold():
    """3 batched seeds of a d2 on the fake H100 under bf16 autocast, compiled: each layer's
    attention is one seed_attention call on the 3 x 2 rows, forward and backward; the kernel it
    runs on them calls SDPA's flash op, as the single run's compiled graph does."""
    import torch
    from test_seeds import attention_calls, compiled_graphs

    import nanomuon.seeds as seeds
    from nanomuon.common import autocast

    hide_flash_packages()
    mode, compile_ = fake_gpu(), torch.compile
    compile_on_fake_gpu()
    torch.compile = compile_  # compiled_graphs keeps the graphs and runs them itself
    gpt = seeds.GPT
    seeds.GPT = lambda config: unfaked(gpt, config)
    single = meta_gpt(2, 256)
    with mode, autocast(torch.device("cuda")):
        model = seeds.seeded_gpt(single.config, [1, 2, 3], "cuda")
        x, y = batch(single, 2)
        forward, backward = compiled_graphs(seeds.SeedBatch(model), x, y)
        one = compiled_graphs(on_gpu(single), x, y)[0]
        log = device_log()
        with log:
            q = torch.randn(6, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
            seeds.KERNELS["nanomuon.gpt.sdpa"](q, q, q, None)
    assert attention_calls(forward) == [("nanomuon.seed_attention.default", 6)] * 2, forward
    assert attention_calls(backward) == [("nanomuon.seed_attention_backward.default", 6)] * 2
    flash = "aten._scaled_dot_product_flash_attention.default"
    assert attention_calls(one) == [(flash, 2)] * 2, attention_calls(one)
    assert [op for op in log.ops if "attention" in op] == [flash], log.ops
    print("seed fold ok")


def compile_on_fake_gpu():
    """torch.compile with dynamo and AOTAutograd (aot_eager: inductor needs a real GPU to build
    kernels); dynamo saves and restores the CUDA RNG around each frame it compiles: there is
    none."""
    import torch

    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda state, device="cuda": None
    torch.cuda._lazy_init = lambda: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.accelerator.current_device_index = lambda: 0
    compile_ = torch.compile
    torch.compile = lambda fn=None, **kw: compile_(fn, **dict(kw, backend="aot_eager"))


def hide_flash_packages():
    """Imports of the flash attention packages fail as on a node where none is installed,
    whatever this environment holds."""
    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("flash_attn_interface", "flash_attn", "kernels"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())


def stub_registry(impl: str, fail: Exception | None = None) -> list:
    """A flash attention provider under `impl` in torch's registry, registered through its public
    API as FA3's or FA4's package is: activating it is recorded (and raises `fail`), as is the
    handle's removal. The kernel itself is SDPA's flash op, which fake tensors run as its shape."""
    from torch.nn.attention import register_flash_attention_impl

    calls = []

    class Handle:
        def remove(self):
            calls.append("removed")

    def register():
        calls.append("activated")
        if fail is not None:
            raise fail
        return Handle()

    register_flash_attention_impl(impl, register_fn=register)
    return calls


def stub_hub(calls: list) -> None:
    """The `kernels` package, its get_kernel answering nanochat's FA3 with a flash_attn_func that
    records its inputs and computes SDPA (window_size (left, 0): query i sees keys i - left .. i,
    all before it for -1)."""
    import types

    from nanomuon.gpt import sdpa

    def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
        calls.append((tuple(q.shape), q.dtype, k.dtype, v.dtype, causal, window_size))
        return sdpa(q, k, v, None if window_size[0] < 0 else window_size[0])

    kernel = types.SimpleNamespace(flash_attn_interface=types.SimpleNamespace(
        flash_attn_func=flash_attn_func))
    module = types.ModuleType("kernels")
    module.get_kernel = lambda repo, revision: calls.append(repo) or kernel  # a pinned commit
    sys.modules["kernels"] = module


def train_through(model, attention) -> None:
    """Forward and backward of the model under bf16 autocast on the fake GPU through attention."""
    import torch

    from nanomuon.common import autocast

    model.use_attention(attention.func)
    x, y = batch(model, 2)
    with autocast(torch.device("cuda")):
        loss = model(x, y)
    loss.backward()
    check_grads(model)
    model.zero_grad(set_to_none=True)


def heads_of(model) -> tuple[int, int, int]:
    c = model.config
    return c.n_head, c.n_kv_head, c.n_embd // c.n_head


def case_attention_choice():
    """On an H100 with FA3 in torch's registry: FA3, held to SDPA's flash backend in the probe,
    then every layer through SDPA's flash op. On an A100 none (each is a Hopper or Blackwell
    build); on a B200 FA4. With only nanochat's hub kernel: it, called in (B, T, heads, head_dim)
    with bf16 q, k, v (autocast leaves q and k fp32)."""
    import torch
    from torch.nn.attention import current_flash_attention_impl

    from nanomuon.attention import HUB_KERNEL, choose_attention, deactivate

    hide_flash_packages()
    dev, model, fa3 = torch.device("cuda"), meta_gpt(2, 256), stub_registry("FA3")
    with fake_gpu():
        on_gpu(model)
        heads, layers = heads_of(model), model.config.n_layer
        got = choose_attention(dev, "bf16", heads)
        assert (got.name, got.func, fa3) == ("fa3", None, ["activated"]), (got, fa3)
        assert current_flash_attention_impl() == "FA3" and FLASH["calls"] == [False], FLASH
        FLASH["calls"].clear()
        train_through(model, got)
        assert len(FLASH["calls"]) == layers, FLASH
        deactivate()
        assert fa3 == ["activated", "removed"] and current_flash_attention_impl() is None
        fa4 = stub_registry("FA4")
        fake_gpu(name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
        got = choose_attention(dev, "bf16", heads)
        assert got.name == "sdpa" and fa4 == [] and len(fa3) == 2, (got, fa3, fa4)
        assert got.why == ("sdpa (fa3 needs compute capability 9.x, not 8.0; fa4 needs compute "
                           "capability 9.x or 10.x, not 8.0; fa3-hub needs compute capability "
                           "9.x, not 8.0)"), got.why
        fake_gpu(name="NVIDIA B200", capability=(10, 0))
        assert choose_attention(dev, "bf16", heads).name == "fa4" and fa4 == ["activated"]
        deactivate()
        fake_gpu()
        for impl in ("FA3", "FA4"):
            stub_registry(impl, fail=ModuleNotFoundError("no module", name=f"{impl} package"))
        hub = []
        stub_hub(hub)
        got = choose_attention(dev, "bf16", heads)
        probed = ((1, 256, heads[0], heads[2]), *[torch.bfloat16] * 3, True, (-1, 0))
        assert got.name == "fa3-hub" and hub == [HUB_KERNEL, probed], (got, hub)
        hub.clear()
        train_through(model, got)
        assert hub == [((2, 256, heads[0], heads[2]), *[torch.bfloat16] * 3, True, (-1, 0))] \
            * layers, hub
    print("attention choice ok")


def record_varlen(calls: list) -> None:
    """torch's varlen_attn, each call's window_size and q, k, v dtypes recorded (it runs as its
    fake kernel here); its signature kept, which nanomuon.attention.varlen_windows reads."""
    import functools

    from torch.nn.attention import varlen

    real = varlen.varlen_attn

    @functools.wraps(real)
    def varlen_attn(q, k, v, *args, window_size=(-1, -1), **kwargs):
        calls.append((window_size, q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, window_size=window_size, **kwargs)

    varlen.varlen_attn = varlen_attn


def case_attention_windows():
    """A d4 of arch 'nanochat' (windows 128, 128, 128 and the whole context; value embeddings on
    layers 1 and 3, fp32 under autocast) on an H100: with FA3 in torch's registry, FA3 for the full
    layer through SDPA and for the windows through varlen_attn, all in bf16, and for a model
    without windows FA3 in SDPA alone, as before; with a torch whose varlen_attn took no window,
    the hub's FA3 with window_size; with no flash kernel, on an A100 or in fp32, flex_attention,
    compiled; flex failing too, SDPA with the windows as masks, saying why."""
    import torch

    import nanomuon.attention as attention
    from nanomuon.attention import choose_attention, deactivate

    hide_flash_packages()
    compile_on_fake_gpu()
    dev, model, fa3 = torch.device("cuda"), meta_gpt(4, 256, arch="nanochat"), stub_registry("FA3")
    varlen = []
    record_varlen(varlen)
    with fake_gpu():
        on_gpu(model)
        heads, bf16 = heads_of(model), torch.bfloat16
        assert model.config.window_sizes() == [128, 128, 128, None]
        got = choose_attention(dev, "bf16", heads, windowed=True)
        assert (got.name, got.func, fa3) == ("fa3", attention.registry_attend, ["activated"]), \
            (got, fa3)
        assert FLASH["calls"] == [False] and varlen == [((128, 0), *[bf16] * 3)], (FLASH, varlen)
        FLASH["calls"].clear()
        varlen.clear()
        train_through(model, got)
        assert len(FLASH["calls"]) == 1 and not FLASH["masked"], FLASH
        assert varlen == [((128, 0), *[bf16] * 3)] * 3, varlen
        deactivate()
        got = choose_attention(dev, "bf16", heads)  # no windows: as before
        deactivate()
        assert (got.name, got.func) == ("fa3", None) and fa3 == ["activated", "removed"] * 2
        windows_by_hub(model, heads)
        windows_by_flex(model, heads)
    print("attention windows ok")


def windows_by_hub(model, heads) -> None:
    """A torch whose varlen_attn takes no window: the registry kernels passed over, saying why;
    the hub's FA3 gets each layer's window."""
    import torch

    import nanomuon.attention as attention
    from nanomuon.attention import choose_attention

    stub_registry("FA4")
    hub = []
    stub_hub(hub)
    windows, attention.varlen_windows = attention.varlen_windows, lambda: False
    got = choose_attention(torch.device("cuda"), "bf16", heads, windowed=True)
    attention.varlen_windows = windows
    assert got.name == "fa3-hub" and got.func is not None, got
    hub.clear()
    train_through(model, got)
    seen = [(window, dtypes) for _, *dtypes, causal, window in hub]
    bf16 = [torch.bfloat16] * 3
    assert seen == [((128, 0), bf16)] * 3 + [((-1, 0), bf16)], hub
    del sys.modules["kernels"]


def windows_by_flex(model, heads) -> None:
    """No flash kernel loads: flex_attention, on an H100, an A100 and in fp32; flex failing too:
    SDPA with the windows as masks, or a ValueError where --attention flex asked for it."""
    import torch

    import nanomuon.attention as attention
    from nanomuon.attention import choose_attention

    dev = torch.device("cuda")
    for impl in ("FA3", "FA4"):
        stub_registry(impl, fail=ModuleNotFoundError("no module", name=f"{impl} package"))
    got = choose_attention(dev, "bf16", heads, windowed=True)
    assert got.name == "flex" and got.why.startswith(
        "flex: windowed layers through flex_attention with a sliding-window block mask, compiled "
        "(fa3: FA3 package is not installed"), got.why
    FLASH["calls"].clear()
    FLASH["masked"].clear()
    train_through(model, got)
    assert len(FLASH["calls"]) == 1 and not FLASH["masked"], FLASH  # the full-context layer
    fake_gpu(name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
    got = choose_attention(dev, "bf16", heads, windowed=True)
    assert got.name == "flex" and "fa3-hub needs compute capability 9.x, not 8.0)" in got.why
    fake_gpu()
    got = choose_attention(dev, "fp32", heads, windowed=True)
    assert got.why.endswith("(flash kernels need bf16, this run trains in fp32)"), got.why
    flex, attention.windowed_flex = attention.windowed_flex, lambda: failing_flex
    got = choose_attention(dev, "bf16", heads, windowed=True)
    assert got == attention.Attention("sdpa", "sdpa, windows as a mask (fa3: FA3 package is not "
                                      "installed (build FA3 from flash-attention's hopper/ folder); "
                                      "fa4: FA4 package is not installed (pip install "
                                      "'nanomuon[fa4]'); fa3-hub: kernels is not installed (pip "
                                      "install kernels); flex: RuntimeError: no triton)"), got
    FLASH["calls"].clear()
    FLASH["masked"].clear()
    train_through(model, got)
    assert len(FLASH["calls"]) == 1 and FLASH["masked"] == [(2, 2, 256, 128)] * 3, FLASH
    try:
        choose_attention(dev, "bf16", heads, "flex", windowed=True)
        raise AssertionError("--attention flex ran with a flex_attention that fails")
    except ValueError as e:
        assert str(e) == "--attention flex cannot run here: RuntimeError: no triton", e
    attention.windowed_flex = flex


def failing_flex(q, k, v, window=None):
    raise RuntimeError("no triton")


def case_attention_fallback():
    """On an H100 with no flash kernel installed: SDPA, saying why for each; with FA3 failing to
    load and FA4 refusing the shape in the probe: SDPA, each reason said, FA4 removed again; one
    asked for by name that cannot run: a ValueError with its reason; fp32: SDPA."""
    import torch
    from torch.nn.attention import current_flash_attention_impl

    from nanomuon.attention import choose_attention

    hide_flash_packages()
    dev, model = torch.device("cuda"), meta_gpt(2, 256)
    with fake_gpu():
        on_gpu(model)
        heads = heads_of(model)
        got = choose_attention(dev, "bf16", heads)
        assert (got.name, got.func) == ("sdpa", None), got
        assert got.why == (
            "sdpa (fa3: flash_attn_interface is not installed (build FA3 from flash-attention's "
            "hopper/ folder); fa4: flash_attn is not installed (pip install 'nanomuon[fa4]'); "
            "fa3-hub: kernels is not installed (pip install kernels))"), got.why
        assert current_flash_attention_impl() is None and FLASH["calls"] == [], FLASH
        train_through(model, got)  # SDPA's own flash kernel, as on any H100
        assert len(FLASH["calls"]) == model.config.n_layer, FLASH
        stub_registry("FA3", fail=RuntimeError("FA3 was built for\n another CUDA"))
        fa4 = stub_registry("FA4")
        FLASH["fail"] = RuntimeError("FA4 flash_attention forward unsupported: head_dim 128")
        got = choose_attention(dev, "bf16", heads)
        assert got.name == "sdpa" and fa4 == ["activated", "removed"], (got, fa4)
        assert current_flash_attention_impl() is None
        assert got.why.startswith("sdpa (fa3: RuntimeError: FA3 was built for another CUDA; fa4: "
                                  "RuntimeError: FA4 flash_attention forward unsupported: head_dim "
                                  "128; fa3-hub: kernels is not installed"), got.why
        try:
            choose_attention(dev, "bf16", heads, "fa4")
            raise AssertionError("--attention fa4 ran with a kernel that refuses the shape")
        except ValueError as e:
            assert str(e) == ("--attention fa4 cannot run here: fa4: RuntimeError: FA4 "
                              "flash_attention forward unsupported: head_dim 128"), e
        FLASH["fail"] = None
        got = choose_attention(dev, "fp32", heads)
        assert got.why == "sdpa (flash kernels need bf16, this run trains in fp32)", got.why
        assert fa4 == ["activated", "removed"] * 2, fa4
    print("attention fallback ok")


def stand_in(cls, name: str, answer):
    """cls.name answers `answer(t)` for fake tensors, as before for real ones."""
    from torch._subclasses.fake_tensor import FakeTensor

    real = getattr(cls, name)
    setattr(cls, name, lambda t, *a, **k: answer(t) if isinstance(t, FakeTensor)
            else real(t, *a, **k))


def fake_rows(mode, item):
    """A loader batch made by the prefetch thread (outside the thread-local fake mode) as fakes:
    a real host tensor copied to 'cuda' in fake mode would be copied for real."""
    (x, y), *rest = item
    return ((mode.from_tensor(x), mode.from_tensor(y)), *rest)


def unfaked(build, *args, **kwargs):
    """build(*args, **kwargs) outside fake mode (the meta GPT: a fake mode cannot swap the
    parameters of a module it made; host data bound for the GPU)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return build(*args, **kwargs)


# Dense bf16 tensor-core FLOP/s from the vendors' data sheets, under the names torch reports
DATASHEET_BF16 = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12,
                  "NVIDIA H100 NVL": 835e12, "NVIDIA H200": 989e12, "NVIDIA GH200 480GB": 989e12,
                  "NVIDIA H20": 148e12, "NVIDIA A100-SXM4-80GB": 312e12,
                  "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12,
                  "NVIDIA L4": 121e12, "NVIDIA A10G": 70e12, "NVIDIA A10": 125e12,
                  "Tesla T4": None}


def case_setup():
    """--device-type auto and compute_init on a GPU node (one process), and the MFU peak that
    peak_flops finds under each GPU's name."""
    import torch

    from nanomuon.common import check_device_type, compute_init
    from nanomuon.hardware import peak_flops

    fake_gpu()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)
    assert check_device_type("auto") == "cuda"
    distributed, rank, local_rank, world, device = compute_init("auto")
    assert (distributed, rank, local_rank, world) == (False, 0, 0, 1)
    assert device == torch.device("cuda", 0), device
    assert torch.backends.cuda.matmul.allow_tf32, "fp32 matmuls must use tensor cores"
    wrong = {}
    for name, flops in DATASHEET_BF16.items():
        torch.cuda.get_device_name = lambda device=None, n=name: n
        if peak_flops(device) != flops:
            wrong[name] = (peak_flops(device), flops)
    assert not wrong, f"peak_flops (found, data sheet): {wrong}"
    print("setup ok")


def case_h2h(checkout: str, *flags: str):
    """scripts.bench_nanochat as a step of gpu_check's plan runs it (`flags`), on the fake H100
    with no flash kernel installed: nanochat's model on nanomuon's side, built, converted to fp8
    where asked, compiled (aot_eager) and trained for its warmup and timed steps, in the attention
    it chose (flex for the windows). With a nanochat checkout (else ''), main whole: nanochat's side
    too, the summary and, at d24 in fp8, the time to GPT-2. Stand-ins as case_train's: values read
    back answer 1, the meta models are built outside fake mode; the CUDA generator and the
    allocator's statistics answer as on a fresh GPU."""
    import torch

    import scripts.bench_nanochat as bench
    import scripts.nanochat_parity as parity

    hide_flash_packages()
    mode = fake_gpu()
    stand_in(torch.Tensor, "item", lambda t: 1.0 if t.dtype.is_floating_point else 1)
    torch.cuda.empty_cache = torch.cuda.reset_peak_memory_stats = lambda device=None: None
    torch.cuda.max_memory_allocated = lambda device=None: 2 ** 30
    gpt = bench.GPT
    bench.GPT = lambda config: unfaked(gpt, config)
    nanochat_gpt = parity.nanochat_gpt

    def nanochat_on_gpu(nc, *shape_device_windows):
        *shape, device, windows = shape_device_windows
        model = unfaked(nanochat_gpt, nc, *shape, "meta", windows)
        model.to_empty(device=device)
        to = torch.nn.Module.to  # its init casts embeddings with .to(dtype=): swapped in place,
        torch.nn.Module.to = cast_as_new_params  # which a fake tensor's weakref forbids
        try:
            model.init_weights()
        finally:
            torch.nn.Module.to = to
        return model

    bench.nanochat_gpt = nanochat_on_gpu
    make_batches = bench.make_batches

    def batches_without_a_cuda_generator(args, device):
        """The CUDA generator asks the driver: the random tokens come unseeded, for this call."""
        generator, randint = torch.Generator, torch.randint
        torch.Generator = lambda device=None: generator()
        torch.randint = lambda *a, generator=None, **k: randint(*a, **k)
        try:
            return make_batches(args, device)
        finally:
            torch.Generator, torch.randint = generator, randint

    bench.make_batches = batches_without_a_cuda_generator
    compile_on_fake_gpu()
    args = [*flags, "--nanochat", checkout or "none"]
    with mode:
        if checkout:
            assert bench.main(args) == 0, "a side failed: its line above says why"
        else:
            args = bench.parse_args(args)
            device = bench.resolve(args)
            ours, names = bench.attentions(args, device)
            batches = bench.make_batches(args, device)
            for precision in args.precision:
                res = bench.run_side("nanomuon", precision, None, args, device, batches, ours)
                assert "tok_s" in res and "error" not in res, res
                print(f"nanomuon {precision}: attention {names['nanomuon']}; {res['notes']}")
    print("h2h ok")


CASES = {"model": case_model, "step": case_step, "loader": case_loader, "autofit": case_autofit,
         "setup": case_setup, "train": case_train, "attention_choice": case_attention_choice,
         "attention_fallback": case_attention_fallback, "attention_windows": case_attention_windows,
         "seed_fold": case_seed_fold, "h2h": case_h2h}


if __name__ == "__main__":
    shim_lib = load_shim(sys.argv[1])
    import torch  # noqa: F401  (loads libtorch_cuda, whose device guard the shim then replaces)

    shim_lib.use_fake_cuda_guard()
    sys.path.insert(0, str(REPO))
    CASES[sys.argv[2]](*sys.argv[3:])
    # past here the interpreter's exit can abort (rc -6, "terminate called without an active
    # exception") in the autograd engine's thread for the fake device: the case passed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
