"""The layer-boundary era (sglang 0.5.21 - 0.5.23): `srt/layers/layer_boundary/` replaced the communicator,
`runtime_context` publishes the server arguments, `distributed/bootstrap` builds the parallel runtime.

One class per release, each the one before with what that release changed (read from the releases' own
source, quoted in each method). Imported on the rank processes only (it imports sglang).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from dpep_parity.checks.targets.sglang.eras import Adapter, set_fields


class Release023(Adapter):
    """sglang 0.5.23: every unit."""

    units = ("moe", "attention", "decoder", "model")

    # ------------------------------------------------------------ parallel state and model
    def setup(self, s, server_args_kw: dict, rank: int, device) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
        from sglang.srt.server_args import ServerArgs
        server_args = ServerArgs(**server_args_kw)
        reset_context()
        gpu_id = torch.cuda.current_device() if device.type == "cuda" else 0
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=gpu_id, dp_rank=None))
        # torch.distributed is initialized already: init_distributed_environment keeps it and wraps WORLD;
        # initialize_model_parallel and initialize_dp_attention build SGLang's groups over it.
        bootstrap.init_parallel_runtime(server_args=server_args, device=device.type, dist_port=0)
        model_config = ModelConfig.from_server_args(server_args)
        bootstrap.init_layer_runtime(model_config=model_config)
        s.server_args, s.model_config = server_args, model_config

    def teardown(self) -> None:
        from sglang.srt.distributed import parallel_state
        from sglang.srt.runtime_context import reset_context
        parallel_state.destroy_model_parallel()     # SGLang's own teardown of TP / attn-TP / MoE groups
        reset_context()                             # published config, flags, parallel overrides

    # ------------------------------------------------------------ batch
    def init_num_token_non_padded(self, fb, device, n: int) -> None:
        fb._init_num_token_non_padded(device=device, is_draft_worker=False)

    @contextmanager
    def running(self, s, fb):
        """The scope ModelRunner._forward_raw opens around a forward (model_runner.py:1801): the model's
        shared-experts configuration and the forward context (attention backend, the batch's MoE bound)."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        from sglang.srt.runtime_context import get_model
        with get_model().override(shared_experts=s.model.shared_experts_config), \
                forward_context(ForwardContext(attn_backend=s.pools.backend), forward_batch=fb):
            yield

    def dp_slot(self, counts: list[int]) -> int:
        """This rank's slot in the DP-gathered buffer (dp_attention.dp_slot_in)."""
        from sglang.srt.layers.dp_attention import dp_slot_in
        return dp_slot_in(counts)

    def capture_kwargs(self, layer_cls, sink) -> dict:
        """The keyword that makes layer i hand `sink` the residual its attention boundary produced (layer i-1's
        output, on this rank's rows): Qwen3's layer names it capture_output and hands it to its boundary as
        `capture`; Qwen2's layer passes its keywords to the boundary as they are. A layer with neither (DeepSeek's:
        its capture point is the Eagle3 accumulator of gathered rows) gives no per-layer outputs."""
        import inspect
        params = inspect.signature(layer_cls.forward).parameters
        if "capture_output" in params:
            return {"capture_output": lambda v, **_: sink(v)}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return {"capture": lambda v, **_: sink(v)}
        return {}

    # ------------------------------------------------------------ units
    def moe(self, s, fb, block, x: torch.Tensor, dp: int) -> torch.Tensor:
        """The FFN boundary path: the DP gather of every DP rank's rows (dp_gather_replicate into the global
        DP buffer), the block on the gathered buffer, then the exit SGLang's ExitPolicy selects
        (dp_reduce_scatter(v) completing the sum, or the MoE output's sum followed by dp_scatter); without
        DP attention the MoE output's sum alone."""
        from sglang.srt.layers.layer_boundary import exit as sgl_exit
        from sglang.srt.layers.layer_boundary import ops as sgl_ops
        from sglang.srt.layers.layer_boundary.layout import SumGroup, is_dense_ffn_fully_dp
        from sglang.srt.layers.moe.utils import should_use_dp_reduce_scatterv
        from sglang.srt.runtime_context import get_exec
        if is_dense_ffn_fully_dp() and not getattr(s.model.model.layers[s.env.layer], "is_layer_sparse", True):
            return block(x, fb)     # --moe-dense-tp-size 1: a dense MLP replicated on each rank's own rows
        if dp == 1:
            return sgl_ops.sum_output(block(x, fb), SumGroup.MOE_OUTPUT, fb, may_quantize=False)
        y = block(sgl_ops.dp_gather(x.contiguous(), fb), fb)
        strategy = get_exec().comm.boundary_reduction
        dp_step = sgl_exit._select_dp_reduce_scatter(
            fb, may_reduce_scatter=strategy in ("rs", "rs+rsv"),
            reduce_scatterv=strategy in ("rsv", "rs+rsv") and should_use_dp_reduce_scatterv())
        if dp_step is None:
            y = sgl_ops.sum_output(y, SumGroup.MOE_OUTPUT, fb, may_quantize=False)
            return sgl_ops.to_dp_local(sgl_ops._dp_scatter_step, fb, y)
        return sgl_ops.to_dp_local(dp_step, fb, y)

    def attention_sum(self, y: torch.Tensor, fb) -> torch.Tensor:
        """The attention output's sum over the group it declares (`o_proj` does not reduce)."""
        from sglang.srt.layers.layer_boundary.layout import SumGroup
        from sglang.srt.layers.layer_boundary.ops import sum_output
        return sum_output(y, SumGroup.ATTN_TP, fb, may_quantize=False)

    def decoder(self, s, layer, fb, x: torch.Tensor) -> torch.Tensor | None:
        """Layer i's forward on a fresh residual stream, its output read through SGLang's terminal path
        (`final_norm` with capture), which completes a sum the layer left owed; None when no row came back."""
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        got: list[torch.Tensor] = []
        residual_batch.start(fb)
        y = self.layer_forward(layer, fb, x)
        residual_batch.final_norm(y, fb, s.model.model.norm, capture=lambda v, **_: got.append(v.clone()),
                                  skip_empty=True)
        return got[0] if got else None


class Release022(Release023):
    """sglang 0.5.22: what 0.5.23 changed, undone."""

    def init_num_token_non_padded(self, fb, device, n: int) -> None:
        """0.5.22 has no `_init_num_token_non_padded`: ForwardBatch.init_new sets the two fields inline
        (forward_batch_info.py:1135-1142), as here."""
        from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded
        if enable_num_token_non_padded():
            set_fields(fb, global_num_token_non_padded=torch.tensor(n, dtype=torch.int32, device=device))
        set_fields(fb, global_num_token_non_padded_cpu=n)

    @contextmanager
    def running(self, s, fb):
        """0.5.22's _forward_raw (model_runner.py:1939-1943) opens the forward context alone: no
        shared-experts override, and `forward_context` takes no batch (the MoE bound is read from the batch
        by the model, `forward_batch.moe_num_token_non_padded()`)."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        with forward_context(ForwardContext(attn_backend=s.pools.backend)):
            yield


class Release021(Release022):
    """sglang 0.5.21: the first layer-boundary release. Its boundary ops have other names and shapes (no
    `ops.dp_gather` / `ops.sum_output` / `exit._select_dp_reduce_scatter`): the FFN exit is chosen inside the
    layer's output boundary (`exit.OutputBoundary._select_ffn_completion`), and the block reads the decision
    from the forward flags."""

    def moe(self, s, fb, block, x: torch.Tensor, dp: int) -> torch.Tensor:
        """What FfnExit does around the MLP (layer_boundary/exit.py:469-545, :177-243): the DP gather into
        the global buffer (ops._redistribute_input_to_dp, move_rows' gather), the block under the flags the
        output boundary selects (mlp_reduce_scatter when a reduce-scatter completes the sum: the block then
        leaves out its post-experts all-reduce, moe/utils.py:760-783), then the output boundary's DP step back
        to this rank's rows (_postprocess_dp_step: dp_reduce_scatter(v), or dp_scatter of the summed output;
        _complete_ffn_output_now). Without DP attention the block sums its own output (no flag set)."""
        from sglang.srt.layers.layer_boundary import ops
        from sglang.srt.runtime_context import get_forward
        if dp == 1:
            return block(x, fb)
        plan = s.model.model.layers[s.env.layer].ffn_boundary.plan
        steps = plan._batch_steps(fb)
        dp_step = plan.output._postprocess_dp_step(fb, steps)
        g = ops._redistribute_input_to_dp(x.contiguous(), fb)
        with get_forward().scoped(fuse_mlp_allreduce=False, defer_moe_finalize=False,
                                  mlp_reduce_scatter=plan.output._ffn_leaves_sum_to_reduce_scatter(steps, dp_step)):
            y = block(g, fb)
        return ops._to_local_tokens(dp_step or ops._redistribute_output, fb, y)

    def attention_sum(self, y: torch.Tensor, fb) -> torch.Tensor:
        """The attention output's sum over attention TP as the FFN input reads it (ops._mlp_input_reduce_output,
        layer_boundary/ops.py:153: attention_tensor_model_parallel_all_reduce; `o_proj` does not reduce)."""
        from sglang.srt.layers.layer_boundary import ops
        return ops._mlp_input_reduce_output(y, fb, may_quantize=False)

    def decoder(self, s, layer, fb, x: torch.Tensor) -> torch.Tensor | None:
        """0.5.21 names the terminal path `residual.batch.norm(..., capture_output=)`
        (layer_boundary/residual/batch.py:52)."""
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        got: list[torch.Tensor] = []
        residual_batch.start(fb)
        y = self.layer_forward(layer, fb, x)
        residual_batch.norm(y, fb, s.model.model.norm, capture_output=lambda v, **_: got.append(v.clone()),
                            skip_empty=True)
        return got[0] if got else None

    def capture_kwargs(self, layer_cls, sink) -> dict:
        """0.5.21's attention boundary takes `capture_output` for both Qwen layers (layer_boundary/stage.py:137,
        Qwen2 forwards its keywords as they are)."""
        return {"capture_output": lambda v, **_: sink(v)}


ADAPTERS = {"0.5.23": Release023, "0.5.22": Release022, "0.5.21": Release021}
