"""Rank side of the `sglang` target: SGLang's parallel state, modules, weight loaders and batch metadata,
built inside the suite's already-initialized torch.distributed world. Imported only on the ranks.

Per process there is one live SGLang parallel state (SGLang keeps it in module globals). The suite reuses rank
processes across layouts and caches `build` results per layout, so `build` returns a cheap handle and `run`
(re)establishes SGLang's state for the handle's layout when another layout ran in between: SGLang's own
teardown (destroy_model_parallel, reset_context), then publish + init_parallel_runtime + init_layer_runtime,
then the model built and loaded again. Every rank runs the same job sequence, so the group creations
(collective in torch) line up.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from checks.targets.protocol import BuildEnv, Step
from checks.targets.sglang import cpu_shims

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class Handle:
    unit: str
    env: BuildEnv


class _Session:
    """SGLang's state for one (layout, model config, dtype, device) in this process."""

    def __init__(self, key, env: BuildEnv):
        self.key, self.env = key, env
        self.model = None
        self.seconds: dict[str, float] = {}


_SESSION: _Session | None = None
STATS: dict[str, list[float]] = {"import": [], "setup": [], "teardown": [], "load": []}


def build(unit: str, env: BuildEnv) -> Handle:
    return Handle(unit, env)


def _key(env: BuildEnv):
    cfg = hashlib.sha1(json.dumps(env.config, sort_keys=True).encode()).hexdigest()[:16]
    return (env.layout, cfg, env.dtype, str(env.device), env.layout.tp)


def _config_dir(config: dict) -> str:
    """A model directory holding only config.json, for SGLang's ModelConfig (weights come from env)."""
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    d = os.path.join(tempfile.gettempdir(), f"dpep-sglang-config-{os.getpid()}-{digest}")
    if not os.path.exists(os.path.join(d, "config.json")):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
    return d


def session_for(env: BuildEnv) -> _Session:
    global _SESSION
    key = _key(env)
    if _SESSION is not None and _SESSION.key == key:
        return _SESSION
    if _SESSION is not None:
        t0 = time.perf_counter()
        _teardown()
        STATS["teardown"].append(time.perf_counter() - t0)
        _SESSION = None
    s = _Session(key, env)
    _setup(s)
    _SESSION = s
    return s


def _teardown():
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import reset_context
    parallel_state.destroy_model_parallel()     # SGLang's own teardown of TP / attn-TP / MoE groups
    reset_context()                             # published config, flags, parallel overrides


def _setup(s: _Session):
    env = s.env
    lay, dev = env.layout, env.device
    cpu_shims.set_cpu_thread_binding(lay.tp)
    t0 = time.perf_counter()
    cpu_shims.install_torchvision_standin()   # no-op when the target module installed it already
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    cpu_shims.install(dev.type)
    STATS["import"].append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    server_args = ServerArgs(
        model_path=_config_dir(env.config), device=dev.type, dtype=_DTYPE_NAMES[env.dtype],
        tp_size=lay.tp, dp_size=lay.dp, enable_dp_attention=lay.dp > 1, ep_size=lay.ep,
        enable_dp_lm_head=lay.dp_lm_head, disable_cuda_graph=True, skip_tokenizer_init=True,
        disable_custom_all_reduce=dev.type == "cpu",
        load_format="dummy")
    reset_context()
    gpu_id = torch.cuda.current_device() if dev.type == "cuda" else 0
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=env.rank, gpu_id=gpu_id, dp_rank=None))
    # torch.distributed is initialized already: init_distributed_environment keeps it and wraps WORLD;
    # initialize_model_parallel and initialize_dp_attention build SGLang's groups over it.
    bootstrap.init_parallel_runtime(server_args=server_args, device=dev.type, dist_port=0)
    model_config = ModelConfig.from_server_args(server_args)
    bootstrap.init_layer_runtime(model_config=model_config)
    s.server_args, s.model_config = server_args, model_config
    STATS["setup"].append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    s.model = _build_mlps(env, model_config.hf_config)
    STATS["load"].append(time.perf_counter() - t0)


class _Layer(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


def _build_mlps(env: BuildEnv, hf_config) -> torch.nn.Module:
    """Every layer's MLP as SGLang's decoder layer builds it (the layer class's own stage_facts decide sparse
    or dense: Qwen{2,3}MoeDecoderLayer.stage_facts), under a `model.layers.{i}.mlp` tree, loaded by the
    model class's own load_weights (stacked gate_up mapping, FusedMoE expert mapping, each param's
    weight_loader sharding for this rank) and SGLang's post-load processing.

    Only the MLPs: constructing the attention needs a rotary kernel (vllm._custom_ops.rotary_embedding on a
    platform SGLang does not recognise as CPU), and the attention is not covered (see NOT_COVERED)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.utils import add_prefix
    arch = env.config["architectures"][0]
    if arch == "Qwen2MoeForCausalLM":
        from sglang.srt.models import qwen2_moe as mod
        causal, layer_cls, sparse_cls, dense_cls = (mod.Qwen2MoeForCausalLM, mod.Qwen2MoeDecoderLayer,
                                                     mod.Qwen2MoeSparseMoeBlock, mod.Qwen2MoeMLP)
    elif arch == "Qwen3MoeForCausalLM":
        from sglang.srt.models import qwen3_moe as mod
        causal, layer_cls, sparse_cls, dense_cls = (mod.Qwen3MoeForCausalLM, mod.Qwen3MoeDecoderLayer,
                                                     mod.Qwen3MoeSparseMoeBlock, mod.Qwen3MoeMLP)
    else:
        raise RuntimeError(f"sglang target: no model class for architecture {arch}")
    dev = env.device
    n = hf_config.num_hidden_layers
    layers = []
    with set_default_torch_dtype(env.dtype), torch.device(dev):
        for i in range(n):
            prefix = add_prefix("mlp", add_prefix(str(i), "model.layers"))
            _, ffn = layer_cls.stage_facts(hf_config, i)
            if ffn.sparse:
                kw = {"reduce_results": False} if arch == "Qwen2MoeForCausalLM" else {}
                mlp = sparse_cls(layer_id=i, config=hf_config, quant_config=None, prefix=prefix, **kw)
            else:
                mlp = dense_cls(hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
                                hidden_act=hf_config.hidden_act, quant_config=None, prefix=prefix,
                                reduce_results=False)
            layers.append(_Layer(mlp))
    holder = torch.nn.Module()
    holder.config = hf_config
    holder.quant_config = None
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList(layers)
    holder.model.start_layer, holder.model.end_layer = 0, n
    holder.load_weights = causal.load_weights.__get__(holder)
    mlp_weights = ((k, v) for k, v in env.weights.items() if ".mlp." in k)
    DefaultModelLoader.load_weights_and_postprocess(holder, mlp_weights, torch.device(dev))
    holder.eval()
    return holder


# ---------------------------------------------------------------- batch metadata
class _RunnerStub:
    """What ModelRunner._prepare_eager_forward_batch / ForwardBatch.prepare_mlp_sync_batch read of the
    model runner, outside the attention backend: the methods are SGLang's own (bound below)."""

    is_draft_worker = False
    enable_elastic_ep = False
    lora_manager = None
    hisparse_coordinator = None

    class attn_backend:   # noqa: N801 - attribute-shaped, as ModelRunner.attn_backend
        @staticmethod
        def get_cuda_graph_seq_len_fill_value():
            return 1

        @staticmethod
        def get_cpu_graph_seq_len_fill_value():
            return 1

        @staticmethod
        def late_layer_num_tokens(forward_batch):
            return None

    def __init__(self, model_config):
        self.model_config = model_config


def _bind_runner_methods():
    from sglang.srt.model_executor.model_runner import ModelRunner
    _RunnerStub.attn_tp_sequence_sharded = ModelRunner.attn_tp_sequence_sharded
    _RunnerStub.prepare_eager = ModelRunner._prepare_eager_forward_batch


def forward_batch(s: _Session, step: Step, rows: int):
    """SGLang's ForwardBatch for this rank's part of the step, prepared by SGLang's eager path (DP padding
    mode, attention-TP alignment, MAX_LEN padding, gathered-buffer sizes, num_token_non_padded)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    if not hasattr(_RunnerStub, "prepare_eager"):
        _bind_runner_methods()
    dev = s.env.device
    mode = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE, "idle": ForwardMode.IDLE}[
        step.batch.forward_modes()[step.dp_rank]]
    reqs = step.requests
    bs = len(reqs)
    seq_lens = torch.tensor([r.total for r in reqs], dtype=torch.int64, device=dev)
    positions = torch.cat([torch.arange(r.prefix, r.total) for r in reqs]) if reqs else torch.zeros(0, dtype=torch.int64)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=bs,
        input_ids=torch.zeros(rows, dtype=torch.int64, device=dev),
        req_pool_indices=torch.arange(bs, dtype=torch.int64, device=dev),
        seq_lens=seq_lens, out_cache_loc=torch.zeros(rows, dtype=torch.int64, device=dev),
        seq_lens_sum=int(seq_lens.sum()) if bs else 0,
        seq_lens_cpu=seq_lens.cpu(), positions=positions.to(dev),
        extend_seq_lens=torch.tensor([r.extend for r in reqs], dtype=torch.int32, device=dev),
        extend_prefix_lens=torch.tensor([r.prefix for r in reqs], dtype=torch.int32, device=dev),
        extend_seq_lens_cpu=[r.extend for r in reqs], extend_prefix_lens_cpu=[r.prefix for r in reqs],
        extend_num_tokens=rows,
        is_extend_in_batch=step.batch.is_extend_in_batch,
    )
    fb._init_num_token_non_padded(device=dev, is_draft_worker=False)
    if s.env.layout.dp > 1:
        # What the scheduler all-gathers (tokens per DP rank) is the batch metadata every rank already has.
        counts = step.batch.tokens_per_dp()
        fb.global_num_tokens_cpu = list(counts)
        fb.global_num_tokens_for_logprob_cpu = list(counts)
        fb.global_num_tokens_gpu = torch.tensor(counts, dtype=torch.int64, device=dev)
        fb.global_num_tokens_for_logprob_gpu = torch.tensor(counts, dtype=torch.int64, device=dev)
    _RunnerStub(s.model_config).prepare_eager(fb)
    return fb


# ---------------------------------------------------------------- units
def run(h: Handle, step: Step) -> dict:
    s = session_for(h.env)
    with torch.no_grad():
        if h.unit == "moe":
            return _run_moe(s, h.env, step)
    raise RuntimeError(f"sglang target: unit {h.unit} is not covered")


def _run_moe(s: _Session, env: BuildEnv, step: Step) -> dict:
    """The MLP of layer env.layer as a unit, through SGLang's FFN boundary path: the DP gather of every DP
    rank's rows (dp_gather_replicate into the global DP buffer), the block on the gathered buffer, then the
    exit SGLang's ExitPolicy selects (dp_reduce_scatter(v) completing the sum, or the MoE output's sum over
    its group followed by dp_scatter); without DP attention the MoE output's sum alone."""
    from sglang.srt.layers.layer_boundary import exit as sgl_exit
    from sglang.srt.layers.layer_boundary import ops as sgl_ops
    from sglang.srt.layers.layer_boundary.layout import SumGroup
    from sglang.srt.layers.moe.utils import should_use_dp_reduce_scatterv
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.runtime_context import get_exec

    lay = env.layout
    x = step.inputs[0].to(env.dtype).to(env.device)
    n = x.shape[0]
    block = s.model.model.layers[env.layer].mlp
    fb = forward_batch(s, step, n)
    padded = fb.input_ids.shape[0]                 # this rank's rows after SGLang's padding
    if padded > n:
        x = torch.cat([x, x.new_zeros(padded - n, x.shape[1])])
    counts = _ExpertCounter(block, env)
    ctx = ForwardContext(attn_backend=None)
    with forward_context(ctx, forward_batch=fb), counts:
        if lay.dp > 1:
            g = sgl_ops.dp_gather(x.contiguous(), fb)
            y = block(g, fb)
            strategy = get_exec().comm.boundary_reduction
            dp_step = sgl_exit._select_dp_reduce_scatter(
                fb, may_reduce_scatter=strategy in ("rs", "rs+rsv"),
                reduce_scatterv=strategy in ("rsv", "rs+rsv") and should_use_dp_reduce_scatterv())
            if dp_step is None:
                y = sgl_ops.sum_output(y, SumGroup.MOE_OUTPUT, fb, may_quantize=False)
                out = sgl_ops.to_dp_local(sgl_ops._dp_scatter_step, fb, y)
            else:
                out = sgl_ops.to_dp_local(dp_step, fb, y)
        else:
            y = block(x, fb)
            out = sgl_ops.sum_output(y, SumGroup.MOE_OUTPUT, fb, may_quantize=False)
    mode = fb.dp_padding_mode
    return {"out": out[:n].clone().cpu(),
            "expert_counts": counts.counts,
            "padding_mode": None if lay.dp == 1 or mode is None else ("max_len" if mode.is_max_len() else "sum_len")}


class _ExpertCounter:
    """Rows this rank's experts compute, per global expert id: read from what SGLang's token dispatcher hands
    the expert runner (StandardDispatcher.dispatch output; local ids under EP, -1 for dropped slots), by
    wrapping the dispatcher instance's `dispatch` for the duration of one forward. Instrumentation only."""

    def __init__(self, block, env):
        self.counts: dict[int, int] = {}
        experts = getattr(block, "experts", None)
        self.dispatcher = getattr(experts, "dispatcher", None)

    def __enter__(self):
        d = self.dispatcher
        if d is None or not hasattr(d, "dispatch"):
            return self
        original = d.dispatch

        def dispatch(*args, **kwargs):
            out = original(*args, **kwargs)
            ids = getattr(getattr(out, "topk_output", None), "topk_ids", None)
            if isinstance(ids, torch.Tensor):
                local = getattr(d, "local_expert_mapping", None) is not None
                base = d.moe_ep_rank * d.num_local_routed_experts if local else 0
                for e in ids[ids >= 0].flatten().tolist():
                    self.counts[base + e] = self.counts.get(base + e, 0) + 1
            return out
        d.dispatch = dispatch
        return self

    def __exit__(self, *exc):
        if self.dispatcher is not None and "dispatch" in vars(self.dispatcher):
            del self.dispatcher.dispatch
