"""Parallel layouts: (tp, dp, ep), SGLang's rank-to-group maps, and validation against a model config.

The world is one TP group of `tp` ranks (SGLang with DP attention keeps dp inside tp):
- attention TP = tp / dp; attention-TP groups are contiguous blocks, the DP rank is rank // attn_tp
  (sglang `compute_dp_attention_world_info`);
- MoE TP = tp / ep; MoE-TP groups are contiguous blocks of moe_tp ranks, MoE-EP groups are strided by
  moe_tp (sglang `initialize_model_parallel`), and EP rank r owns the contiguous expert block
  [r * E/ep, (r+1) * E/ep).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dpep_parity.fixtures import families


class InvalidLayout(ValueError):
    """A layout that breaks one of the rules; the message names the rule."""


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    dp: int = 1
    ep: int = 1
    dp_lm_head: bool = False

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def __str__(self) -> str:
        s = f"tp{self.tp}-dp{self.dp}-ep{self.ep}"
        return s + ("-dplmhead" if self.dp_lm_head else "")

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """'tp4-dp2-ep2' or 'tp=4,dp=2,ep=2'."""
        vals: dict[str, Any] = {}
        for part in text.replace(",", "-").split("-"):
            part = part.strip()
            if part == "dplmhead":
                vals["dp_lm_head"] = True
                continue
            key = part.rstrip("0123456789=").rstrip("=")
            num = part[len(key):].lstrip("=")
            if key not in ("tp", "dp", "ep") or not num.isdigit() or key in vals:
                raise InvalidLayout(f"cannot parse layout {text!r}: expected e.g. 'tp4-dp2-ep2'")
            vals[key] = int(num)
        if "tp" not in vals:
            raise InvalidLayout(f"cannot parse layout {text!r}: tp is required")
        return cls(**vals)

    # ---- rank maps (pure functions of the global rank) ----
    def dp_rank(self, rank: int) -> int:
        return rank // self.attn_tp

    def attn_tp_rank(self, rank: int) -> int:
        return rank % self.attn_tp

    def moe_ep_rank(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp

    def attn_tp_groups(self) -> list[tuple[int, ...]]:
        a = self.attn_tp
        return [tuple(range(d * a, (d + 1) * a)) for d in range(self.dp)]

    def moe_tp_groups(self) -> list[tuple[int, ...]]:
        m = self.moe_tp
        return [tuple(range(e * m, (e + 1) * m)) for e in range(self.ep)]

    def moe_ep_groups(self) -> list[tuple[int, ...]]:
        m = self.moe_tp
        return [tuple(range(j, self.tp, m)) for j in range(m)]

    def tp_group(self) -> tuple[int, ...]:
        return tuple(range(self.tp))

    def all_groups(self) -> dict[str, list[tuple[int, ...]]]:
        return {"tp": [self.tp_group()], "attn_tp": self.attn_tp_groups(),
                "moe_tp": self.moe_tp_groups(), "moe_ep": self.moe_ep_groups()}

    def local_experts(self, rank: int, num_experts: int) -> range:
        per = num_experts // self.ep
        r = self.moe_ep_rank(rank)
        return range(r * per, (r + 1) * per)


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def layout_violations(layout: Layout, config: Any | None = None) -> list[str]:
    """Every rule the layout breaks (empty when valid). Each message names the rule and the numbers."""
    out: list[str] = []
    tp, dp, ep = layout.tp, layout.dp, layout.ep
    for name, v in (("tp", tp), ("dp", dp), ("ep", ep)):
        if v < 1:
            out.append(f"{name} >= 1: got {name}={v}")
    if out:
        return out
    if tp % dp:
        out.append(f"tp % dp == 0 (DP attention splits the TP group): tp={tp}, dp={dp}")
    if tp % ep:
        out.append(f"tp % ep == 0 (MoE TP = tp/ep must be whole): tp={tp}, ep={ep}")
    if layout.dp_lm_head and dp == 1:
        out.append("dp_lm_head needs dp > 1 (it shards the lm_head over the attention-TP group)")
    if config is None or out:
        return out
    attn_tp, moe_tp = tp // dp, tp // ep
    heads = _cfg(config, "num_attention_heads")
    kv = _cfg(config, "num_key_value_heads", heads)
    if heads % attn_tp:
        out.append(f"num_attention_heads % attn_tp == 0: heads={heads}, attn_tp=tp/dp={attn_tp}")
    if kv % attn_tp and attn_tp % kv:
        out.append(f"num_key_value_heads and attn_tp must divide one another (KV heads split or replicated): "
                   f"kv_heads={kv}, attn_tp={attn_tp}")
    experts = families.num_experts(config)
    if experts:
        if experts % ep:
            out.append(f"num_experts % ep == 0 (contiguous expert blocks): experts={experts}, ep={ep}")
        if tp > experts and ep > 1:
            out.append(f"tp <= num_experts with EP: tp={tp}, experts={experts}")
        moe_i = _cfg(config, "moe_intermediate_size")
        if moe_i % moe_tp:
            out.append(f"moe_intermediate_size % moe_tp == 0: moe_intermediate_size={moe_i}, moe_tp=tp/ep={moe_tp}")
        shared = families.shared_expert_width(config)
        if shared and shared % tp:
            out.append(f"shared expert width % tp == 0 (shared_expert_intermediate_size, or n_shared_experts x "
                       f"moe_intermediate_size; TP-sharded like a dense MLP): {shared} % {tp}")
    dense_i = _cfg(config, "intermediate_size")
    if dense_i and dense_i % tp:
        out.append(f"intermediate_size % tp == 0 (dense MLP is TP-sharded): {dense_i} % {tp}")
    vocab = _cfg(config, "vocab_size")
    head_group = attn_tp if layout.dp_lm_head else tp
    if vocab % head_group:
        out.append(f"vocab_size % lm_head group size == 0: vocab={vocab}, group={head_group}")
    return out


def validate(layout: Layout, config: Any | None = None) -> Layout:
    bad = layout_violations(layout, config)
    if bad:
        raise InvalidLayout(f"invalid layout {layout}: " + "; ".join(bad))
    return layout


def valid_layouts(world_size: int, config: Any | None = None, dp_lm_head: bool = False) -> list[Layout]:
    """All valid (tp, dp, ep) with tp == world_size, smallest dp/ep first."""
    out = []
    for dp in range(1, world_size + 1):
        for ep in range(1, world_size + 1):
            for lm in ((False, True) if dp_lm_head else (False,)):
                lay = Layout(world_size, dp, ep, lm)
                if not layout_violations(lay, config):
                    out.append(lay)
    return out


def layouts_for(fixture: str, world_sizes, with_dp_lm_head: bool = False) -> list[Layout]:
    """Every valid layout of a fixture at these world sizes, smallest world first."""
    cfg = families.fixture_config(fixture)
    out = []
    for ws in sorted(world_sizes):
        out += valid_layouts(ws, cfg, dp_lm_head=with_dp_lm_head)
    return out
