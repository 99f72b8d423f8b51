"""SGLang's ForwardBatch for one rank's part of a step, with its KV slots in SGLang's pools.

What SGLang's scheduler would hand the model runner is rebuilt from the suite's batch metadata, which every
rank holds whole: the rank's requests (prefix in the cache, extend new tokens), their request rows and token
slots taken from SGLang's own allocators (`ReqToTokenPool`'s allocation, `TokenToKVPoolAllocator.alloc`,
written into `req_to_token` as the scheduler does), positions from SGLang's `compute_position` (extend) or
`clamp_position` (decode), and under DP attention the per-DP-rank counts the scheduler all-gathers
(`global_num_tokens`, and `global_num_tokens_for_logprob` by the scheduler's own rule: one row per request to
sample in extend, every row in decode). Then SGLang's eager preparation runs: `ModelRunner.
_prepare_eager_forward_batch` (attention-TP alignment, the DP padding mode, MAX_LEN padding of inputs, request
rows and cache slots, gathered-buffer sizes, `num_token_non_padded`) and the backend's
`init_forward_metadata`, as `EagerRunner` does before `model.forward`.
"""
from __future__ import annotations

import torch

from dpep_parity.checks.core.batches import DECODE, EXTEND, IDLE, Batch, Request
from dpep_parity.checks.targets.sglang.eras import StandIn, set_fields


class _RunnerStub(StandIn):
    """What ModelRunner._prepare_eager_forward_batch / ForwardBatch.prepare_mlp_sync_batch read of the model
    runner, outside the attention backend: the methods are SGLang's own (bound below)."""

    is_draft_worker = False
    enable_elastic_ep = False
    lora_manager = None
    hisparse_coordinator = None
    mambaish_config = None           # ModelRunner's property: None for models without Mamba layers (0.5.15)

    def __init__(self, server_args, model_config, attn_backend):
        self.server_args = server_args          # read by the preparation of 0.5.16 - 0.5.18
        self.model_config = model_config
        self.attn_backend = attn_backend


def _bind_runner_methods():
    from sglang.srt.model_executor.model_runner import ModelRunner
    # attn_tp_sequence_sharded: ModelRunner's since 0.5.20 (the preparation before it does not call it)
    if hasattr(ModelRunner, "attn_tp_sequence_sharded"):
        _RunnerStub.attn_tp_sequence_sharded = ModelRunner.attn_tp_sequence_sharded
    _RunnerStub.bound = True


def prefix_batch(batch: Batch) -> Batch:
    """The priming step: every request's prefix as an extend from an empty cache (ranks without one idle)."""
    return Batch(tuple(tuple(Request(0, r.prefix) for r in reqs if r.prefix) for reqs in batch.per_dp), batch.seed)


def logprob_rows(reqs: tuple[Request, ...], mode: str) -> int:
    """SGLang's scheduler (scheduler_components/dp_attn.py): rows the logits processor samples per DP rank,
    without input logprobs: one per request in extend, every token in decode, none when idle."""
    return 0 if mode == IDLE else (len(reqs) if mode == EXTEND else sum(r.extend for r in reqs))


def request_rows(pools, n: int) -> list[int]:
    """Rows of SGLang's request pool for one example's requests, kept from the priming step to the step
    under test (the KV cache of a request's prefix lives behind its row)."""
    return pools.take_rows(n)


def forward_batch(s, batch: Batch, dp_rank: int, rows: list[int], input_ids: torch.Tensor | None,
                  capture_full: bool = False):
    """The ForwardBatch of this rank's requests in `batch` (request i uses request row rows[i]), prepared by
    SGLang's eager path. `input_ids`: the extend tokens (None for units fed hidden states: zeros stand in)."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
        clamp_position,
        compute_position,
    )
    if not hasattr(_RunnerStub, "bound"):
        _bind_runner_methods()
    pools, dev = s.pools, s.env.device
    reqs = batch.per_dp[dp_rank]
    mode = batch.forward_modes()[dp_rank]
    n = sum(r.extend for r in reqs)
    locs = pools.allocator.alloc(n) if n else torch.zeros(0, dtype=torch.int64, device=dev)
    if locs is None:
        raise RuntimeError(f"sglang target: KV pool has no {n} free token slots")
    start = 0
    for r, row in zip(reqs, rows):
        pools.req_to_token.write((row, slice(r.prefix, r.total)), locs[start: start + r.extend].to(torch.int32))
        start += r.extend
    seq_lens = torch.tensor([r.total for r in reqs], dtype=torch.int64, device=dev)
    if input_ids is None:
        input_ids = torch.zeros(n, dtype=torch.int64)
    kw: dict = {}
    if mode == EXTEND:
        ext = torch.tensor([r.extend for r in reqs], dtype=torch.int32, device=dev)
        pre = torch.tensor([r.prefix for r in reqs], dtype=torch.int32, device=dev)
        positions, start_loc = compute_position(s.server_args.attention_backend, pre, ext, n)
        kw = dict(extend_seq_lens=ext, extend_prefix_lens=pre, extend_seq_lens_cpu=[r.extend for r in reqs],
                  extend_prefix_lens_cpu=[r.prefix for r in reqs], extend_num_tokens=n, extend_start_loc=start_loc,
                  extend_logprob_start_lens_cpu=[r.prefix for r in reqs])
    elif mode == DECODE:
        positions = clamp_position(seq_lens)
    else:
        positions = torch.zeros(0, dtype=torch.int64, device=dev)
    fb = ForwardBatch(
        forward_mode={EXTEND: ForwardMode.EXTEND, DECODE: ForwardMode.DECODE, IDLE: ForwardMode.IDLE}[mode],
        batch_size=len(reqs), input_ids=input_ids.to(dev),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
        seq_lens=seq_lens, out_cache_loc=locs.to(torch.int64), seq_lens_sum=int(seq_lens.sum()) if reqs else 0,
        seq_lens_cpu=seq_lens.cpu(), positions=positions.to(torch.int64),
        is_extend_in_batch=batch.is_extend_in_batch, lora_ids=[None] * len(reqs),   # init_new: req.lora_id each
        capture_hidden_mode=CaptureHiddenMode.FULL if capture_full else CaptureHiddenMode.NULL, **kw,
        **s.adapter.batch_fields(pools))
    s.adapter.init_num_token_non_padded(fb, dev, n)
    if s.adapter.model_is_mrope(s.model_config):
        # ForwardBatch.init_new's _compute_mrope_positions for text-only requests (no multimodal input): the
        # three M-RoPE rows are the 1-D positions (extend: prefix .. prefix + extend - 1; decode: seq_len - 1);
        # an idle batch's are empty (0.5.23's init_new: positions.unsqueeze(0).expand(3, -1))
        set_fields(fb, mrope_positions=fb.positions.unsqueeze(0).repeat(3, 1))
    if s.env.layout.dp > 1:
        # What the scheduler all-gathers (tokens per DP rank) is the batch metadata every rank already has.
        counts = batch.tokens_per_dp()
        sample = [logprob_rows(rq, m) for rq, m in zip(batch.per_dp, batch.forward_modes())]
        set_fields(fb, global_num_tokens_cpu=list(counts), global_num_tokens_for_logprob_cpu=list(sample),
                   global_num_tokens_gpu=torch.tensor(counts, dtype=torch.int64, device=dev),
                   global_num_tokens_for_logprob_gpu=torch.tensor(sample, dtype=torch.int64, device=dev))
    s.adapter.prepare_eager(_RunnerStub(s.server_args, s.model_config, pools.backend), fb)
    if fb.batch_size > 0:
        pools.backend.init_forward_metadata(fb)
    else:
        pools.backend.forward_metadata = None    # EagerRunner._execute_idle
    return fb


def running(s, fb):
    """The scope ModelRunner._forward_raw opens around a forward, as the installed release opens it."""
    return s.adapter.running(s, fb)


def gathered_start(s, fb) -> int:
    """Where this rank's rows start in the DP-gathered buffer the FFN sees: SGLang's padded per-DP-rank counts
    after preparation (MAX_LEN: equal slots), up to this rank's slot; 0 without DP attention."""
    counts = fb.global_num_tokens_cpu
    if counts is None:
        return 0
    return sum(counts[: s.adapter.dp_slot(counts)])
