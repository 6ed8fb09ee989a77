"""
The GPT that nanomuon trains, small and modern: rotary positions, QK-norm, parameter-free RMSNorm,
ReLU^2 MLP, untied lm_head, no biases, a tanh logit softcap, zero-initialized output projections,
SDPA or the kernel use_attention() installs (nanomuon.attention). Its size follows from --depth
(docs/training.md); what it builds and how it trains are its arch's (nanomuon/arch.py), whose
param_groups() setup_optimizer() hands to MuonAdamW.
"""

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanomuon.arch import ARCHS, Variant, param_groups
from nanomuon.common import shown
from nanomuon.optim import DistMuonAdamW, MuonAdamW
from nanomuon.qk_clip import qk_clip_
from nanomuon.recipe import PeakLRs
from nanomuon.sharded import DTensor
from nanomuon.stages import input_block, input_covariance

VE_GATE_CHANNELS = 12  # the value-embedding gate reads the first 12 channels of a block's input
SMEAR_CHANNELS = 24  # the smear gate reads the first 24 channels of the embedding


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    softcap: float = 15.0
    rope_base: float | None = None  # None: the arch's (Arch.rope_base)
    qk_norm: bool = True  # without it, logits can grow (QK-clip: GPT.qk_clip_)
    arch: str = "classic"
    # tiled over the layers: L the whole context, S its last quarter (window_sizes); classic: L
    window_pattern: str = "L"

    def __post_init__(self):
        if self.rope_base is None and isinstance(self.arch, str) and self.arch in ARCHS:
            self.rope_base = ARCHS[self.arch].rope_base
        problems = []
        if self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        elif (self.n_embd // self.n_head) % 2:
            problems.append(f"head dim {self.n_embd // self.n_head} must be even "
                            "for rotary embeddings")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            problems.append(f"n_head={self.n_head} must be a multiple of "
                            f"n_kv_head={self.n_kv_head}")
        problems += [f"{key}={getattr(self, key)} must be >= 1"
                     for key in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_embd")
                     if getattr(self, key) < 1]
        problems += self._arch_problems()
        if problems:
            raise ValueError("bad GPTConfig: " + "; ".join(problems))

    def _arch_problems(self) -> list[str]:
        if not isinstance(self.arch, str) or self.arch not in ARCHS:
            return [f"arch={shown(self.arch, 60)} is not one of {tuple(ARCHS)}"]
        if (not isinstance(self.window_pattern, str) or not self.window_pattern
                or set(self.window_pattern.upper()) - {"S", "L"}):
            return [f"window_pattern={shown(self.window_pattern, 60)} must be letters S and L"]
        if len(self.window_pattern) > max(self.n_layer, 4):  # a layer reads one; SSSL always fits
            return [f"window_pattern has {len(self.window_pattern)} letters for {self.n_layer} "
                    f"layers: give at most {max(self.n_layer, 4)} (one a layer, tiled)"]
        if not ARCHS[self.arch].windows and set(self.window_pattern.upper()) != {"L"}:
            return [f"window_pattern={self.window_pattern!r} needs arch='nanochat'"]
        if ARCHS[self.arch].extras and self.n_embd < SMEAR_CHANNELS:
            return [f"n_embd={self.n_embd} is below the {SMEAR_CHANNELS} channels arch='nanochat' "
                    "gates the smear by"]
        return []

    def to_dict(self) -> dict:
        return asdict(self)

    def window_sizes(self) -> list[int | None]:
        """Each layer's window as keys before the query (FA3's left window), None for the whole
        context: S is ceil(sequence_len / 4 / 128) x 128 tokens (FA3's tile); the last is L."""
        short = -(-self.sequence_len // 4 // 128) * 128
        pattern = self.window_pattern.upper()
        sizes = [short if pattern[i % len(pattern)] == "S" else None for i in range(self.n_layer)]
        sizes[-1] = None
        return [None if w is not None and w >= self.sequence_len else w for w in sizes]


def config_from_depth(depth: int, vocab_size: int, sequence_len: int, aspect_ratio: int = 64,
                      head_dim: int = 128, qk_norm: bool = True, arch: str = "classic",
                      window_pattern: str | None = None) -> GPTConfig:
    """nanochat's sizing: width = depth * aspect_ratio rounded up to head_dim; one head per
    head_dim. Windows tile the arch's pattern (nanochat's SSSL) unless window_pattern is given."""
    if depth < 1 or aspect_ratio < 1 or head_dim < 2 or head_dim % 2:
        raise ValueError(f"bad model size: depth={depth}, aspect_ratio={aspect_ratio}, "
                         f"head_dim={head_dim} (need depth >= 1, aspect_ratio >= 1, an even "
                         "head_dim >= 2)")
    n_embd = math.ceil(depth * aspect_ratio / head_dim) * head_dim
    n_head = n_embd // head_dim
    pattern = window_pattern or (ARCHS[arch].window_pattern if arch in ARCHS else "L")
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                     n_kv_head=n_head, n_embd=n_embd, qk_norm=qk_norm, arch=arch,
                     window_pattern=pattern)


def has_value_embedding(layer: int, n_layer: int) -> bool:
    """Whether layer `layer` adds a value embedding: every other layer, the last included."""
    return layer % 2 == (n_layer - 1) % 2


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    # x: (B, T, H, D); (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin) with full-width tables
    # (GPT._rotary_tables): two contiguous products, 1.4x faster on CPU than four on the halves.
    # The tables take x's dtype so that bf16 autocast keeps q and k bf16.
    return x * cos.to(x.dtype) + x.roll(x.size(-1) // 2, dims=-1) * sin.to(x.dtype)


def window_mask(T: int, window: int, device) -> torch.Tensor:
    """(T, T) bool: query i sees keys i - window .. i (FA3's window_size=(window, 0))."""
    i = torch.arange(T, device=device)
    behind = i[:, None] - i[None, :]
    return (behind >= 0) & (behind <= window)


def sdpa(q, k, v, window: int | None = None):
    """Causal SDPA on (B, T, heads, head_dim) tensors; a window that cuts the context is a mask."""
    T = q.size(1)
    cut = window is not None and window < T - 1
    masking = dict(attn_mask=window_mask(T, window, q.device)) if cut else dict(is_causal=True)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       enable_gqa=k.size(2) != q.size(2), **masking)
    return y.transpose(1, 2)


def inputs_of(x: torch.Tensor, prefix: str, **linears) -> dict:
    """prefix + name -> stages.input_covariance of each linear layer x feeds, once a size."""
    out, made = {}, {}
    for name, lin in linears.items():
        rows, cols = lin.weight.shape[-2:]
        b = input_block(rows, cols)
        if b not in made:
            made[b] = input_covariance(x, rows, cols)
        out[f"{prefix}{name}.weight"] = made[b]
    return out


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        d, kv = config.n_embd, config.n_kv_head * self.head_dim
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, kv, bias=False)
        self.c_v = nn.Linear(d, kv, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.qk_norm = config.qk_norm
        arch = ARCHS[config.arch]
        self.qk_scale = arch.qk_scale
        self.window = config.window_sizes()[layer]
        self.prefix = f"blocks.{layer}.attn."  # its params' names, for GPT.forward's input_stats
        # the value embedding's gate per kv head: 3 sigmoid(W x[:12]) (ResFormer's value residual)
        self.ve_gate = (nn.Linear(VE_GATE_CHANNELS, config.n_kv_head, bias=False)
                        if arch.extras and has_value_embedding(layer, config.n_layer) else None)
        self.max_logits = None  # per-head max pre-softmax logit (GPT.track_max_logits)
        self.attend = None  # what replaces sdpa (GPT.use_attention)

    def forward(self, x, cos, sin, ve=None, stats: dict | None = None):
        B, T, C = x.shape
        if stats is not None:  # each matrix's inputs (GPT.forward's input_stats)
            stats.update(inputs_of(x, self.prefix, c_q=self.c_q, c_k=self.c_k, c_v=self.c_v))
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            if stats is not None:
                stats.update(inputs_of(x[..., :VE_GATE_CHANNELS], self.prefix,
                                       ve_gate=self.ve_gate))
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            # in v's dtype: under autocast the fp32 embedding would otherwise promote v to fp32
            v = v + gate.unsqueeze(-1) * ve.view_as(v).to(v.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.qk_norm:
            q, k = norm(q), norm(k)
        if self.qk_scale != 1.0:
            q, k = q * self.qk_scale, k * self.qk_scale
        if self.max_logits is not None:
            self._track_max_logits(q.transpose(1, 2), k.transpose(1, 2))
        y = (self.attend or sdpa)(q, k, v, self.window).reshape(B, T, C)
        if stats is not None:
            stats.update(inputs_of(y, self.prefix, c_proj=self.c_proj))
        return self.c_proj(y)

    @torch.compiler.disable
    @torch.no_grad()
    def _track_max_logits(self, q, k):
        """max_logits = max(max_logits, each head's largest causal q.k / sqrt(head_dim)). SDPA never
        materializes the logits, so they are recomputed, a batch row at a time (one more QK^T)."""
        B, H, T, D = q.shape
        groups = H // self.n_kv_head
        qg = q.float().reshape(B, self.n_kv_head, groups, T, D)
        kf = k.float().unsqueeze(2)
        hidden = (~window_mask(T, T if self.window is None else self.window, q.device))
        for b in range(B):
            scores = (qg[b] @ kf[b].mT).masked_fill_(hidden, float("-inf"))
            torch.maximum(self.max_logits, scores.amax(dim=(-2, -1)).reshape(H) * D ** -0.5,
                          out=self.max_logits)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.prefix = f"blocks.{layer}.mlp."
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x, stats: dict | None = None):
        h = F.relu(self.c_fc(x))
        # not .square(): autocast runs pow in fp32, and backward would keep that 4x-wide copy
        h = h * h
        if stats is not None:  # each matrix's inputs (GPT.forward's input_stats)
            stats.update(inputs_of(x, self.prefix, c_fc=self.c_fc)
                         | inputs_of(h, self.prefix, c_proj=self.c_proj))
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer)
        self.mlp = MLP(config, layer)

    def forward(self, x, cos, sin, ve=None, stats: dict | None = None):
        x = x + self.attn(norm(x), cos, sin, ve, stats)
        return x + self.mlp(norm(x), stats)


# fp32 copies of a block SoftcapCrossEntropy holds: scaled logits, sigmoid, softcapped, softmax
LOSS_BLOCK_TEMPS = 4


def loss_block_rows(n: int, vocab: int, device: torch.device) -> int:
    """Rows per block of SoftcapCrossEntropy: on CUDA as many as fit a quarter of the free memory
    (a block costs a few kernels whatever its size); elsewhere 1 MiB of fp32, a CPU's cache."""
    if device.type != "cuda":
        return max(1, min(n, (1 << 18) // vocab))
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(1, min(n, free // 4 // (LOSS_BLOCK_TEMPS * 4 * vocab)))


class SoftcapCrossEntropy(torch.autograd.Function):
    """cross_entropy(cap * tanh(logits / cap), targets) in one cached pass of row blocks, making
    the gradient on the way (eager autograd takes a dozen full-size passes; compiled, inductor
    fuses the plain expression). Returns (loss, gradient), so that torch.func sees the gradient."""

    @staticmethod
    def forward(logits, targets, cap: float, reduction: str, make_grad: bool):
        if reduction not in ("mean", "none"):
            raise ValueError(f"loss_reduction must be 'mean' or 'none', not {reduction!r}")
        n, vocab = logits.shape
        valid = targets != -1
        n_valid = valid.sum()
        # other negatives stay, and gather refuses them
        target = targets.masked_fill(~valid, 0).unsqueeze(1)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        # d loss / d logit row: (softmax - onehot) * d softcap (/ n for the mean), fp32 until stored
        count = n_valid.clamp(min=1).to(dtype)  # all -1: zero gradients, as F.cross_entropy gives
        scale = valid.unsqueeze(1) * (4 / count if reduction == "mean" else 4.0)
        # needs_input_grad ignores no_grad: the caller knows
        grad = torch.empty_like(logits) if make_grad else None
        loss = torch.empty(n, dtype=dtype, device=logits.device)
        rows = loss_block_rows(n, vocab, logits.device)
        for a in range(0, n, rows):
            b = min(n, a + rows)
            # cap * tanh(l / cap) = 2cap * sigmoid(2l / cap) - cap; the loss ignores the shift, and
            # sigmoid costs a sixth of tanh on CPU. Its slope is 4 sigmoid(x) sigmoid(-x),
            # x = 2l / cap (not 4 s (1 - s): near saturation 1 - s keeps few of s's bits).
            x = logits[a:b].to(dtype, copy=True).mul_(2 / cap)
            s = torch.sigmoid(x)
            z = s * (2 * cap)
            p = torch.softmax(z, dim=1)
            # logsumexp(z) = max z - log max p, exact, and max p >= 1/vocab cannot underflow
            loss[a:b] = z.amax(1) - p.amax(1).log_() - z.gather(1, target[a:b]).squeeze(1)
            if grad is not None:
                p.scatter_add_(1, target[a:b], p.new_full((b - a, 1), -1.0))
                grad[a:b] = p.mul_(x.neg_().sigmoid_().mul_(s)).mul_(scale[a:b])
        loss = loss.where(valid, 0.0)
        return (loss.sum() / n_valid if reduction == "mean" else loss), grad

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad, ctx.reduction = output[1], inputs[3]
        if grad is not None:
            ctx.mark_non_differentiable(grad)
            ctx.save_for_backward(grad)

    @staticmethod
    def backward(ctx, grad_loss, _):
        # scaled in place: a second backward through the same graph is refused
        (grad,) = ctx.saved_tensors
        return (grad.mul_(grad_loss if ctx.reduction == "mean" else grad_loss.unsqueeze(1)),
                None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, logits, targets, cap, reduction, make_grad):
        """Under torch.vmap (batched seeds): one call on every seed's rows, a mean per seed."""
        size = info.batch_size
        logits, targets = (t.movedim(d, 0) if d is not None else t.expand(size, *t.shape)
                           for t, d in zip((logits, targets), in_dims))
        # a batched tensor does not show that it requires grad; the tensor under it does
        make_grad = make_grad or (torch.is_grad_enabled() and logits.requires_grad)
        loss, grad = SoftcapCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), cap,
                                               "none", make_grad)
        loss = loss.view(targets.shape)
        if reduction == "mean":
            loss = loss.sum(1) / (targets != -1).sum(1)
        return (loss, grad if grad is None else grad.view(logits.shape)), (0, None if grad is None else 0)


def softcap_cross_entropy(logits, targets, cap: float, reduction: str = "mean",
                          make_grad: bool = True):
    """The loss of SoftcapCrossEntropy: (n, vocab) logits, (n,) targets (-1 ignored)."""
    return SoftcapCrossEntropy.apply(logits, targets, cap, reduction, make_grad)[0]


def scaling_params(config: GPTConfig) -> int:
    """GPT.num_scaling_params of a model of this config, built on the meta device."""
    with torch.device("meta"):
        return GPT(config).num_scaling_params()


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if ARCHS[config.arch].extras:  # modded-nanogpt's ideas, as nanochat has them
            L, kv = config.n_layer, config.n_kv_head * (config.n_embd // config.n_head)
            # each layer's input: resid_lambdas[i] x + x0_lambdas[i] x0 (x0: the embedding, smeared)
            self.resid_lambdas = nn.Parameter(torch.ones(L))
            self.x0_lambdas = nn.Parameter(torch.zeros(L))
            # smear: the previous token's embedding mixed in, gated by the first 24 channels
            self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
            # backout: this fraction of the middle layer's output is taken away before the head
            self.backout_lambda = nn.Parameter(torch.zeros(1))
            # value embeddings, added to v (ResFormer): every other layer, the last included
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv)
                                               for i in range(L) if has_value_embedding(i, L)})
        cos, sin = self._rotary_tables(config.sequence_len)
        # derived from the config, never checkpointed
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # or the number of seeds stacked on dim 0 of every parameter (nanomuon/seeds.py)
        self.seeds: int | None = None

    def _rotary_tables(self, seq_len: int, device=None):
        head_dim = self.config.n_embd // self.config.n_head
        inv_freq = self.config.rope_base ** -(torch.arange(0, head_dim, 2, device=device).float()
                                              / head_dim)
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
        # (1, T, 1, D), as apply_rotary takes
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, -sin], dim=-1)

    @torch.no_grad()
    def init_weights(self):
        """Hidden matrices uniform at std 1/sqrt(fan_in), output projections zero (each block starts
        as the identity), a small lm_head (flat early logits); arch 'nanochat' as nanochat does."""
        arch = ARCHS[self.config.arch]
        nn.init.normal_(self.wte.weight, std=arch.embedding_std)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        bound = math.sqrt(3.0 / self.config.n_embd)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                nn.init.uniform_(lin.weight, -bound, bound)
            fc = bound * arch.fc_init
            nn.init.uniform_(block.mlp.c_fc.weight, -fc, fc)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        if arch.extras:  # Python floats rounded to fp32 once: nanochat's values to the bit
            L = self.config.n_layer
            last = max(L - 1, 1)
            self.resid_lambdas.copy_(torch.tensor([1.15 - 0.10 * i / last for i in range(L)]))
            self.x0_lambdas.copy_(torch.tensor([0.20 - 0.15 * i / last for i in range(L)]))
            nn.init.zeros_(self.smear_lambda)
            nn.init.constant_(self.backout_lambda, 0.2)
            nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
            for ve in self.value_embeds.values():
                nn.init.uniform_(ve.weight, -bound, bound)
            for block in self.blocks:
                if block.attn.ve_gate is not None:
                    nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)
        cos, sin = self._rotary_tables(self.config.sequence_len, device=self.wte.weight.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, idx, targets=None, loss_reduction: str = "mean", input_stats: bool = False):
        """fp32 logits without targets, else the loss (-1 ignored; per token with 'none').
        input_stats: also each block matrix's input covariance by name (MuonAdamW.give_inputs)."""
        B, T = idx.shape
        if idx.size(1) > self.cos.size(1):
            raise ValueError(f"sequence of {T} tokens is longer than the model's sequence_len "
                             f"{self.config.sequence_len}")
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        x, stats = norm(self.wte(idx)), {} if input_stats else None
        if ARCHS[self.config.arch].extras:
            x = self._trunk_nanochat(idx, x, cos, sin, stats)
        else:
            for block in self.blocks:
                x = block(x, cos, sin, None, stats)
        out = self._head(norm(x), targets, loss_reduction)
        return out if stats is None else (out, stats)

    def _trunk_nanochat(self, idx, x, cos, sin, stats: dict | None = None):
        """Smear, the blocks (each fed resid_lambdas[i] x + x0_lambdas[i] x0 and its value
        embedding), then backout: backout_lambda times the middle layer's output taken away."""
        if x.size(1) > 1:
            gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, 1:, :SMEAR_CHANNELS]))
            x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        x0, middle, mid = x, None, self.config.n_layer // 2
        for i in range(len(self.blocks)):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x = self.blocks[i](x, cos, sin, ve, stats)
            if i == mid:
                middle = x
        return x if middle is None else x - self.backout_lambda * middle

    def _head(self, x, targets, loss_reduction: str):
        logits = self.lm_head(x)
        cap = self.config.softcap
        # eager: softcap and loss in one pass
        if targets is not None and not torch.compiler.is_compiling():
            loss = softcap_cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                         cap, loss_reduction,
                                         torch.is_grad_enabled() and logits.requires_grad)
        else:  # compiled, inductor fuses the plain expression
            logits = cap * torch.tanh(logits.float() / cap)
            if targets is None:
                return logits
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1, reduction=loss_reduction)
        return loss.view(x.shape[:2]) if loss_reduction == "none" else loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def num_scaling_params(self) -> int:
        """The parameters a horizon counts (nanochat's scaling laws): blocks and lm_head."""
        return sum(p.numel() for p in self.blocks.parameters()) + self.lm_head.weight.numel()

    def estimate_flops(self) -> float:
        """Training FLOPs a token, as nanochat counts: 6 per linear weight, plus 12 * width * the
        keys each layer sees (causal masking not discounted, as in PaLM's MFU)."""
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        c = self.config
        # window_sizes gives None for a window that spans the context, so each w is under it
        keys = sum(c.sequence_len if w is None else w for w in c.window_sizes())
        return 6 * matmul + 12 * c.n_embd * keys

    def setup_optimizer(self, variant: Variant | None = None, lrs: PeakLRs | None = None,
                        horizon: int | None = None, compile: bool | None = None):
        """MuonAdamW on arch.param_groups(self, variant, lrs, horizon), DistMuonAdamW under
        torch.distributed, or the variant's optimizer_class on them."""
        groups = param_groups(self, variant, lrs, horizon)
        if variant is not None and variant.optimizer_class is not None:
            return variant.optimizer_class(groups)
        # replicated params need DistMuonAdamW to average their grads; DTensors arrive reduced
        replicated = any(not isinstance(p, DTensor) for p in self.parameters())
        cls = (DistMuonAdamW if dist.is_available() and dist.is_initialized() and replicated
               else MuonAdamW)
        return cls(groups, compile=compile)

    def use_attention(self, func: Callable | None) -> None:
        """Every layer's attention through `func` (attention.Attention.func) in sdpa's place."""
        for block in self.blocks:
            block.attn.attend = func

    def track_max_logits(self, on: bool = True) -> None:
        """Start (afresh) or stop recording each head's max pre-softmax logit, for qk_clip_()."""
        for attn in (block.attn for block in self.blocks):
            attn.max_logits = (torch.full((attn.n_head,), float("-inf"),
                                          device=attn.c_q.weight.device) if on else None)

    @torch.no_grad()
    def qk_clip_(self, tau: float, alpha: float = 0.5) -> int:
        """QK-clip every layer from the logits tracked since track_max_logits(); returns how many
        heads were clipped. For models without QK-norm (with it, rescaling does nothing)."""
        clipped = 0
        for attn in (block.attn for block in self.blocks):
            if attn.max_logits is None:
                raise RuntimeError("qk_clip_ needs the logits: call model.track_max_logits() "
                                   "before the forward pass")
            gamma = qk_clip_(attn.c_q.weight, attn.c_k.weight, attn.max_logits, attn.n_head,
                             attn.n_kv_head, tau, alpha)
            clipped += int((gamma < 1).sum())
        return clipped

    @torch.no_grad()
    def generate(self, tokens: list[int], max_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 42):
        """Yield sampled token ids one at a time (no KV cache: each re-runs sequence_len tokens)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        device = self.wte.weight.device
        rng = torch.Generator(device=device).manual_seed(seed)
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        for _ in range(max_tokens):
            logits = self(ids[:, -self.config.sequence_len:])[:, -1, :]
            if top_k is not None and top_k > 0:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits = logits.masked_fill(logits < v[:, [-1]], -float("inf"))
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1,
                                        generator=rng)
            ids = torch.cat([ids, nxt], dim=1)
            yield nxt.item()
