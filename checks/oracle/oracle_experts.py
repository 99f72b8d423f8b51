"""The oracle's experts implementations, chosen through transformers' own switch (`experts_implementation`).

- The float64 truth: `dpep_padded_bmm`, registered with transformers' `ExpertsInterface`. transformers' eager
  experts loop over the routed experts in Python (one GEMM pair, one host sync and one index_add per expert:
  at 128 experts, 25-47 ms a call on the H200 whatever the token count); its `grouped_mm` has no float64 kernel;
  its `batched_mm` gathers one weight matrix per (token, expert) slot and runs out of memory at 2,048 tokens.
  This one sorts the (token, expert) slots by expert, pads every expert's rows to the largest group and runs
  gate|up and down as two batched GEMMs over all experts' weights as stored (no weight copy). Router, gating,
  shared expert and the rest of the model stay transformers' code; the expert arithmetic is the eager loop's
  (x W_gu^T, act(gate) * up, h W_d^T, times the routing weight, summed over a token's experts), in float64, so
  the truth differs from the eager loop's only by float64 rounding (checks/tests/test_oracle_experts.py).
  It shares no code with the targets under test.
- The reference in the test dtype: transformers' `grouped_mm` where torch has the kernel on the device (CUDA:
  what an engine runs), else its eager loop (the CPU tier, calibrated on it). `DPEP_ORACLE_EXPERTS` and
  `DPEP_TRUTH_EXPERTS` override either ("eager", "grouped_mm", "batched_mm", "dpep_padded_bmm").
- The decoy variants' experts (`decoy_experts`): a token's k weighted expert outputs are added in the activation
  dtype in expert order where the reference adds them in float32 and rounds once (transformers' grouped_mm and
  batched_mm, fused MoE kernels). Both habits are legitimate and engines run both (transformers' eager loop
  index_adds in the dtype); with top-8 of 128 experts the dtype habit makes 7 roundings where the other makes 1,
  so a correct target with the eager habit read as a precision fault (+0.088, z = 125 on the H200, 2026-12-03)
  when no legitimate sample had it. `<inner>+dtype_sum` runs transformers' own `<inner>` experts with every
  (token, expert) slot as its own top-1 row, then adds each token's slots in the dtype in expert order: on the
  CPU that is transformers' eager loop bit for bit (checks/tests/test_oracle_experts.py). The decoys already
  run the reference again in other company, so this costs no extra forward.
"""
from __future__ import annotations

import os

import torch

PADDED = "dpep_padded_bmm"
CHOICES = ("auto", "eager", "grouped_mm", "batched_mm", PADDED)
DTYPE_SUM = "+dtype_sum"
FP32_SUMS = ("grouped_mm", "batched_mm")   # transformers' experts that add a token's slots in float32


def padded_bmm_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    if not self.has_gate:
        raise NotImplementedError(f"{PADDED}: gated experts only ({type(self).__name__}); use "
                                  "experts_implementation='eager'")
    n, k = top_k_index.shape
    n_experts = self.gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    slot = ((flat >= 0) & (flat < n_experts)).nonzero().squeeze(1)   # EP sentinels (out of range) dropped
    expert, order = torch.sort(flat[slot], stable=True)
    slot = slot[order]
    per_expert = torch.bincount(expert, minlength=n_experts)
    out = torch.zeros(n * k, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
    if slot.numel():
        first = torch.cumsum(per_expert, 0) - per_expert
        within = torch.arange(slot.numel(), device=slot.device) - first[expert]
        rows = int(per_expert.max())                                    # the one host sync
        x = hidden_states.new_zeros(n_experts, rows, hidden_states.shape[-1])
        x[expert, within] = hidden_states[slot // k]
        # weights as stored: [E, out, in] (x W^T), or [E, in, out] (x W) for transposed experts (GPT-OSS);
        # biased experts (GPT-OSS) add their expert's bias after each GEMM, as the eager loop does
        gate_up = torch.bmm(x, self.gate_up_proj if self.is_transposed else self.gate_up_proj.transpose(1, 2))
        if self.has_bias:
            gate_up = gate_up + self.gate_up_proj_bias[:, None]
        y = torch.bmm(self._apply_gate(gate_up), self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2))
        if self.has_bias:
            y = y + self.down_proj_bias[:, None]
        y = y[expert, within]
        out[slot] = y * top_k_weights.reshape(-1)[slot, None].to(y.dtype)
    return out.view(n, k, hidden_states.shape[-1]).sum(dim=1).to(hidden_states.dtype)


def dtype_sum_forward(inner):
    """transformers' `inner` experts, each (token, expert) slot as its own top-1 row (its weighted output in the
    dtype, as `inner` computes it), then a token's slots added in the dtype in ascending expert order, starting
    from the first (transformers' eager loop: zeros, then one index_add_ per expert in expert order)."""
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = top_k_index.shape
        if n == 0 or k == 1:
            return inner(self, hidden_states, top_k_index, top_k_weights)
        slots = inner(self, hidden_states.repeat_interleave(k, 0), top_k_index.reshape(-1, 1),
                      top_k_weights.reshape(-1, 1)).view(n, k, -1)
        order = top_k_index.argsort(dim=1, stable=True)
        slots = slots.gather(1, order[..., None].expand(-1, -1, slots.shape[-1]))
        acc = slots[:, 0]
        for j in range(1, k):
            acc = acc + slots[:, j]
        return acc
    return forward


def register() -> bool:
    """Register `dpep_padded_bmm` and the `<inner>+dtype_sum` decoys with transformers (idempotent); False where
    this transformers has no experts interface (4.x: eager experts only)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(PADDED, padded_bmm_experts_forward)
    for inner in FP32_SUMS:
        if inner in ALL_EXPERTS_FUNCTIONS:
            ExpertsInterface.register(inner + DTYPE_SUM, dtype_sum_forward(ALL_EXPERTS_FUNCTIONS[inner]))
    return True


def decoy_experts(reference: str) -> str | None:
    """The decoy variants' experts for a reference running `reference`: its dtype-accumulating twin where the
    reference adds a token's expert outputs in float32; None where it already adds them in the dtype (eager)."""
    return reference + DTYPE_SUM if reference in FP32_SUMS else None


def _choice(env: str, default: str) -> str:
    v = os.environ.get(env, "").strip() or default
    if v not in CHOICES:
        raise ValueError(f"{env}={v!r}: one of {', '.join(CHOICES)}")
    return v


def truth_experts() -> str:
    v = _choice("DPEP_TRUTH_EXPERTS", "auto")
    return PADDED if v == "auto" else v


def reference_experts(dtype: torch.dtype, device: str) -> str:
    """auto: transformers' grouped_mm on CUDA for the dtypes torch has it (bf16, fp16, fp32), else eager."""
    v = _choice("DPEP_ORACLE_EXPERTS", "auto")
    if v != "auto":
        return v
    cuda = str(device).startswith("cuda")
    return "grouped_mm" if cuda and grouped_available() and dtype in (torch.bfloat16, torch.float16, torch.float32) \
        else "eager"


def grouped_available() -> bool:
    """Whether this torch has a grouped GEMM (transformers' `grouped_mm` experts use it)."""
    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
