"""SGLang's state on one rank for one layout: parallel runtime, the whole model, the KV pools and the attention
backend. Imported only on the ranks (it imports sglang).

Per process there is one live SGLang parallel state (SGLang keeps it in module globals). The suite reuses rank
processes across layouts and caches `build` results per layout, so `build` returns a cheap handle and every
unit calls `session_for(env)`, which (re)establishes SGLang's state when another layout ran in between:
SGLang's own teardown (destroy_model_parallel, reset_context), then publish + init_parallel_runtime +
init_layer_runtime, then the model built by SGLang's `_initialize_model` (architecture from the config, the
shared-experts resolution, the stage-producer check) and loaded by the model class's own `load_weights`.
Every rank runs the same job sequence, so the group creations (collective in torch) line up.

What a ModelRunner would own and the units need is built here from SGLang's own classes, on the rank's device:
`ReqToTokenPool`, `MHATokenToKVPool` (`MLATokenToKVPool` for DeepSeek's latent attention), the `TokenToKVPoolAllocator` and the `TorchNativeAttnBackend` (its
constructor reads only `device`, `req_to_token_pool` and `token_to_kv_pool` of a runner: `_PoolOwner`).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from dpep_parity.checks.harness.recorder import setup_phase
from dpep_parity.checks.targets.protocol import BuildEnv
from dpep_parity.checks.targets.sglang import cpu_shims, eras
from dpep_parity.checks.targets.sglang.releases import installed_version

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ATTENTION_BACKEND = "torch_native"   # the one SGLang backend built from pools alone (docs/sglang.md)

STATS: dict[str, list[float]] = {"import": [], "setup": [], "teardown": [], "load": []}


@dataclass
class Handle:
    unit: str
    env: BuildEnv
    placement: str | None = None     # an expert placement of PLACEMENTS, None: SGLang's trivial one
    options: tuple[tuple[str, object], ...] = ()   # further server arguments (SGLangTarget.server_options)


def build(unit: str, env: BuildEnv, placement: str | None = None, options: tuple = ()) -> Handle:
    return Handle(unit, env, placement, tuple(options))


def _rotated(config: dict) -> dict:
    """Every layer's experts rotated by half their number: physical slot p holds logical expert
    (p + E/2) mod E, so under EP every expert lives on another rank than in the trivial placement."""
    from dpep_parity.fixtures.families import num_experts
    n = num_experts(config)
    return {"physical_to_logical_map": [[(p + n // 2) % n for p in range(n)]
                                        for _ in range(config["num_hidden_layers"])]}


# Static expert placements (ServerArgs.init_expert_location, what EPLB hands a server): a placement moves
# weights between physical slots and ranks and must never change which logical experts a token uses.
PLACEMENTS = {"rotated": _rotated}


class _PoolOwner:
    """The three attributes of a ModelRunner that TorchNativeAttnBackend.__init__ reads."""

    def __init__(self, device, req_to_token_pool, token_to_kv_pool):
        self.device = device
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool


class Pools:
    """SGLang's KV cache for one model on one rank: request rows, token slots, per-layer K/V buffers, and the
    attention backend over them. Grown (rebuilt) when an example needs more than it holds; reset before every
    example: allocators cleared and the K/V buffers poisoned with NaN, so a read of a slot this example did
    not write shows up as NaN in the output instead of passing on stale values."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device, adapter):
        self.model, self.dtype, self.device, self.adapter = model, dtype, device, adapter
        self.tokens = self.rows = self.context = 0
        self.req_to_token = self.kv = self.allocator = self.backend = None

    def ensure(self, tokens: int, rows: int, context: int) -> None:
        if tokens <= self.tokens and rows <= self.rows and context <= self.context:
            return
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        TokenToKVPoolAllocator = self.adapter.token_allocator_class()
        self.tokens, self.rows, self.context = (max(2 * tokens, 1024, self.tokens), max(2 * rows, 16, self.rows),
                                                max(2 * context, 256, self.context))
        attn = self.model.model.layers[0].self_attn
        dev = str(self.device)
        self.req_to_token = ReqToTokenPool(size=self.rows, max_context_len=self.context, device=dev,
                                           enable_memory_saver=False)
        if is_mla(self.model):        # DeepSeek's latent cache: one [tokens, 1, kv_lora_rank + rope] buffer a layer
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
            self.kv = MLATokenToKVPool(size=self.tokens, page_size=1, dtype=self.dtype, kv_lora_rank=attn.kv_lora_rank,
                                       qk_rope_head_dim=attn.qk_rope_head_dim, layer_num=len(self.model.model.layers),
                                       device=dev, enable_memory_saver=False)
        else:                         # RadixAttention's head counts on this rank
            self.kv = MHATokenToKVPool(size=self.tokens, page_size=1, dtype=self.dtype,
                                       head_num=attn.attn.tp_k_head_num, head_dim=attn.attn.qk_head_dim,
                                       layer_num=len(self.model.model.layers), device=dev,
                                       enable_memory_saver=False, v_head_dim=attn.attn.v_head_dim)
        self.allocator = TokenToKVPoolAllocator(self.tokens, self.dtype, dev, self.kv, need_sort=False)
        self.backend = TorchNativeAttnBackend(_PoolOwner(dev, self.req_to_token, self.kv))

    def take_rows(self, n: int) -> list[int]:
        """n request rows from SGLang's request pool (its own allocation, as the installed release does it)."""
        rows = self.adapter.alloc_rows(self.req_to_token, n) if n else []
        if rows is None:
            raise RuntimeError(f"sglang target: request pool has no {n} free rows")
        return rows

    def release(self, row: int, tokens: int) -> None:
        """A request's token slots and its row back to SGLang's allocators."""
        self.allocator.free(self.req_to_token.req_to_token[row, :tokens].to(torch.int64))
        self.adapter.free_rows(self.req_to_token, [row])

    def reset(self) -> None:
        self.allocator.clear()
        self.req_to_token.clear()
        self.req_to_token.req_to_token.zero_()
        bufs = self.kv.kv_buffer if is_mla(self.model) else (*self.kv.k_buffer, *self.kv.v_buffer)
        for buf in bufs:
            buf.fill_(float("nan"))


def is_mla(model) -> bool:
    """Whether the model's attention is multi-head latent attention (DeepSeek's DeepseekV2AttentionMLA)."""
    return hasattr(model.model.layers[0].self_attn, "kv_lora_rank")


class Session:
    """SGLang's state for one (layout, model config, dtype, device) in this process."""

    def __init__(self, key, env: BuildEnv, placement: str | None, options: tuple = ()):
        self.key, self.env, self.placement, self.options = key, env, placement, options
        self.model = None
        self.pools: Pools | None = None
        self.server_args = self.model_config = None
        self.serving = None          # units.ServingState of the serving session whose KV the pools hold
        self.adapter = eras.adapter(installed_version())   # the installed release's way of each step


_SESSION: Session | None = None


def _key(env: BuildEnv, placement: str | None, options: tuple = ()):
    cfg = hashlib.sha1(json.dumps(env.config, sort_keys=True).encode()).hexdigest()[:16]
    return (env.layout, cfg, env.dtype, str(env.device), placement, options)


def session_for(env: BuildEnv, placement: str | None = None, options: tuple = ()) -> Session:
    global _SESSION
    key = _key(env, placement, options)
    if _SESSION is not None and _SESSION.key == key:
        return _SESSION
    if _SESSION is not None:
        t0 = time.perf_counter()
        _teardown()
        STATS["teardown"].append(time.perf_counter() - t0)
        _SESSION = None
    s = Session(key, env, placement, options)
    with setup_phase(f"SGLang's set-up for {env.layout}"):     # imports, parallel state, model: its own deadline
        _setup(s)
    _SESSION = s
    return s


def _teardown():
    eras.adapter(installed_version()).teardown()


def _teardown_at_exit():
    """A rank that leaves with a live SGLang state tears it down first: SGLang's groups hold shared-memory
    message queues (/dev/shm/sgl_shm_mq_*) that only their destroy unlinks."""
    global _SESSION
    if _SESSION is not None:
        _SESSION = None
        try:
            _teardown()
        except Exception:       # the process is leaving: nothing to report to
            pass


atexit.register(_teardown_at_exit)     # this module is imported on the rank processes only


def _config_dir(config: dict) -> str:
    """A model directory holding only config.json, for SGLang's ModelConfig (weights come from env), in the
    world's temporary folder (DPEP_WORLD_TMP: removed with the world, also when its ranks are killed)."""
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    root = os.environ.get("DPEP_WORLD_TMP") or tempfile.gettempdir()
    d = os.path.join(root, f"sglang-config-{os.getpid()}-{digest}")
    if not os.path.exists(os.path.join(d, "config.json")):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
    return d


def _served_config(config: dict, dtype: torch.dtype) -> dict:
    """config.json as SGLang reads it. Works around finding F9 (docs/findings.md): GPT-OSS builds its router with
    `params_dtype=config.dtype` (models/gpt_oss.py, GptOssSparseMoeBlock), the checkpoint's dtype, not the served
    one, so serving in another dtype fails at the first MoE step (mat1 and mat2 dtypes differ); the workaround is
    what a user would do, a config.json saying the served dtype. DPEP_SGLANG_WORKAROUNDS=off: as shipped."""
    if config.get("model_type") not in F9_ARCHS or os.environ.get("DPEP_SGLANG_WORKAROUNDS") == "off":
        return config
    name = _DTYPE_NAMES[dtype]
    return {**config, "dtype": name, "torch_dtype": name}


F9_ARCHS = ("gpt_oss",)


def _quiet_sglang() -> None:
    """SGLang's start-up advice (NUMA, chunked-prefill sizes, unsupported quantizations, model modules that do
    not import here) is written by every rank at every layout change; keep its errors only, unless
    DPEP_SGLANG_LOG is set."""
    if os.environ.get("DPEP_SGLANG_LOG"):
        return
    import logging
    import warnings
    logging.getLogger("sglang").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"sglang(\.|$)")


def _setup(s: Session):
    env = s.env
    lay, dev = env.layout, env.device
    cpu_shims.set_cpu_thread_binding(lay.tp)
    _quiet_sglang()
    t0 = time.perf_counter()
    cpu_shims.install_import_shims()   # no-op when the target module installed it already
    import sglang.srt.server_args  # noqa: F401  (the import cost is measured here, not in setup)
    cpu_shims.install(dev.type)
    STATS["import"].append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    placement = {} if s.placement is None else {
        "init_expert_location": json.dumps(PLACEMENTS[s.placement](env.config))}
    s.adapter.setup(s, dict(
        model_path=_config_dir(_served_config(env.config, env.dtype)), device=dev.type, dtype=_DTYPE_NAMES[env.dtype],
        tp_size=lay.tp, dp_size=lay.dp, enable_dp_attention=lay.dp > 1, ep_size=lay.ep,
        enable_dp_lm_head=lay.dp_lm_head, disable_cuda_graph=True, skip_tokenizer_init=True,
        disable_custom_all_reduce=dev.type == "cpu", attention_backend=ATTENTION_BACKEND,
        load_format="dummy", **placement, **dict(s.options)), env.rank, dev)
    # What ModelRunner.initialize does before it loads the model (maybe_init_expert_location_metadata): the
    # placement of every expert (SGLang's trivial one unless the server arguments name another), which
    # the weight loader and the router read.
    s.adapter.init_expert_location(s)
    STATS["setup"].append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    s.model = _build_model(env, s.model_config, s.adapter)
    s.pools = Pools(s.model, env.dtype, dev, s.adapter)
    STATS["load"].append(time.perf_counter() - t0)


def _build_model(env: BuildEnv, model_config, adapter) -> torch.nn.Module:
    """The whole model as SGLang's loader builds it (`_initialize_model`: the architecture's class from the
    config, under the resolved shared-experts config, with its stage-producer check), loaded from the fixture's
    tensors by the model class's own `load_weights` (stacked qkv / gate_up mappings, FusedMoE expert mapping,
    every parameter's `weight_loader` sharding for this rank) and SGLang's post-load processing."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    dev = env.device
    with set_default_torch_dtype(env.dtype), torch.device(dev):
        model = adapter.initialize_model(_initialize_model, model_config, LoadConfig(load_format="dummy"))
    # The loader gets each tensor as a fresh copy, as a server reads it from its files: SGLang's loaders may write
    # into what they are handed (GPT-OSS's zeroes the down-projection bias in place on MoE-TP ranks > 0, finding
    # F10), and env.weights is the rank's cached checkpoint, shared by every later build on it. One tensor at a
    # time: each copy lives only until the loader has put it into its parameter.
    fresh = ((name, t.clone()) for name, t in env.weights.items())
    DefaultModelLoader.load_weights_and_postprocess(model, fresh, torch.device(dev))
    return model.eval()
