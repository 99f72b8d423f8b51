"""Batches as the engine sees them: requests per DP rank, forward modes and the DP padding mode.

A request is (prefix, extend): `prefix` tokens already in the KV cache, `extend` new tokens this forward.
Decode is extend == 1 after a non-empty prefix; a DP rank with no request is IDLE (it still joins every
collective). Inputs are never shipped: every process rebuilds them from (seed, shapes) with `inputs()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

EXTEND, DECODE, IDLE = "extend", "decode", "idle"
SUM_LEN, MAX_LEN = "sum_len", "max_len"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


@dataclass(frozen=True)
class Request:
    prefix: int
    extend: int
    stream: int | None = None     # whose contents: the random stream of its inputs (None: its global index).
                                  # The invariance properties place one request's contents in other batches.

    @property
    def total(self) -> int:
        return self.prefix + self.extend


@dataclass(frozen=True)
class Batch:
    per_dp: tuple[tuple[Request, ...], ...]
    seed: int = 0

    @classmethod
    def from_counts(cls, counts: Sequence[int], seed: int = 0, decode: bool = False) -> "Batch":
        """One request per non-idle DP rank: `count` extend tokens, or `count` decode requests."""
        per = []
        for c in counts:
            if decode:
                per.append(tuple(Request(3 + i, 1) for i in range(c)))
            else:
                per.append((Request(0, c),) if c else ())
        return cls(tuple(per), seed)

    @property
    def dp(self) -> int:
        return len(self.per_dp)

    def tokens_per_dp(self) -> list[int]:
        return [sum(r.extend for r in reqs) for reqs in self.per_dp]

    def forward_modes(self) -> list[str]:
        out = []
        for reqs in self.per_dp:
            if not reqs or sum(r.extend for r in reqs) == 0:
                out.append(IDLE)
            elif all(r.extend == 1 and r.prefix > 0 for r in reqs):
                out.append(DECODE)
            else:
                out.append(EXTEND)
        return out

    @property
    def is_extend_in_batch(self) -> bool:
        return EXTEND in self.forward_modes()

    @property
    def nobody_runs(self) -> bool:
        """The scheduler's rule: when every DP rank is idle no forward happens at all."""
        return all(m == IDLE for m in self.forward_modes())

    def local_slice(self, dp_rank: int) -> slice:
        """The DP rank's requests as a slice of the global request order (requests_flat)."""
        before = sum(len(r) for r in self.per_dp[:dp_rank])
        return slice(before, before + len(self.per_dp[dp_rank]))

    def requests_flat(self) -> list[tuple[int, int, Request]]:
        """(dp_rank, index within the rank, request) in global order."""
        return [(d, i, r) for d, reqs in enumerate(self.per_dp) for i, r in enumerate(reqs)]

    def describe(self) -> str:
        parts = []
        for d, reqs in enumerate(self.per_dp):
            parts.append(f"dp{d}:" + ("idle" if not reqs else ",".join(
                f"{r.prefix}+{r.extend}" + ("" if r.stream is None else f"@{r.stream}") for r in reqs)))
        return " ".join(parts) + f" seed={self.seed}"


def padding_mode(batch: Batch, ties: str = MAX_LEN) -> str | None:
    """sglang `DpPaddingMode.get_dp_padding_mode` without all-to-all backends or custom all-reduce:
    SUM_LEN whenever a rank extends (MAX_LEN would pad prefill, bug B12), else the cheaper of the two.
    `ties`: the mode chosen when both cost the same (sum * 2 == max * dp), an engine's policy, neither wrong:
    MAX_LEN since sglang 0.5.10 (symmetric memory), SUM_LEN before (a target's `padding_ties`)."""
    counts = batch.tokens_per_dp()
    if batch.nobody_runs:
        return None
    if batch.is_extend_in_batch and batch.dp > 1:
        return SUM_LEN
    cost = sum(counts) * 2 - max(counts) * batch.dp
    return MAX_LEN if cost > 0 else ties if cost == 0 else SUM_LEN


def ceil_align(n: int, a: int) -> int:
    return -(-n // a) * a


def _stream(seed: int, request: int, part: int) -> torch.Generator:
    """The random stream of one part (0: prefix, 1: extend) of one request (its global index) of a batch."""
    return torch.Generator().manual_seed((seed * 1_000_003 + request) * 2 + part)


def seq_inputs(batch: Batch, hidden: int, dtype: torch.dtype, scale: float = 1.0, only=None,
               extend_only: bool = False) -> list[torch.Tensor]:
    """Per request (global order; only the global request indices in `only`, if given): hidden states
    [prefix + extend, hidden] (the extend rows alone with `extend_only`), drawn in float32 and converted to
    `dtype`. Each request's prefix and extend rows come from streams of their own (batch seed, request, part),
    so a rank draws only its own requests' rows and an MLP unit only the extend rows, with the same values.
    float32, not float64: torch's CPU draws them 5x faster and converts them to bfloat16 10x faster (measured
    at 164 x 2048: 1.8 vs 9.7 ms to draw, and 25.6 ms for float64 -> bfloat16); rounded to a half-precision
    dtype a float32 draw is as random as a float64 one, and in float32 or float64 the inputs are the draw."""
    out = []
    for j, (_, _, r) in enumerate(batch.requests_flat()):
        if only is not None and j not in only:
            continue
        k = contents(r, j)
        parts = [] if extend_only or not r.prefix else \
            [torch.randn(r.prefix, hidden, generator=_stream(batch.seed, k, 0), dtype=torch.float32)]
        parts.append(torch.randn(r.extend, hidden, generator=_stream(batch.seed, k, 1), dtype=torch.float32))
        out.append((torch.cat(parts) * scale).to(dtype))
    return out


def seq_token_ids(batch: Batch, vocab: int, only=None) -> list[torch.Tensor]:
    """Per request (global order; only the indices in `only`, if given): token ids [prefix + extend]."""
    return [torch.randint(0, vocab, (r.total,), generator=_stream(batch.seed, contents(r, j), 0))
            for j, (_, _, r) in enumerate(batch.requests_flat()) if only is None or j in only]


def contents(r: Request, j: int) -> int:
    """The stream key of request `r` at global index `j`: its own `stream` if it names one."""
    return j if r.stream is None else r.stream


def parse_batch(text: str) -> Batch:
    """Inverse of Batch.describe(): 'dp0:0+5,3+1 dp1:idle seed=1'."""
    per, seed = [], 0
    for part in text.split():
        try:
            if part.startswith("seed="):
                seed = int(part[5:])
                continue
            name, colon, reqs = part.partition(":")
            if not colon or name != f"dp{len(per)}":
                raise ValueError(f"expected 'dp{len(per)}:...' here")
            if reqs == "idle":
                per.append(())
                continue
            pairs = [r.partition("@") for r in reqs.split(",")]
            shapes = [a.split("+") for a, _, _ in pairs]
            if any(len(p) != 2 or not all(x.isdigit() for x in p) for p in shapes) or \
                    any(at and not stream.isdigit() for _, at, stream in pairs):
                raise ValueError("requests are PREFIX+EXTEND or PREFIX+EXTEND@STREAM, comma-separated")
            per.append(tuple(Request(int(a), int(b), int(st) if at else None)
                             for (a, b), (_, at, st) in zip(shapes, pairs)))
        except ValueError as e:
            raise ValueError(f"batch part {part!r}: {e} (the form is 'dp0:0+5,3+1 dp1:idle seed=1')") from None
    if not per:
        raise ValueError(f"batch {text!r} names no DP rank (the form is 'dp0:0+5,3+1 dp1:idle seed=1')")
    return Batch(tuple(per), seed)


def batch_problems(batch, config: dict, fixture: str) -> list[str]:
    """A request longer than the model's positions (an engine's rotary cache ends there: SGLang raises an
    IndexError deep in its rotary embedding, which would read as the system's crash)."""
    limit = config.get("max_position_embeddings")
    longest = max((r.total for _, _, r in batch.requests_flat()), default=0)
    if limit and longest > limit:
        return [f"a request of {longest} tokens exceeds {fixture}'s max_position_embeddings ({limit})"]
    return []
