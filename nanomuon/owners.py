"""
Who updates what, for DistMuonAdamW and the DTensor path (sharded.py): Muon needs whole matrices,
so each is orthogonalized by one owner rank. Same-shape matrices form a bucket, stacked into one
batched call; owner_buckets() splits every bucket over the ranks by cost (update_cost: the FLOPs
of Newton-Schulz and the stages, from a group's MuonPlan and the shape alone), so every rank
assigns the same owners without talking. AdamW is elementwise and needs no owner
(optim.flat_shard).
"""

import torch

from nanomuon.muon import GRAM_RESTART, MuonPlan


def assign_owners(buckets: list[tuple[int, float]], world_size: int,
                  loads=None) -> list[list[list[int]]]:
    """slots[bucket][rank] = matrix indices: each bucket, (count, cost of one), split over the
    ranks. Every rank gets floor(count / N) of every bucket; the remainders go, costliest bucket
    first, one each to the least loaded ranks (ties to the lower), so the busiest rank exceeds the
    mean by at most one matrix's cost. loads: what each rank already owns."""
    even = sum(count // world_size * cost for count, cost in buckets)
    loads = [even + load for load in (loads or [0.0] * world_size)]
    extra = [[] for _ in buckets]  # extra[b]: ranks that get one more matrix of bucket b
    for b in sorted(range(len(buckets)), key=lambda b: (-buckets[b][1], b)):
        count, cost = buckets[b]
        for r in sorted(range(world_size), key=lambda r: (loads[r], r))[:count % world_size]:
            extra[b].append(r)
            loads[r] += cost
    slots = []
    for (count, _), ranks in zip(buckets, extra):
        sizes = [count // world_size + (r in ranks) for r in range(world_size)]
        slots.append([list(range(sum(sizes[:r]), sum(sizes[:r + 1]))) for r in range(world_size)])
    return slots


def bucket_by(keys: list) -> list[list[int]]:
    """Indices grouped by equal key, buckets in order of first appearance."""
    by_key = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    return list(by_key.values())


def owner_buckets(keys: list, costs: list[float], world_size: int, loads=None) -> list[dict]:
    """Per bucket of matrices of equal keys[i] (costs[i]: Newton-Schulz cost), a dict: members
    (indices), slots (slots[r]: positions in members rank r owns), per_rank (the largest slot
    count, which every rank's stack pads to) and cost (of one). loads: as assign_owners."""
    buckets = bucket_by(keys)
    slots = assign_owners([(len(b), costs[b[0]]) for b in buckets], world_size, loads)
    return [dict(members=b, slots=s, per_rank=max(len(x) for x in s), cost=costs[b[0]])
            for b, s in zip(buckets, slots)]


def ns_flops(shape, ns_steps: int, gram: bool = False) -> float:
    """Newton-Schulz FLOPs for one param, m <= n: K (4 m^2 n + 2 m^3) standard; Gram with r
    restarts, (4 + 4 r) m^2 n + (8 K - 6 (r + 1)) m^3 (fewer from aspect n / m > 1.5, at K = 5)."""
    # not sorted(): SymInts
    m, n = (shape[-2], shape[-1]) if shape[-2] <= shape[-1] else (shape[-1], shape[-2])
    r = (ns_steps - 1) // GRAM_RESTART
    per = ((4 + 4 * r) * m * m * n + (8 * ns_steps - 6 * (r + 1)) * m ** 3 if gram
           else ns_steps * (4 * m * m * n + 2 * m ** 3))
    return torch.Size(shape[:-2]).numel() * per


def gram_pays(shape, ns_steps: int, dtype: torch.dtype) -> bool:
    """Whether 'auto' runs Gram: fewer FLOPs, and not bf16, whose 8-bit mantissa lets R drift
    (Polar Express lands 0.47-0.76 from U V^T where standard bf16 lands 0.10)."""
    return dtype != torch.bfloat16 and ns_flops(shape, ns_steps, True) < ns_flops(shape, ns_steps)


def update_cost(plan: MuonPlan, shape) -> float:
    """The FLOPs of one Muon param's direction under its group's plan: Newton-Schulz as the
    orthogonalizer runs it (an unknown one costs as standard) plus the stages' declared costs."""
    ns, method = plan.ns, plan.orthogonalizer.method
    steps = len(ns.coefficients)
    gram = method == "gram" or (method == "auto" and gram_pays(shape, steps, ns.dtype))
    batch = torch.Size(shape[:-2]).numel()
    return ns_flops(shape, steps, gram) + sum(batch * s.cost(*shape[-2:], plan.options)
                                              for _, _, s in plan.stages if s.cost is not None)
