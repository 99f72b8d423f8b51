"""The communicator era (sglang 0.5.16 - 0.5.20): `srt/layers/communicator.py`'s LayerCommunicator moves a
layer's rows between attention and the MLP, a decoder layer takes and returns (hidden, residual), and the
groups come from `distributed/bootstrap.init_torch_distributed(ps=ParallelState(...))` as ModelRunner calls
it (no `init_layer_runtime`, no SpawnRanks).

One class per release, each the one after it with what that release did otherwise (read from the releases'
own source, quoted in each method). Imported on the rank processes only (it imports sglang).
"""
from __future__ import annotations

import torch

from dpep_parity.checks.targets.sglang.eras import StandIn, set_fields
from dpep_parity.checks.targets.sglang.eras.layer_boundary import Release022


class Release020(Release022):
    """sglang 0.5.20: every unit."""

    units = ("moe", "attention", "decoder", "model")
    unreached: dict[str, str] = {}

    def setup(self, s, server_args_kw: dict, rank: int, device) -> None:
        """What Scheduler.__init__ (managers/scheduler.py:523, ParallelState) and ModelRunner
        .init_torch_distributed (model_runner.py:1144) do: publish the server arguments (run_scheduler_process,
        scheduler.py:5808), derive this rank's attention-DP / MoE-EP places (compute_dp_attention_world_info;
        entrypoints/engine.py:1904 _compute_parallelism_ranks) and let bootstrap build the groups over the
        suite's initialized torch.distributed (init_distributed_environment keeps it and wraps WORLD)."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.distributed.parallel_state_wrapper import ParallelState
        from sglang.srt.layers.dp_attention import compute_dp_attention_world_info
        from sglang.srt.server_args import ServerArgs
        server_args = ServerArgs(**server_args_kw)
        self._publish(server_args)
        model_config = ModelConfig.from_server_args(server_args)
        tp, dp, ep = server_args_kw["tp_size"], server_args_kw["dp_size"], server_args_kw["ep_size"]
        a_tp_rank, a_tp_size, a_dp_rank, a_dp_size = compute_dp_attention_world_info(dp > 1, rank, tp, dp, 1)
        gpu_id = torch.cuda.current_device() if device.type == "cuda" else 0
        ps = ParallelState.trivial(tp_rank=rank, tp_size=tp, dp_rank=None, dp_size=dp, attn_tp_rank=a_tp_rank,
                                   attn_tp_size=a_tp_size, attn_dp_rank=a_dp_rank, attn_dp_size=a_dp_size,
                                   moe_ep_rank=rank % tp // (tp // ep), moe_ep_size=ep, gpu_id=gpu_id)
        bootstrap.init_torch_distributed(server_args=server_args, model_config=model_config, device=device.type,
                                         ps=ps, dist_port=0, is_draft_worker=False, local_omp_cpuid=None)
        s.server_args, s.model_config = server_args, model_config

    @staticmethod
    def _publish(server_args) -> None:
        from sglang.srt.runtime_context import publish, reset_context
        reset_context()
        publish(server_args, role="scheduler")          # 0.5.17+: no ranks argument

    def init_num_token_non_padded(self, fb, device, n: int) -> None:
        """ForwardBatch.init_new (forward_batch_info.py:893-900) sets the global count, as here."""
        from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded
        if enable_num_token_non_padded():
            set_fields(fb, global_num_token_non_padded=torch.tensor(n, dtype=torch.int32, device=device))
        set_fields(fb, global_num_token_non_padded_cpu=n)

    def dp_slot(self, counts: list[int]) -> int:
        """prepare_mlp_sync_batch places this rank's rows at its attention-DP rank (no dp_slot_in)."""
        from sglang.srt.layers.dp_attention import get_attention_dp_rank
        return get_attention_dp_rank()

    def moe(self, s, fb, block, x: torch.Tensor, dp: int) -> torch.Tensor:
        """What the decoder layer does around its MLP (models/qwen3_moe.py:858-880): the communicator's gather
        of every DP rank's rows (dp_gather_replicate into the global DP buffer, communicator.py:1234), the
        block under the layer's reduce-scatter decision (get_forward().scoped(mlp_reduce_scatter=...): the
        block skips its own all-reduce when it is set), then the communicator's postprocess_layer
        (reduce_scatterv, dp_reduce_scatter_tensor on MAX_LEN, else dp_scatter)."""
        from sglang.srt.distributed import get_tp_group
        from sglang.srt.layers.dp_attention import dp_gather_replicate, get_global_dp_buffer
        from sglang.srt.runtime_context import get_forward
        if dp == 1:
            return block(x, fb)                             # the block all-reduces its own output
        lc = s.model.model.layers[s.env.layer].layer_communicator
        g = get_global_dp_buffer(get_tp_group())
        dp_gather_replicate(g, x.contiguous(), fb)
        with get_forward().scoped(mlp_reduce_scatter=lc.should_use_reduce_scatter(fb)):
            y = block(g, fb)
        out, _ = lc.postprocess_layer(y, None, fb)
        return out

    def attention_sum(self, y: torch.Tensor, fb) -> torch.Tensor:
        """o_proj does not reduce (reduce_results=False); the communicator all-reduces over attention TP
        (communicator.py:1263, attention_tensor_model_parallel_all_reduce)."""
        from sglang.srt.distributed.communication_op import attention_tensor_model_parallel_all_reduce
        return attention_tensor_model_parallel_all_reduce(y)

    def decoder(self, s, layer, fb, x: torch.Tensor) -> torch.Tensor | None:
        """`layer(positions, hidden, batch, residual=None)` returns (hidden, residual); its output is their sum,
        read through SGLang's final norm as Model.forward does (`norm(hidden, residual)` returns the updated
        residual, qwen2_moe.py Model.forward)."""
        h, r = layer(fb.positions, x, fb, None)
        if h.shape[0] == 0:
            return None
        _, out = s.model.model.norm(h, r)
        return out

    def capture_kwargs(self, layer_cls, sink) -> dict:
        """No capture keyword: the layer appends the residual its attention stage produced (the previous
        layer's output) to `captured_last_layer_outputs` (LayerCommunicator
        .prepare_attn_and_capture_last_layer_outputs), the Eagle3 capture point."""
        return {"captured_last_layer_outputs": _Sink(sink)}


class _Sink(list):
    def __init__(self, sink):
        super().__init__()
        self._sink = sink

    def append(self, v):
        self._sink(v)


class Release019(Release020):
    """sglang 0.5.19: what 0.5.20 changed, undone."""

    def init_num_token_non_padded(self, fb, device, n: int) -> None:
        """The count's fields are num_token_non_padded(_cpu) before 0.5.20 (init_new,
        forward_batch_info.py:857-863)."""
        from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded
        if self._enabled(enable_num_token_non_padded):
            set_fields(fb, num_token_non_padded=torch.tensor(n, dtype=torch.int32, device=device))
        set_fields(fb, num_token_non_padded_cpu=n)

    def _enabled(self, enable_num_token_non_padded) -> bool:
        return enable_num_token_non_padded()


class Release018(Release019):
    """sglang 0.5.18: what 0.5.19 changed, undone."""

    def _expert_location_args(self, s) -> dict:
        """compute_initial_expert_location_metadata takes the server arguments (eplb/expert_location.py:763)."""
        return {"server_args": s.server_args}

    def alloc_rows(self, pool, n: int) -> list[int] | None:
        """No ReqToTokenPool.alloc_rows before 0.5.19: its `alloc(reqs)` binds rows to requests (only their
        req_pool_idx is read for a request without one)."""
        return pool.alloc([_RowHolder() for _ in range(n)])

    def free_rows(self, pool, rows: list[int]) -> None:
        for row in rows:
            pool.free(_RowHolder(row))


class _RowHolder(StandIn):
    """A request as ReqToTokenPool.alloc / free read it before 0.5.19: the row it holds, or None; a fresh
    request, neither chunked nor a diffusion LM's (0.5.9's alloc asks)."""

    is_chunked = 0
    kv_committed_len = 0

    def __init__(self, row: int | None = None):
        self.req_pool_idx = row

    def is_dllm(self) -> bool:
        return False


class Release017(Release018):
    """sglang 0.5.17."""


class Release016(Release017):
    """sglang 0.5.16: what 0.5.17 changed, undone."""

    @staticmethod
    def _publish(server_args) -> None:
        """No runtime_context.publish yet: ModelRunner.__init__ publishes the arguments through
        set_global_server_args_for_scheduler (model_runner.py:311), i.e. get_context().set_server_args."""
        from sglang.srt.runtime_context import reset_context
        from sglang.srt.server_args import set_global_server_args_for_scheduler
        reset_context()
        set_global_server_args_for_scheduler(server_args)


ADAPTERS = {"0.5.20": Release020, "0.5.19": Release019, "0.5.18": Release018, "0.5.17": Release017,
            "0.5.16": Release016}
