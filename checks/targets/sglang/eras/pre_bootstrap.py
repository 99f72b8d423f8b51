"""The pre-bootstrap era (sglang 0.5.8 - 0.5.15): the communicator of the era after it
(`srt/layers/communicator.py`, decoder layers taking and returning (hidden, residual)), but no
`distributed/bootstrap.py`: ModelRunner.init_torch_distributed builds the groups itself, and the decoder layer
hands the MoE block its reduce-scatter decision as an argument (`self.mlp(hidden, forward_batch, ...,
use_reduce_scatter)`) where later releases scope it in the runtime context.

One class per release, each the one after it with what that release did otherwise (read from the releases'
own source, quoted in each method). Imported on the rank processes only (it imports sglang).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed

from dpep_parity.checks.core.batches import SUM_LEN
from dpep_parity.checks.targets.sglang.eras import _parameters
from dpep_parity.checks.targets.sglang.eras.communicator import Release016


class Release015(Release016):
    """sglang 0.5.15: every unit."""

    def setup(self, s, server_args_kw: dict, rank: int, device) -> None:
        """What ModelRunner.__init__ and .init_torch_distributed do (model_runner.py:535 publishes the server
        arguments; :1231-1330): init_distributed_environment over the suite's initialized torch.distributed
        (it keeps an initialized default group and wraps WORLD), initialize_model_parallel with the runner's
        sizes (:380-393: dp only under DP attention), initialize_dp_attention."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
            set_custom_all_reduce,
        )
        from sglang.srt.layers.dp_attention import initialize_dp_attention
        from sglang.srt.server_args import ServerArgs
        server_args = ServerArgs(**server_args_kw)
        self._publish(server_args)
        model_config = ModelConfig.from_server_args(server_args)
        tp = server_args.tp_size
        set_custom_all_reduce(not server_args.disable_custom_all_reduce)
        gpu_id = torch.cuda.current_device() if device.type == "cuda" else 0
        init_distributed_environment(backend=torch.distributed.get_backend(), world_size=tp, rank=rank,
                                     local_rank=gpu_id, distributed_init_method="env://",
                                     timeout=server_args.dist_timeout, **self._dist_env_extra(server_args))
        initialize_model_parallel(**self._parallel_sizes(server_args))
        initialize_dp_attention(server_args=server_args, model_config=model_config)
        s.server_args, s.model_config = server_args, model_config

    def _publish_expert_location(self, el, metadata) -> None:
        """set_global_expert_location_metadata has no overwrite and asserts an empty slot
        (eplb/expert_location.py:315): a new layout's ModelRunner, in a process of its own, finds it empty."""
        el._global_expert_location_metadata = None
        el.set_global_expert_location_metadata(metadata)

    def model_is_mrope(self, model_config) -> bool:
        """ModelRunner decides it (0.5.11 - 0.5.15: in __init__, model_runner.py:419-423; 0.5.9 / 0.5.10: the
        model_is_mrope property): "mrope_section" in the text config's rope parameters or scaling."""
        hf = model_config.hf_text_config
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", {})
        return rope is not None and "mrope_section" in rope

    @staticmethod
    def _dist_env_extra(server_args) -> dict:
        """init_distributed_environment's arguments beyond the world's (model_runner.py:1300)."""
        return {"moe_a2a_backend": server_args.moe_a2a_backend}

    @staticmethod
    def _global_dp_buffer():
        """The DP-gathered buffer the communicator gathers into (communicator.py:986)."""
        from sglang.srt.distributed import get_tp_group
        from sglang.srt.layers.dp_attention import get_global_dp_buffer
        return get_global_dp_buffer(get_tp_group())

    @staticmethod
    def _parallel_sizes(server_args) -> dict:
        """initialize_model_parallel's arguments as ModelRunner.init_torch_distributed passes them."""
        return {**_sizes(server_args), "decode_context_parallel_size": server_args.dcp_size}

    def moe(self, s, fb, block, x: torch.Tensor, dp: int) -> torch.Tensor:
        """The decoder layer around its MLP (models/qwen3_moe.py:800-830): the communicator's gather, the
        block told the layer's reduce-scatter decision as an argument (`self.mlp(hidden_states,
        forward_batch, should_allreduce_fusion, use_reduce_scatter)`; Qwen2: `self.mlp(hidden_states,
        forward_batch, use_reduce_scatter)`), then the communicator's postprocess_layer."""
        from sglang.srt.layers.dp_attention import dp_gather_replicate
        if dp == 1:
            return block(x, fb)
        lc = s.model.model.layers[s.env.layer].layer_communicator
        g = self._global_dp_buffer()
        dp_gather_replicate(g, x.contiguous(), fb)
        # GPT-OSS's block takes no reduce-scatter decision (its layer passes should_allreduce_fusion only)
        rs = {"use_reduce_scatter": lc.should_use_reduce_scatter(fb)} \
            if "use_reduce_scatter" in _parameters(type(block).forward) else {}
        y = block(g, fb, **rs)
        out, _ = lc.postprocess_layer(y, None, fb)
        return out


def _sizes(server_args) -> dict:
    """initialize_model_parallel's arguments in every pre-bootstrap release (ModelRunner's sizes: dp only under
    DP attention)."""
    return dict(tensor_model_parallel_size=server_args.tp_size,
                attention_data_parallel_size=server_args.dp_size if server_args.enable_dp_attention else 1,
                pipeline_model_parallel_size=1, expert_model_parallel_size=server_args.ep_size,
                attention_context_model_parallel_size=server_args.attn_cp_size,
                moe_data_model_parallel_size=server_args.moe_dp_size)


class Release014(Release015):
    """sglang 0.5.14: what 0.5.15 changed, undone."""

    @staticmethod
    def _publish(server_args) -> None:
        """The server arguments live in server_args._global_server_args (set_global_server_args_for_scheduler,
        server_args.py:7183, as ModelRunner.__init__ calls it); runtime_context holds only the parallel view
        and has no reset_context."""
        from sglang.srt.server_args import set_global_server_args_for_scheduler
        set_global_server_args_for_scheduler(server_args)

    def teardown(self) -> None:
        from sglang.srt.distributed import parallel_state
        parallel_state.destroy_model_parallel()

    @staticmethod
    def _parallel_sizes(server_args) -> dict:
        """No decode context parallelism before 0.5.15 (model_runner.py init_torch_distributed)."""
        return _sizes(server_args)


class Release013(Release014):
    """sglang 0.5.13: what 0.5.14 changed, undone."""

    def prepare_eager(self, runner, fb) -> None:
        """No ModelRunner._prepare_eager_forward_batch: _forward_raw prepares inline (model_runner.py:3544-3565;
        0.5.10 - 0.5.12 the same steps): the MLP-sync padding, then num_token_non_padded made local to the
        attention-TP rank (prefill context parallelism is off)."""
        from sglang.srt.model_executor import model_runner as mr
        if fb.global_num_tokens_cpu is not None:
            fb.prepare_mlp_sync_batch(runner)
        else:
            fb.prepare_attn_tp_scatter_input(runner)
        if (fb.num_token_non_padded is not None and fb.global_num_tokens_gpu is not None
                and mr.require_gathered_buffer(runner.server_args)):
            fb.adjust_num_token_non_padded_for_attn_tp(server_args=runner.server_args)


class Release012(Release013):
    """sglang 0.5.12: what 0.5.13 changed, undone."""

    def running(self, s, fb):
        """No forward context yet (the batch carries the backend and pools: batch_fields)."""
        return nullcontext()

    def batch_fields(self, pools) -> dict:
        """The attention layers read the backend and the KV pools from the batch (radix_attention.py:138
        `forward_batch.attn_backend.forward`; torch_native_backend.py:212 `forward_batch.token_to_kv_pool`),
        which ForwardBatch.init_new takes from the model runner (forward_batch_info.py:476-480)."""
        return dict(attn_backend=pools.backend, req_to_token_pool=pools.req_to_token, token_to_kv_pool=pools.kv)

    def token_allocator_class(self):
        """mem_cache/allocator.py is a module, not yet a package (allocator.py:116)."""
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        return TokenToKVPoolAllocator



class Release011(Release012):
    """sglang 0.5.11: what 0.5.12 changed, undone."""

    @staticmethod
    def _global_dp_buffer():
        """get_global_dp_buffer takes no group (dp_attention.py:129)."""
        from sglang.srt.layers.dp_attention import get_global_dp_buffer
        return get_global_dp_buffer()

    def _enabled(self, enable_num_token_non_padded) -> bool:
        """enable_num_token_non_padded takes the server arguments (forward_batch_info.py:1069)."""
        from sglang.srt.server_args import get_global_server_args
        return enable_num_token_non_padded(get_global_server_args())


class Release010(Release011):
    """sglang 0.5.10: what 0.5.11 changed, undone."""


class Release009(Release010):
    """sglang 0.5.9: what 0.5.10 changed, undone."""

    # layers/dp_attention.py:64-76: `if sum_len * 2 > max_len * get_attention_dp_size(): MAX_LEN else SUM_LEN`
    # (0.5.10 made it `>=`): equal costs choose SUM_LEN
    padding_ties = SUM_LEN

    def teardown(self) -> None:
        """destroy_model_parallel leaves the attention-TP group (parallel_state._ATTN_TP) standing
        (parallel_state.py:2070-2112; 0.5.10 destroys it): a server never rebuilds its groups, the suite's rank
        does at every layout, so the group is destroyed here as 0.5.10 does."""
        from sglang.srt.distributed import parallel_state
        parallel_state.destroy_model_parallel()
        if parallel_state._ATTN_TP:
            parallel_state._ATTN_TP.destroy()
        parallel_state._ATTN_TP = None

    @staticmethod
    def _dist_env_extra(server_args) -> dict:
        """init_distributed_environment takes no all-to-all backend yet."""
        return {}

    def attention_sum(self, y: torch.Tensor, fb) -> torch.Tensor:
        """No attention_tensor_model_parallel_all_reduce yet: the all-reduce of the attention-TP group's
        coordinator, the op 0.5.10's function wraps (dp_attention.get_attention_tp_group)."""
        from sglang.srt.layers.dp_attention import get_attention_tp_group
        return get_attention_tp_group().all_reduce(y)


class Release008(Release009):
    """sglang 0.5.8 and 0.5.8.post1: what 0.5.9 changed, undone."""

    @staticmethod
    def _parallel_sizes(server_args) -> dict:
        """No attention data / context or MoE data parallel sizes in the groups yet (model_runner.py:766-771:
        initialize_dp_attention derives the attention groups)."""
        return dict(tensor_model_parallel_size=server_args.tp_size, pipeline_model_parallel_size=1,
                    expert_model_parallel_size=server_args.ep_size)

    def teardown(self) -> None:
        """The attention-TP group lives in dp_attention (_ATTN_TP_GROUP, created by initialize_dp_attention,
        dp_attention.py:296), which destroy_model_parallel does not know."""
        from sglang.srt.distributed import parallel_state
        from sglang.srt.layers import dp_attention
        parallel_state.destroy_model_parallel()
        if dp_attention._ATTN_TP_GROUP:
            dp_attention._ATTN_TP_GROUP.destroy()
        dp_attention._ATTN_TP_GROUP = None

    def model_is_mrope(self, model_config) -> bool:
        """ModelRunner.model_is_mrope (model_runner.py:2433) reads the text config's rope_scaling only."""
        rope = getattr(model_config.hf_text_config, "rope_scaling", {})
        return rope is not None and "mrope_section" in rope

    def initialize_model(self, initialize, model_config, load_config):
        """_initialize_model(model_config, load_config) (model_loader/loader.py:229)."""
        return initialize(model_config, load_config)

    def alloc_rows(self, pool, n: int) -> list[int] | None:
        """ReqToTokenPool.alloc takes a count and free takes the rows (memory_pool.py:148-162)."""
        return pool.alloc(n)

    def free_rows(self, pool, rows: list[int]) -> None:
        pool.free(rows)


ADAPTERS = {"0.5.8": Release008, "0.5.8.post1": Release008, "0.5.9": Release009, "0.5.15": Release015, "0.5.15.post1": Release015, "0.5.14": Release014, "0.5.13": Release013,
            "0.5.13.post1": Release013, "0.5.12": Release012, "0.5.12.post1": Release012, "0.5.11": Release011,
            "0.5.10": Release010, "0.5.10.post1": Release010}
