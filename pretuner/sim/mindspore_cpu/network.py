"""A small decoder-only LLM in MindSpore: embedding, GQA or MLA attention, MLP, LM head.

Random weights, the registry's dimensions. The paged KV cache is one pool tensor allocated at
start and written in place with `scatter_update` (the only in-place row write MindSpore 2.10
runs on CPU; the alternatives copy or fragment the pool). Attention is eager, so activation
memory grows with the square of the prompt; masks avoid kernels that copy through host memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from pretuner.sim.mindspore_cpu.dims import Dims

_DTYPE = ms.float32
_MASKED = -1e9


def _w(*shape: int) -> Tensor:
    return ops.randn(*shape, dtype=_DTYPE) * (1.0 / math.sqrt(shape[0]))


class TinyLM:
    """The network and its paged KV cache."""

    def __init__(self, dims: Dims, seed: int) -> None:
        ms.set_seed(seed)
        self.d = d = dims
        self.embed = _w(d.vocab, d.hidden)
        self.layers: list[dict[str, Tensor]] = []
        q_dim = d.heads * d.head_dim
        for _ in range(d.layers):
            w: dict[str, Tensor] = {"wq": _w(d.hidden, q_dim), "wo": _w(q_dim, d.hidden),
                                    "up": _w(d.hidden, 2 * d.intermediate),
                                    "down": _w(d.intermediate, d.hidden),
                                    "wkv": _w(d.hidden, d.slot_elems)}
            if d.mla:
                nope = d.head_dim - d.rope_dim
                w["wk_b"] = _w(d.kv_lora_rank, d.heads * nope)
                w["wv_b"] = _w(d.kv_lora_rank, d.heads * d.head_dim)
            self.layers.append(w)
        self.lm_head = _w(d.hidden, d.vocab)
        self.cache: Tensor | None = None
        self.block_size = 16
        self.num_slots = 0

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """The KV cache, allocated once at start as vLLM does: layer-major rows of slots."""
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.cache = ops.zeros((self.d.layers * self.num_slots, self.d.slot_elems), _DTYPE)
        self.cache[:1].asnumpy()  # wait for it: the allocation happens now, not at first use

    # -- forward ------------------------------------------------------------------------------
    def forward(self, seqs: list[Seq]) -> list[int]:
        """One engine step: a prefill (one sequence, its prompt) or a decode (several sequences,
        one token each). Writes the new tokens' cache slots; returns each next token (greedy)."""
        if self.cache is None:
            raise RuntimeError("allocate_cache() first")
        d, b, t = self.d, len(seqs), len(seqs[0].tokens)
        if any(len(q.tokens) != t for q in seqs):
            raise ValueError("one step runs sequences of the same number of new tokens")
        s = max(q.past for q in seqs) + t
        new_slots = [self._slot(q.table, q.past + k) for q in seqs for k in range(t)]
        # Keys beyond a sequence's length point at slot 0; the bias masks them.
        key_slots = [self._slot(q.table, j) if j < q.past + t else 0 for q in seqs
                     for j in range(s)]
        bias = _bias(seqs, t, s)
        x = ops.gather(self.embed, Tensor([tok for q in seqs for tok in q.tokens], ms.int32), 0)
        for i, w in enumerate(self.layers):
            base = i * self.num_slots
            h = _rms(x)
            ops.scatter_update(self.cache, Tensor([base + n for n in new_slots], ms.int32),
                               ops.matmul(h, w["wkv"]))
            rows = Tensor([base + n for n in key_slots], ms.int32)
            entries = ops.gather(self.cache, rows, 0).reshape(b, s, d.slot_elems)
            k, v = self._expand(w, entries)
            x = x + ops.matmul(self._attend(ops.matmul(h, w["wq"]), k, v, bias), w["wo"])
            gate, up = ops.chunk(ops.matmul(_rms(x), w["up"]), 2, axis=-1)
            x = x + ops.matmul(ops.silu(gate) * up, w["down"])
        last = x.reshape(b, t, d.hidden)[:, t - 1]
        logits = ops.matmul(_rms(last), self.lm_head)
        # The one host read per step: it also makes MindSpore's asynchronous launches raise
        # their allocation failures here, inside the step that caused them.
        return [int(n) for n in ops.argmax(logits, -1).asnumpy().reshape(-1)]

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _expand(self, w: dict[str, Tensor], entries: Tensor) -> tuple[Tensor, Tensor]:
        """Cache entries (B, S, slot_elems) -> K, V as (B, groups, S, head_dim)."""
        d = self.d
        b, s = entries.shape[0], entries.shape[1]
        if d.mla:
            latent = entries[:, :, : d.kv_lora_rank]
            rope = entries[:, :, d.kv_lora_rank:].reshape(b, s, 1, d.rope_dim)
            nope = ops.matmul(latent, w["wk_b"]).reshape(b, s, d.heads, d.head_dim - d.rope_dim)
            k = ops.cat((nope, ops.broadcast_to(rope, (b, s, d.heads, d.rope_dim))), axis=-1)
            v = ops.matmul(latent, w["wv_b"]).reshape(b, s, d.heads, d.head_dim)
        else:
            half = d.kv_heads * d.head_dim
            k = entries[:, :, :half].reshape(b, s, d.kv_heads, d.head_dim)
            v = entries[:, :, half:].reshape(b, s, d.kv_heads, d.head_dim)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """Attention of B x T queries over S keys each, masked by bias (B, T, S);
        returns (B*T, heads*dim). GQA without repeating K/V: each group's queries are stacked.
        """
        d = self.d
        b, groups, s = k.shape[0], k.shape[1], k.shape[2]
        t = q.shape[0] // b
        rep = d.heads // groups
        qg = (q * (1.0 / math.sqrt(d.head_dim))).reshape(b, t, groups, rep, d.head_dim)
        qg = qg.transpose(0, 2, 3, 1, 4).reshape(b, groups, rep * t, d.head_dim)
        scores = ops.matmul(qg, k.transpose(0, 1, 3, 2)).reshape(b, groups, rep, t, s)
        # broadcast_to first: a broadcasting add copies through host memory on CPU
        scores = scores + ops.broadcast_to(bias.reshape(b, 1, 1, t, s), scores.shape)
        probs = ops.softmax(scores, -1).reshape(b, groups, rep * t, s)
        out = ops.matmul(probs, v).reshape(b, groups, rep, t, d.head_dim)
        return out.transpose(0, 3, 1, 2, 4).reshape(b * t, d.heads * d.head_dim)


@dataclass(frozen=True, slots=True)
class Seq:
    """A sequence in one step: its new tokens after `past` cached ones, and its block table."""

    tokens: list[int]
    table: list[int]
    past: int


def _bias(seqs: list[Seq], t: int, s: int) -> Tensor:
    """(B, T, S) additive mask: query k of sequence b (at position past_b + k) sees keys
    j <= past_b + k. A prefill builds it on the pool; a decode's is small."""
    if len(seqs) == 1:
        return ops.triu(ops.full((t, s), _MASKED, dtype=_DTYPE), diagonal=seqs[0].past + 1)
    pos = np.arange(t).reshape(1, t, 1) + np.array([q.past for q in seqs]).reshape(-1, 1, 1)
    keys = np.arange(s).reshape(1, 1, s)
    return Tensor(np.where(keys > pos, _MASKED, 0.0).astype(np.float32))


def _rms(x: Tensor) -> Tensor:
    return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + 1e-6)
