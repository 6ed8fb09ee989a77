"""
Who updates what, for DistMuonAdamW and the DTensor path (sharded.py): Muon needs whole matrices,
so each is orthogonalized by one owner rank. Same-shape matrices form a bucket, stacked into one
batched call; owner_plan() splits every bucket over the ranks by Newton-Schulz cost, from shapes
alone, so every rank computes the same plan without talking. AdamW is elementwise and needs no
owner (optim.flat_shard).
"""


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
    plan = []
    for (count, _), ranks in zip(buckets, extra):
        sizes = [count // world_size + (r in ranks) for r in range(world_size)]
        plan.append([list(range(sum(sizes[:r]), sum(sizes[:r + 1]))) for r in range(world_size)])
    return plan


def bucket_by(keys: list) -> list[list[int]]:
    """Indices grouped by equal key, buckets in order of first appearance."""
    by_key = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    return list(by_key.values())


def owner_plan(keys: list, costs: list[float], world_size: int, loads=None) -> list[dict]:
    """Per bucket of matrices of equal keys[i] (costs[i]: Newton-Schulz cost), a dict: members
    (indices), slots (slots[r]: positions in members rank r owns), per_rank (the largest slot
    count, which every rank's stack pads to) and cost (of one). loads: as assign_owners."""
    buckets = bucket_by(keys)
    slots = assign_owners([(len(b), costs[b[0]]) for b in buckets], world_size, loads)
    return [dict(members=b, slots=s, per_rank=max(len(x) for x in s), cost=costs[b[0]])
            for b, s in zip(buckets, slots)]
