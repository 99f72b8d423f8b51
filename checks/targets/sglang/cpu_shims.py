"""CPU stand-ins that let SGLang's real layers run on a CPU / gloo world. Nothing here touches the parallel
logic under test (group maps, gathers, scatters, reductions, padding modes, expert placement): each shim
replaces a device kernel or a device lookup that has no CPU path in sglang 0.5.23, and names the SGLang
function it stands in for. `install(device)` applies them only for device == "cpu"; on CUDA SGLang runs
unpatched but for the torch-native backend's stand-ins (`_BACKEND_SHIMS`: attention sinks, which the backend
the target runs on every device lacks), the workarounds of diagnosed bugs and, while sgl_kernel is the stand-in,
the named native fallback of fused ops whose CUDA path calls it (`_CUDA_SHIMS`: guard_standin_kernels). `install_import_shims()` is import-time and runs before sglang is imported.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys

_INSTALLED: dict[str, object] = {}


# ---------------------------------------------------------------- import time
class _Unavailable:
    """Any attribute of a stand-in package: resolvable at import time (module-level imports and aliases,
    default arguments), raising a harness fault the moment it is used."""

    def __init__(self, name: str, why: str):
        self._name, self._why = name, why

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}", self._why)

    def __call__(self, *a, **k):
        from dpep_parity.checks.targets.protocol import HarnessFault
        raise HarnessFault(f"{self._name} was called, but its package is a stand-in here "
                           f"(checks/targets/sglang/cpu_shims.py): {self._why}")

    def __repr__(self):
        return f"<stand-in {self._name}>"


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for a package SGLang imports at module level on the suite's import path but whose code the
    target never runs (STAND_INS says which and why): every module and attribute resolves, any call raises."""

    def __init__(self, package: str, why: str):
        self.package, self.why = package, why

    def find_spec(self, fullname, path, target=None):
        if fullname == self.package or fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.__file__ = None            # tools that scan sys.modules (hypothesis) skip file-less modules
        module.__version__ = "0.0.0+dpep.standin"
        module.__dpep_standin__ = True

        def __getattr__(name, _m=module.__name__):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Unavailable(f"{_m}.{name}", self.why)
        module.__getattr__ = __getattr__


STAND_INS = {
    # imported unconditionally by sglang.srt.multimodal.internvl_utils via sglang.srt.configs, on the import
    # path of every model module; PyPI's torchvision needs CUDA torch and fails to import beside the CPU torch
    # ("operator torchvision::nms does not exist")
    "torchvision": "the parity target never runs SGLang's multimodal code",
    # SGLang's CUDA kernel package (a 535 MB CUDA-only wheel): sglang 0.5.10 / 0.5.10.post1 import its host KV
    # cache transfer kernels at module level (mem_cache/memory_pool_host.py:47, on model_runner's import path)
    "sgl_kernel": "the parity target runs no CUDA kernel (hierarchical KV cache transfer is never used)",
}


def install_import_shims() -> None:
    """What must be in place before sglang is imported: the stand-ins of STAND_INS (each unless a working
    package is importable), and transformers' AutoConfig.register tolerant of a model type transformers
    already defines."""
    for package in STAND_INS:
        install_standin(package)
    _config_reregistration()


def _config_reregistration() -> None:
    """sglang 0.5.16 - 0.5.19 register their own `qwen3_asr` configs with `AutoConfig.register(name, cls)` at
    import time (configs/qwen3_asr.py:167), which transformers 5.19, defining `qwen3_asr` itself, refuses
    ("already used by a Transformers config"). sglang 0.5.20 made the same call `exist_ok=True`; this applies
    that release's own fix to older releases (their config replaces transformers' as in 0.5.20). Models the
    suite runs are not multimodal: nothing else changes."""
    if "config_register" in _INSTALLED:
        return
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    original = AutoConfig.register

    def register(model_type, config, exist_ok=False):
        return original(model_type, config, exist_ok=exist_ok or model_type in CONFIG_MAPPING_NAMES)
    AutoConfig.register = staticmethod(register)
    _INSTALLED["config_register"] = original


def install_standin(package: str) -> bool:
    """Install the stand-in of `package` unless a working one is importable. Returns True if installed."""
    if package in _INSTALLED:
        return True
    if importlib.util.find_spec(package) is not None:
        try:
            importlib.import_module(package)
            return False                    # a real, working package (GPU runners)
        except Exception:
            for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
                del sys.modules[name]
    finder = _StandIn(package, STAND_INS[package])
    sys.meta_path.insert(0, finder)
    _INSTALLED[package] = finder
    return True


def set_cpu_thread_binding(world_size: int) -> None:
    """sglang's CPU thread binding (numa_utils.init_threads_binding, called from
    bootstrap.init_parallel_runtime) asserts on NUMA layouts unless SGLANG_CPU_OMP_THREADS_BIND names one
    core set per rank: give rank r the core r mod ncores."""
    n = os.cpu_count() or 1
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % n) for r in range(world_size))


# ---------------------------------------------------------------- run time (device == "cpu" only)
def own_cpu_paths_only() -> bool:
    """DPEP_SGLANG_CPU_PATHS=own: where SGLang has a CPU path of its own (its CPU engine's, selected by the
    `_is_cpu` flags), the shims select it; where a release has none (DP attention's row copy, pinned counts
    and the collective custom ops before 0.5.19), SGLang runs as shipped instead of a stand-in (museum M12961:
    DP attention on SGLang's CPU platform; EPMAP: the EP dispatcher's table on "cuda"; F4: reduce_scatterv)."""
    return os.environ.get("DPEP_SGLANG_CPU_PATHS") == "own"


def install(device: str) -> list[str]:
    """Apply the run-time shims for `device` (CPU shims only when device is cpu), the gloo transport shims
    when the world's process groups are gloo, the torch-native backend's stand-ins (every device: the target
    runs that backend everywhere) and the workarounds of diagnosed SGLang bugs (every device); returns the
    names applied."""
    import torch.distributed as dist
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    done = []
    # DPEP_SGLANG_WORKAROUNDS=off: SGLang as shipped, its diagnosed bugs included (the museum's F3 exhibit)
    fixes = [] if os.environ.get("DPEP_SGLANG_WORKAROUNDS") == "off" else _WORKAROUNDS
    # DPEP_SGLANG_SHIMS_OFF=name,...: these stand-ins not applied (the museum's F5 exhibit); unknown names refused
    off = {n for n in os.environ.get("DPEP_SGLANG_SHIMS_OFF", "").split(",") if n}
    named = _SHIMS + _GLOO_SHIMS + _BACKEND_SHIMS + _CUDA_SHIMS
    unknown = off - {n for n, _ in named}
    if unknown:
        raise ValueError(f"DPEP_SGLANG_SHIMS_OFF: unknown shims {sorted(unknown)}; known: "
                         f"{sorted(n for n, _ in named)}")
    cuda = _CUDA_SHIMS if device == "cuda" and standin_kernels() else []
    for name, fn in fixes + _BACKEND_SHIMS + (_GLOO_SHIMS if gloo else []) + (_SHIMS if device == "cpu" else []) + cuda:
        if name in off:
            continue
        if name not in _INSTALLED:
            _INSTALLED[name] = fn()
        done.append(name)
    return done


# ---------------------------------------------------------------- the torch-native backend (any device)
_SINKS: list = [None]      # the calling layer's attention sinks while its backend call runs (one thread)


def _torch_native_attention_sinks():
    """Stands in for attention sinks in SGLang's torch-native backend, which GPT-OSS needs and the backend
    lacks: `GptOssAttention` calls `self.attn(..., sinks=self.sinks)`, RadixAttention hands the keyword to the
    backend, and TorchNativeAttnBackend.forward_extend / forward_decode take no `sinks` (TypeError). Every backend
    SGLang allows GPT-OSS (triton, fa3, trtllm_mha, ...) is a device kernel with no CPU build here. The stand-in
    is the Triton kernels' contract (kernels/ops/attention/extend_attention.py and decode_attention.py: the
    sink joins the softmax's denominator, `deno += exp(sink - max)`, and gets no value): the backend's forward
    takes `sinks`, and its per-request SDPA call computes softmax([scores, sink_h])[..., :-1] @ v in float32,
    one rounding to the query dtype, under the backend's own mask (causal, or its sliding window). Which rows,
    cache slots, window and heads (the rank's shard of the sinks) stay SGLang's."""
    import torch
    from sglang.srt.layers.attention import torch_native_backend as tnb

    sdpa = tnb.scaled_dot_product_attention

    def scaled_dot_product_attention(q, k, v, attn_mask=None, enable_gqa=False, scale=None, is_causal=False,
                                     **kw):
        sinks = _SINKS[0]
        if sinks is None:
            return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, scale=scale, is_causal=is_causal, **kw)
        heads, kv_heads = q.shape[-3], k.shape[-3]
        if heads != kv_heads:
            k, v = (t.repeat_interleave(heads // kv_heads, dim=-3) for t in (k, v))
        scores = (q.float() @ k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        sink = sinks.float().view(heads, 1, 1).expand(*scores.shape[:-1], 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return (p @ v.float()).to(q.dtype)

    scaled_dot_product_attention.__wrapped__ = sdpa
    tnb.scaled_dot_product_attention = scaled_dot_product_attention
    cls = tnb.TorchNativeAttnBackend
    for name in ("forward_extend", "forward_decode"):
        original = getattr(cls, name)

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, _original=original,
                    **kw):
            _SINKS[0] = sinks
            try:
                return _original(self, q, k, v, layer, forward_batch, save_kv_cache, **kw)
            finally:
                _SINKS[0] = None
        forward.__wrapped__ = original
        setattr(cls, name, forward)
    return "TorchNativeAttnBackend.forward_extend/forward_decode take sinks: Triton's contract in torch"


def _gpt_oss_backend_check():
    """With the sinks stand-in above the torch-native backend serves GPT-OSS, but SGLang's server-argument
    check refuses it (arg_groups/model_hook.py, GptOssForCausalLM: "torch_native has neither sliding window nor
    attention sinks"; its sliding window it has: TorchNativeAttnBackend._make_sliding_window_mask). The stand-in
    shows that check (and model_hook's only other caller, Gemma4's check) a Triton backend where the server
    arguments say torch_native; the server arguments, and every other reader of the backend, keep torch_native."""
    def shown(backends):
        return tuple("triton" if b == "torch_native" else b for b in backends)

    try:
        from sglang.srt.arg_groups import model_hook
        original = model_hook.attention_backends_of
    except (ImportError, AttributeError):
        return _gpt_oss_backend_check_in_server_args(shown)

    def attention_backends_of(view):
        return shown(original(view))
    attention_backends_of.__wrapped__ = original
    model_hook.attention_backends_of = attention_backends_of
    return "model_hook.attention_backends_of: torch_native shown as triton to the GPT-OSS check"


def _gpt_oss_backend_check_in_server_args(shown):
    """Releases before the arg groups (0.5.11 - 0.5.18) make the same check in
    `ServerArgs._handle_model_specific_adjustments`, reading the instance's resolved backends: for a GPT-OSS
    model only, and only during that call, the instance answers with torch_native shown as triton."""
    from sglang.srt.server_args import ServerArgs
    original = getattr(ServerArgs, "_handle_model_specific_adjustments", None)
    # the check's reader: get_attention_backends (0.5.11 - 0.5.14, 0.5.16 - 0.5.18), _resolved_attention_backends
    # (0.5.15)
    readers = [n for n in ("get_attention_backends", "_resolved_attention_backends") if hasattr(ServerArgs, n)]
    if original is None or not readers:
        return "no GPT-OSS backend check found: not applied"

    def _handle_model_specific_adjustments(self, *args, **kwargs):
        try:
            arch = self.get_model_config().hf_config.architectures[0]
        except Exception:                   # no model config to read: SGLang's own path decides
            arch = None
        if arch != "GptOssForCausalLM":
            return original(self, *args, **kwargs)
        def reader(read):
            return lambda: shown(read(self))
        for name in readers:
            setattr(self, name, reader(getattr(type(self), name)))
        try:
            return original(self, *args, **kwargs)
        finally:
            for name in readers:
                delattr(self, name)
    _handle_model_specific_adjustments.__wrapped__ = original
    ServerArgs._handle_model_specific_adjustments = _handle_model_specific_adjustments
    return "ServerArgs._handle_model_specific_adjustments: torch_native shown as triton to the GPT-OSS check"


_BACKEND_SHIMS: list = [
    ("torch_native_attention_sinks", _torch_native_attention_sinks),
    ("gpt_oss_backend_check", _gpt_oss_backend_check),
]


# ---------------------------------------------------------------- CUDA without sgl_kernel (issue 34)
REPLACED: dict[str, str] = {}     # "Op.forward_cuda" -> the stand-in kernel it called, in this process


def _name_replacement(key: str, kernel: str, instead: str) -> None:
    """Record, once per process, that SGLang's `key` ran `instead` because `kernel` is a stand-in (REPLACED, and a
    line on this rank's stderr)."""
    if key not in REPLACED:
        REPLACED[key] = kernel
        print(f"dpep: SGLang kernel replaced: {key} -> {instead} ({kernel} is a stand-in)", file=sys.stderr,
              flush=True)


def standin_kernels() -> bool:
    """Whether this process's sgl_kernel is the stand-in (STAND_INS): SGLang's AOT CUDA kernels are absent."""
    return isinstance(_INSTALLED.get("sgl_kernel"), _StandIn)


def guard_standin_kernels(cls) -> object:
    """On CUDA with sgl_kernel a stand-in (its wheel is built for another torch and is hundreds of MB: docs/gpu.md),
    an SGLang fused op (`cls`: sglang.kernels.fused_op.BaseFusedOp) whose dispatched path calls a stand-in kernel
    runs its own `forward_native` instead, and says so: once per op class on the rank's stderr and in REPLACED.
    SGLang's own dispatch is kept everywhere else (Triton kernels, its JIT kernels, the torch paths). The stand-in
    raises when called, before the kernel would write anything. Returns what to restore."""
    from dpep_parity.checks.targets.protocol import HarnessFault
    resolve = cls._resolve_forward_method

    def resolve_guarded(self):
        method = resolve(self)
        if getattr(method, "__func__", None) is getattr(type(self), "forward_native", None):
            return method           # the op's own native forward: nothing to fall back to

        def guarded(*a, **kw):
            try:
                return method(*a, **kw)
            except HarnessFault as e:
                if "is a stand-in here" not in str(e):
                    raise
                _name_replacement(f"{type(self).__name__}.{getattr(method, '__name__', 'forward')}",
                                  str(e).split(" was called")[0], "forward_native")
                self._forward_method = self.forward_native
                return self.forward_native(*a, **kw)
        return guarded
    cls._resolve_forward_method = resolve_guarded
    return resolve


def _native_where_kernels_are_stand_ins():
    try:
        from sglang.kernels.fused_op import BaseFusedOp
    except ImportError:
        return None                 # a release without SGLang's fused-op dispatch: its kernels fail by name
    return guard_standin_kernels(BaseFusedOp)


def unfused_kv_write_without_kernels() -> tuple:
    """Stands in for `sglang.srt.models.utils.enable_fused_set_kv_buffer` (and every SGLang module that imported
    it) while sgl_kernel is the stand-in. On CUDA with a bfloat16 KV cache it asks the rotary op to write the KV
    cache fused with RoPE, which only sgl_kernel's rope does: without it SGLang's rotary CUDA path refuses ("save
    kv cache is not supported for fallback_rotary_embedding", the tp1 run on an H100: docs/gpu.md). Here it says
    False: RoPE alone, and the attention backend writes the cache itself (`save_kv_cache`), as on SGLang's
    other platforms. Named in REPLACED and on the rank's stderr when first asked. Returns (the original, the
    modules patched); SGLang modules imported later read the patched function from its module."""
    try:
        import sglang.srt.models.utils as mu
        before = mu.enable_fused_set_kv_buffer
    except (ImportError, AttributeError):
        return None, []             # a release without the fused write

    def unfused(forward_batch):
        _name_replacement("models.utils.enable_fused_set_kv_buffer", "sgl_kernel's fused RoPE + KV-cache write",
                          "False: RoPE, then the attention backend writes the KV cache")
        return False
    patched = [name for name, mod in list(sys.modules.items())
               if name.startswith("sglang.") and getattr(mod, "enable_fused_set_kv_buffer", None) is before]
    for name in patched:
        sys.modules[name].enable_fused_set_kv_buffer = unfused
    return before, patched


_CUDA_SHIMS: list = [
    ("native_where_kernels_are_stand_ins", _native_where_kernels_are_stand_ins),
    ("unfused_kv_write_without_kernels", unfused_kv_write_without_kernels),
]


# ---------------------------------------------------------------- gloo process groups (any device)
def _gloo_stacked_all_gather():
    """Stands in for the transport of GroupCoordinator._all_gather_into_tensor when its device group is gloo:
    torch.distributed.all_gather_into_tensor documents two output forms, the concatenation of the inputs
    along dim 0 and their stack along a new dim 0, and NCCL accepts both; gloo accepts only the
    concatenation ("invalid tensor size at index 0 (expected (1, 256), got (1, 1, 256))"). SGLang's
    LogitsProcessor._gather_attn_tp_logits (dp-lm-head with attention TP > 1) gathers into the stacked form.
    A stacked output is passed to gloo as the same storage viewed in the concatenated form: the bytes each
    rank contributes, their order and the result are unchanged."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    original = GroupCoordinator._all_gather_into_tensor

    def _all_gather_into_tensor(self, output, input):
        if (output.dim() == input.dim() + 1 and output.is_contiguous()
                and dist.get_backend(self.device_group) == "gloo"):
            output = output.view(-1, *input.shape[1:])
        return original(self, output, input)
    _all_gather_into_tensor.__wrapped__ = original
    GroupCoordinator._all_gather_into_tensor = _all_gather_into_tensor
    return "GroupCoordinator._all_gather_into_tensor: stacked output viewed concatenated on gloo"


_GLOO_SHIMS: list = [
    ("gloo_stacked_all_gather", _gloo_stacked_all_gather),
]


# ---------------------------------------------------------------- workarounds of findings (every device)
def _torch_native_seq_len_fill_value():
    """Works around finding F3 (docs/findings.md): under DP attention `ForwardBatch._pad_inputs_to_size`
    (prepare_mlp_sync_batch, every DP step) asks the attention backend for the sequence length of padded
    requests (`get_cuda_graph_seq_len_fill_value`, or `get_cpu_graph_seq_len_fill_value` on CPU), and
    TorchNativeAttnBackend defines neither: the base class raises NotImplementedError, so DP attention with
    `--attention-backend torch_native` fails on its first step. Give it the value every other backend returns
    (1: a padded request reads the one dummy slot its padded row writes). checks/targets/sglang/tests pins
    the failure without this workaround."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    def fill_value(self):
        return 1
    for name in ("get_cuda_graph_seq_len_fill_value", "get_cpu_graph_seq_len_fill_value"):
        if name not in vars(TorchNativeAttnBackend):
            setattr(TorchNativeAttnBackend, name, fill_value)
    return "TorchNativeAttnBackend.get_{cuda,cpu}_graph_seq_len_fill_value -> 1 (F3)"


def _fused_experts_under_ep():
    """Works around finding F7 (docs/findings.md, SGLang #22784): `FusedMoE.weight_loader_fused`, the loader of
    checkpoints that hold every expert in one tensor (unquantized GPT-OSS), narrows the TP dimension but never
    selects the rank's experts, so under EP it copies E experts into a buffer of E / ep and fails. The
    workaround hands it the rank's experts first, in its physical slot order under SGLang's published expert
    placement (physical slot -> logical expert: `get_global_expert_location_metadata`), as SGLang's MXFP4 loader
    slices by `moe_ep_rank`; what the loader does with them (TP narrowing, transposes, the w2 bias on MoE-TP
    rank 0 only) stays SGLang's."""
    import torch
    try:
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    except ImportError:
        return "no FusedMoE: not applied"
    original = getattr(FusedMoE, "weight_loader_fused", None)
    if original is None:
        return "no FusedMoE.weight_loader_fused: not applied"

    def weight_loader_fused(self, param, loaded_weight, weight_name, shard_id, *args, **kwargs):
        local = param.data.shape[0]
        if getattr(self, "moe_ep_size", 1) > 1 and loaded_weight.dim() >= 2 and loaded_weight.shape[0] != local:
            from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
            slots = torch.arange(self.moe_ep_rank * local, (self.moe_ep_rank + 1) * local)
            placed = get_global_expert_location_metadata()
            experts = slots if placed is None else placed.physical_to_logical_map[self.layer_id].cpu()[slots]
            loaded_weight = loaded_weight.index_select(0, experts.to(loaded_weight.device))
        return original(self, param, loaded_weight, weight_name, shard_id, *args, **kwargs)
    weight_loader_fused.__wrapped__ = original
    FusedMoE.weight_loader_fused = weight_loader_fused
    return "FusedMoE.weight_loader_fused: the rank's experts selected under EP"


_WORKAROUNDS: list = [
    ("torch_native_seq_len_fill_value", _torch_native_seq_len_fill_value),
    ("fused_experts_under_ep", _fused_experts_under_ep),
]


def _forward_batch_unpinned():
    """Stands in for `is_cpu()` as read by ForwardBatch.prepare_mlp_sync_batch (forward_batch_info._is_cpu):
    it copies global_num_tokens through pinned host memory unless SGLang runs its CPU engine
    (SGLANG_USE_CPU_ENGINE=1, which needs SGLang's CPU kernel build), and torch's CPU build has no pinned
    allocator. The module flag selects only the unpinned copy and the CPU graph seq-len fill value (both
    plain host work); the padding mode, counts and buffer sizes it computes are untouched. Before 0.5.19 the
    copy is pinned unconditionally (`torch.tensor(global_num_tokens, pin_memory=True)`): the module sees a
    torch whose `tensor` makes that host tensor unpinned, the one difference."""
    from sglang.srt.model_executor import forward_batch_info
    forward_batch_info._is_cpu = True
    if "use_pin_memory" in inspect.getsource(forward_batch_info.ForwardBatch.prepare_mlp_sync_batch):
        return "forward_batch_info._is_cpu"
    if own_cpu_paths_only():
        return "forward_batch_info._is_cpu (the release has no unpinned path: SGLang as shipped)"
    forward_batch_info.torch = _CpuTorch(forward_batch_info.torch)
    return "forward_batch_info._is_cpu, torch.tensor(pin_memory=True) unpinned (before 0.5.19)"


class _CpuTorch:
    """The torch module as one SGLang module sees it on a CPU-only host: a tensor it asks on device "cuda"
    is made on the CPU, and `pin_memory=True` makes an unpinned host tensor (no pinned allocator); every
    other attribute is torch's. Installed only in modules that hard-code those (the shims that use it say
    where)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in ("tensor", "full", "arange", "zeros", "ones", "empty"):
            def make(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)
            return make
        return attr


def _dp_attention_cpu_copy():
    """Stands in for dp_attention.memcpy_triton, the row copy dp_gather / dp_scatter use to place this DP
    rank's rows in (and take them back from) the global DP buffer: dp_attention picks it whenever `is_cpu()`
    is False, and Triton has no CPU driver. The same module's `memcpy_cpu` is the copy SGLang itself uses on
    CPU (same offsets and sizes): select it. Offsets, sizes and the collectives around it are untouched."""
    from sglang.srt.layers import dp_attention
    if hasattr(dp_attention, "memcpy_cpu"):            # 0.5.19+
        dp_attention.memcpy_func = dp_attention.memcpy_cpu
        return "dp_attention.memcpy_func = memcpy_cpu"
    if own_cpu_paths_only():
        return "dp_attention: no CPU copy in this release (SGLang as shipped)"
    # Before 0.5.19 dp_attention calls memcpy_triton itself and has no CPU copy: the kernel's own contract
    # on the CPU (offset and size as tensors or ints, in rows of dim 0, exactly `sz` rows copied).
    _memcpy_rows.__wrapped__ = dp_attention.memcpy_triton
    dp_attention.memcpy_triton = _memcpy_rows
    return "dp_attention.memcpy_triton -> its contract in torch (no CPU copy before 0.5.19)"


def _memcpy_rows(dst, src, dim, offset, sz, offset_src):
    """memcpy_triton_kernel's contract (dp_attention.py, 0.5.10 - 0.5.18): `sz` rows from src[offset:] to
    dst[0:] (offset_src) or from src[0:] to dst[offset:]. A copy outside either buffer, an illegal memory
    access for the kernel, raises here."""
    assert dim == 0, "dim != 0 unsupported"
    assert src.shape[1:] == dst.shape[1:], "src and dst must have same shape"
    offset, sz = int(offset), int(sz)
    s0, d0 = (offset, 0) if offset_src else (0, offset)
    if s0 + sz > src.shape[0] or d0 + sz > dst.shape[0]:
        raise IndexError(f"memcpy_triton: {sz} rows from row {s0} of {src.shape[0]} to row {d0} of {dst.shape[0]}")
    dst[d0: d0 + sz].copy_(src[s0: s0 + sz])


def _dispatcher_device():
    """Stands in for utils.common.get_device() as called by the standard token dispatcher
    (moe/token_dispatcher/standard.py, StandardDispatcher.dispatch) to place its local_expert_mapping table:
    get_device() answers "cpu" only under SGLang's CPU engine (is_cpu(), utils/common.py) and raises on a CPU
    host otherwise. Answer "cpu" there, as the CPU engine does; the table's contents (which global expert maps
    to which local slot, -1 for non-local ones) are SGLang's."""
    from sglang.srt.layers.moe.token_dispatcher import standard
    if not hasattr(standard, "get_device"):
        # before 0.5.10 the table is made on the literal device "cuda" (standard.py:149-156): the module's
        # torch places on the CPU what it asks on "cuda"
        if own_cpu_paths_only():
            return "token_dispatcher.standard: no CPU path in this release (SGLang as shipped)"
        standard.torch = _CpuTorch(standard.torch)
        return "token_dispatcher.standard: device='cuda' tables on the CPU (before 0.5.10)"
    original = standard.get_device

    def get_device(device_id=None):
        return "cpu"
    get_device.__wrapped__ = original
    standard.get_device = get_device
    return "token_dispatcher.standard.get_device -> cpu"


def _native_moe_nonlocal_ids():
    """Stands in for fused_moe_native.moe_forward_native's handling of non-local experts: with EP the
    standard dispatcher maps experts another EP rank owns to the drop sentinel -1 (the Triton / DeepGEMM
    runners skip such slots), but the native CPU fallback (UnquantizedFusedMoEMethod.forward_cpu without
    AMX) scatters the ids as indices and fails on -1. Give each such slot a local expert with routing weight
    0, so it adds exactly nothing, and call SGLang's function. The native forward counts a (row, expert) pair
    once (scatter_, not scatter_add_), so a row's filler experts must be distinct and differ from the row's
    real local experts. Which experts are local, the ids and weights of local slots are SGLang's."""
    import torch
    from sglang.srt.layers.moe import fused_moe_native
    original = fused_moe_native.moe_forward_native

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        ids = topk_output.topk_ids
        dropped = ids < 0
        if bool(dropped.any()):
            n_local = layer.w13_weight.shape[0]
            if n_local < ids.shape[1]:
                raise RuntimeError(f"cpu_shims: {n_local} local experts cannot fill {ids.shape[1]} top-k slots")
            filled = ids.clone()
            for r in torch.nonzero(dropped.any(1)).flatten().tolist():
                used = set(ids[r][ids[r] >= 0].tolist())
                free = iter(e for e in range(n_local) if e not in used)
                for k in torch.nonzero(dropped[r]).flatten().tolist():
                    filled[r, k] = next(free)
            topk_output = topk_output._replace(
                topk_ids=filled, topk_weights=topk_output.topk_weights.masked_fill(dropped, 0))
        return original(layer, x, topk_output, moe_runner_config)
    moe_forward_native.__wrapped__ = original
    fused_moe_native.moe_forward_native = moe_forward_native
    return "fused_moe_native.moe_forward_native: -1 slots -> unused local experts, weight 0"


def _reduce_scatterv_without_pynccl():
    """Stands in for the transport of GroupCoordinator.reduce_scatterv (distributed/parallel_state.py), the
    uneven reduce-scatter the FFN exit takes under attention DP when tp == dp == ep (boundary_reduction
    "rs+rsv", the Qwen MoE default): it asserts a PyNccl communicator, which gloo groups do not have. Route it
    to the same coordinator's _deterministic_reduce_scatterv: SGLang's own implementation of the same
    contract (the same sizes and offsets; an all_reduce of the group, then this rank's rows), which SGLang
    takes under --enable-deterministic-inference. Only for groups without a usable PyNccl communicator."""
    if own_cpu_paths_only():
        return "GroupCoordinator.reduce_scatterv: no CPU path in any release (SGLang as shipped, finding F4)"
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    original = GroupCoordinator.reduce_scatterv
    if not hasattr(GroupCoordinator, "_deterministic_reduce_scatterv"):   # before 0.5.21
        GroupCoordinator._deterministic_reduce_scatterv = _deterministic_reduce_scatterv

    def reduce_scatterv(self, input_, output=None, sizes=None):
        comm = getattr(self, "pynccl_comm", None)
        if comm is None or getattr(comm, "disabled", True) or not getattr(comm, "available", False):
            return self._deterministic_reduce_scatterv(input_, output, sizes)
        return original(self, input_, output, sizes)
    reduce_scatterv.__wrapped__ = original
    GroupCoordinator.reduce_scatterv = reduce_scatterv
    return "GroupCoordinator.reduce_scatterv -> _deterministic_reduce_scatterv without pynccl"


def _deterministic_reduce_scatterv(self, input_, output, sizes):
    """sglang 0.5.21's GroupCoordinator._deterministic_reduce_scatterv (distributed/parallel_state.py:1229-1254)
    for the releases before it, which have only the PyNccl transport: the same contract and the same
    assertions as reduce_scatterv itself (len(sizes) == world size, the rows add up), an all-reduce of the
    group, then this rank's rows."""
    import torch
    if sizes is not None:
        assert len(sizes) == self.world_size
        assert input_.shape[0] == sum(sizes)
        chunk, offset = sizes[self.rank_in_group], sum(sizes[: self.rank_in_group])
    else:
        assert input_.shape[0] % self.world_size == 0
        chunk = input_.shape[0] // self.world_size
        offset = chunk * self.rank_in_group
    shape = (chunk,) + tuple(input_.shape[1:])
    if output is None:
        output = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    else:
        assert tuple(output.shape) == shape
    output.copy_(self.all_reduce(input_.clone()).narrow(0, offset, chunk))
    return output


def _coordinator_cpu_collectives():
    """Stands in for `is_cpu()` as read by GroupCoordinator.all_gather_into_tensor / reduce_scatter_tensor
    (parallel_state._is_cpu): off the CPU engine they call the custom ops sglang::reg_all_gather_into_tensor
    / reg_reduce_scatter_tensor, which are registered for CUDA only; SGLang's CPU branch calls the methods
    those ops wrap (the same coordinator's _all_gather_into_tensor / _reduce_scatter_tensor, i.e.
    torch.distributed over its device group). The flag's only other reader is the CUDA cache flush at
    shutdown. Before 0.5.19 those methods have no CPU branch: the custom ops' own bodies (look the group up,
    call the method it wraps) replace the ops in parallel_state's namespace, the CPU registration they lack."""
    from sglang.srt.distributed import parallel_state
    parallel_state._is_cpu = True
    if "_is_cpu" in inspect.getsource(parallel_state.GroupCoordinator.all_gather_into_tensor):
        return "parallel_state._is_cpu"
    if own_cpu_paths_only():
        return "parallel_state._is_cpu (no CPU branch of the collectives in this release: SGLang as shipped)"
    groups = parallel_state._groups

    def reg_all_gather_into_tensor(output, input, group_name):
        groups[group_name]()._all_gather_into_tensor(output, input)

    def reg_reduce_scatter_tensor(output, input, group_name):
        groups[group_name]()._reduce_scatter_tensor(output, input)
    for fn in (reg_all_gather_into_tensor, reg_reduce_scatter_tensor):
        fn.__wrapped__ = getattr(parallel_state, fn.__name__)
        setattr(parallel_state, fn.__name__, fn)
    return "parallel_state._is_cpu, reg_all_gather_into_tensor / reg_reduce_scatter_tensor bodies (before 0.5.19)"


def _shared_expert_gate_torch():
    """Stands in for the Triton kernels fused_gate_sigmoid_mul_add / fused_gate_sigmoid_mul
    (sglang.kernels.ops.elementwise), which Qwen2MoeSparseMoeBlock.forward uses to apply the shared-expert
    gate sigmoid(x . w) and add the gated shared output to the routed output: Triton has no CPU driver.
    The stand-in computes what the kernel computes, in its precision (row dot product, sigmoid, multiply and
    add in fp32, one rounding to the output dtype), in place as the kernel writes. Which rows, which
    shared output and where it is added (before the MoE reduction) stay SGLang's."""
    import torch
    from sglang.srt.models import qwen2_moe

    def _gated(hidden_states, gate_weight, shared_output):
        gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1))
        return gate[:, None] * shared_output.float()

    def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
        final_hidden_states.copy_(_gated(hidden_states, gate_weight, shared_output) + final_hidden_states.float())

    def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
        return _gated(hidden_states, gate_weight, shared_output).to(shared_output.dtype)

    # fused_gate_sigmoid_mul is imported by qwen2_moe since 0.5.19; fused_gate_sigmoid_mul_add by every release
    patched = []
    for fn in (fused_gate_sigmoid_mul_add, fused_gate_sigmoid_mul):
        if hasattr(qwen2_moe, fn.__name__):
            fn.__wrapped__ = getattr(qwen2_moe, fn.__name__)
            setattr(qwen2_moe, fn.__name__, fn)
            patched.append(fn.__name__)
    return f"qwen2_moe.{'/'.join(patched)}: torch, fp32 like the kernel"


def _rotary_cpu_platform():
    """Stands in for `is_cpu()` as read by the rotary embedding's constructor (rotary_embedding.base._is_cpu):
    on a platform it does not recognise as CPU (off SGLang's CPU engine) it imports the CUDA / vllm rotary
    kernel (`vllm._custom_ops.rotary_embedding`) that no CPU build has. The flag is read only there; with it
    the module keeps SGLang's torch path (the cos / sin cache it computes, applied with torch ops).
    Positions, the cache and the rotation itself stay SGLang's."""
    import importlib
    try:                                                 # a package since 0.5.10
        base = importlib.import_module("sglang.srt.layers.rotary_embedding.base")
    except ModuleNotFoundError:
        base = importlib.import_module("sglang.srt.layers.rotary_embedding")
    base._is_cpu = True
    return f"{base.__name__}._is_cpu"


def _mla_torch_native_dispatch():
    """Stands in for the attention-method choice of DeepSeek's MLA layers (models/deepseek_common/
    attention_backend_handler.py) for the torch-native backend, which has no handler there: SGLang falls back to
    the triton handler, which picks MHA (k and v expanded from the latent, `attn_mha(..., save_kv_cache=False)`)
    for an extend without cached prefix; TorchNativeAttnBackend.forward_extend then attends over the pool's
    buffers, ignoring the k / v it was given (they are never saved), and an MLA pool holds the one-head latent
    there, so the shapes do not match. SGLang's CPU backend for MLA is intel_amx (sgl-kernel's CPU build, not
    installable here). The stand-in registers SGLang's own MLA-subtype dispatch for torch_native: every batch
    takes the absorbed MLA path (q against the latent, `attn_mqa`), which the torch-native backend serves.
    What the MHA prefill path computes for prefix-less extends is not reached on this backend (docs/sglang.md)."""
    try:
        from sglang.srt.models.deepseek_common.attention_backend_handler import (
            AttentionBackendRegistry,
            _dispatch_mla_subtype,
        )
    except ImportError:                  # a release before the registry: its DeepSeek path is not run here
        return "no attention_backend_handler: not applied"
    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)
    return "AttentionBackendRegistry['torch_native'] = _dispatch_mla_subtype"


def _minimax_qk_norm_torch():
    """Stands in for MiniMax-M2's qk-norm Triton kernels (models/minimax_m2.py `rms_sumsq_serial`,
    `rms_apply_serial`, which assert CUDA): Triton has no CPU driver, and SGLang's CPU path for this norm is
    sgl-kernel's AMX build (`_forward_cpu`, not installable here). The stand-in computes what the kernels
    compute, in their precision: per row the float32 sum of squares of q and of k into one float32 buffer
    padded to a multiple of 4 ([q rows | k rows | pad]), then x * rsqrt(sum_sq / D / tp_world + eps) * w in
    float32, one rounding to the input dtype. The attention-TP all-reduce of the sums between the two calls
    (what makes the RMS span every head of the whole projection) stays SGLang's."""
    import torch
    try:
        from sglang.srt.models import minimax_m2
    except ImportError:                  # a release without MiniMax-M2: nothing to stand in for
        return "no models.minimax_m2: not applied"

    def rms_sumsq_serial(x1, x2):
        B, B2 = x1.shape[0], x2.shape[0]
        out = torch.zeros((B + B2 + 3) // 4 * 4, dtype=torch.float32, device=x1.device)
        out[:B] = x1.float().pow(2).sum(-1)
        out[B:B + B2] = x2.float().pow(2).sum(-1)
        return out

    def rms_apply_serial(x1, x2, w1, w2, sum_sq, tp_world=1, eps=1e-5):
        B, D1, D2 = x1.shape[0], x1.shape[1], x2.shape[1]
        inv1 = torch.rsqrt(sum_sq[:B] / D1 / tp_world + eps)[:, None]
        inv2 = torch.rsqrt(sum_sq[B:2 * B] / D2 / tp_world + eps)[:, None]
        return (x1.float() * inv1 * w1.float()).to(x1.dtype), (x2.float() * inv2 * w2.float()).to(x2.dtype)

    for fn in (rms_sumsq_serial, rms_apply_serial):
        fn.__wrapped__ = getattr(minimax_m2, fn.__name__)
        setattr(minimax_m2, fn.__name__, fn)
    return "minimax_m2.rms_sumsq_serial/rms_apply_serial: torch, fp32 like the kernels"


_SHIMS: list = [
    ("rotary_cpu_platform", _rotary_cpu_platform),
    ("mla_torch_native_dispatch", _mla_torch_native_dispatch),
    ("minimax_qk_norm_torch", _minimax_qk_norm_torch),
    ("shared_expert_gate_torch", _shared_expert_gate_torch),
    ("coordinator_cpu_collectives", _coordinator_cpu_collectives),
    ("reduce_scatterv_without_pynccl", _reduce_scatterv_without_pynccl),
    ("native_moe_nonlocal_ids", _native_moe_nonlocal_ids),
    ("dispatcher_device", _dispatcher_device),
    ("dp_attention_cpu_copy", _dp_attention_cpu_copy),
    ("forward_batch_unpinned", _forward_batch_unpinned),
]
