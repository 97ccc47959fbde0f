"""Which layers each GPU runs when a model is split by layers (a pure function of the file's tensor table).

A split by layers runs the shards one after another for each token: the embedding gather on the first shard,
the output head on the last, and the hidden state [t, n_embd] handed from one shard to the next. A decode
step then takes the sum of the shards' times, but each shard only needs its own weights and caches, and a
prefill can pipeline chunks through the shards. The planner balances the per-token work: every matrix is
read once per decode token and multiplied once per prefill token, so a shard's work is the bytes of the
matrices it owns (Q8_0: 34 bytes per 32 weights, the same for bytes and FLOPs up to a constant). The head
counts on the last shard; the embedding table sits on the first but a token reads one row of it.

The layers are cut into contiguous ranges minimizing the largest shard's work (an exact dynamic program over
the cut points: n_layer <= 64 and shards <= 8 here). Two or more shards may name the same device: they then
cross through pinned host memory exactly as between devices, which is how a single GPU tests the split.
"""
from __future__ import annotations

from dataclasses import dataclass

from ninfer_numba.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    device: int
    first_layer: int
    end_layer: int                # one past the last layer
    embedding: bool               # holds the token embedding (the first shard)
    head: bool                    # holds the output norm and head (the last shard)
    step_bytes: int               # weight bytes one decode token reads here (its layers, the head, one row)
    weight_bytes: int             # weight bytes resident here (the whole embedding table on the first)

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)


def parse_gpus(spec: str) -> list[int]:
    """--gpus: a count N (devices 0 .. N-1) or a comma-separated list of device ids, repeats allowed
    ("0,0": two shards on device 0)."""
    text = spec.strip()
    try:
        if "," in text:
            ids = [int(x) for x in text.split(",") if x.strip()]
        else:
            ids = list(range(int(text)))
    except ValueError:
        raise ValueError(f"--gpus takes a count or a comma-separated list of device ids, not {spec!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise ValueError(f"--gpus needs at least one device and no negative ids (got {spec!r})")
    return ids


def layer_costs(tensor_bytes: dict[str, int], config: ModelConfig) -> tuple[list[int], int, int, int]:
    """(bytes of each layer's tensors, of the output head, of the whole embedding table, of one embedding
    row) from a file's tensor table {name: bytes}: plan_shards' first four arguments. A tied head is the
    embedding table itself (pass tied=config.tied_embeddings)."""
    per_layer = [0] * config.n_layer
    for name, n in tensor_bytes.items():
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if i < config.n_layer:                 # multi-token-prediction blocks after them are not run
                per_layer[i] += n
    embd = tensor_bytes["token_embd.weight"]
    head = tensor_bytes.get("output_norm.weight", 0) + (
        embd if config.tied_embeddings else tensor_bytes["output.weight"])
    return per_layer, head, embd, -(-embd // config.n_vocab)


def plan_shards(layer_bytes: list[int], head_bytes: int, embd_bytes: int, row_bytes: int,
                devices: list[int], tied: bool = False) -> list[Shard]:
    """Contiguous layer ranges, one per device entry, minimizing the largest shard's step bytes; ties go to
    the plan whose earlier shards take more layers. Every shard gets at least one layer. tied: the head is
    the embedding table (head_bytes includes it), so a single shard holds it once."""
    n, k = len(layer_bytes), len(devices)
    if k < 1:
        raise ValueError("no devices to plan for")
    if k > n:
        raise ValueError(f"{k} shards for {n} layers: every shard needs at least one layer")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(s: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (row_bytes if s == 0 else 0) + (head_bytes if s == k - 1 else 0)

    # best[s][b]: the smallest largest-shard cost of layers [0, b) in shards 0..s; cut[s][b]: shard s's start
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, 0, b)
    for s in range(1, k):
        for b in range(s + 1, n + 1):
            for a in range(b - 1, s - 1, -1):            # later starts first: ties keep earlier shards larger
                c = max(best[s - 1][a], cost(s, a, b))
                if c < best[s][b]:
                    best[s][b], cut[s][b] = c, a
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    def resident(s: int) -> int:
        extra = (embd_bytes if s == 0 else 0) + (head_bytes if s == k - 1 else 0)
        return prefix[bounds[s + 1]] - prefix[bounds[s]] + extra - (embd_bytes if tied and k == 1 else 0)

    return [Shard(devices[s], bounds[s], bounds[s + 1], s == 0, s == k - 1, cost(s, bounds[s], bounds[s + 1]),
                  resident(s)) for s in range(k)]


def describe(plan: list[Shard], config: ModelConfig) -> list[str]:
    """One line per shard for `ninfer info --gpus`."""
    lines = []
    for s, sh in enumerate(plan):
        attn = sum(config.is_attention_layer(i) for i in sh.layers)
        parts = ["embedding"] * sh.embedding + [f"layers {sh.first_layer}-{sh.end_layer - 1} "
                                                f"({len(sh.layers) - attn} GDN, {attn} attention)"]
        parts += ["head"] * sh.head
        lines.append(f"shard {s} on GPU {sh.device}: {', '.join(parts)}; {sh.weight_bytes / 1e9:.2f} GB of "
                     f"weights, {sh.step_bytes / 1e9:.3f} GB read per decode token")
    return lines
