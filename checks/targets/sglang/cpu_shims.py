"""CPU stand-ins that let SGLang's real layers run on a CPU / gloo world. Nothing here touches the parallel
logic under test (group maps, gathers, scatters, reductions, padding modes, expert placement): each shim
replaces a device kernel or a device lookup that has no CPU path in sglang 0.5.23, and names the SGLang
function it stands in for. `install(device)` applies them only for device == "cpu"; on CUDA SGLang runs
unpatched. `install_torchvision_standin()` is import-time and runs before sglang is imported.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_INSTALLED: dict[str, object] = {}


# ---------------------------------------------------------------- import time
class _Unavailable:
    """Any torchvision attribute: resolvable at import time (module-level aliases, default arguments),
    raising the moment it is used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here (checks/targets/sglang/cpu_shims.py); "
                           "the parity target never runs SGLang's multimodal code")

    def __repr__(self):
        return f"<torchvision stand-in {self._name}>"


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for `torchvision` (imported unconditionally by sglang.srt.multimodal.internvl_utils via
    sglang.srt.configs, on the import path of every model module). PyPI's torchvision needs CUDA torch and
    fails to import beside the CPU torch ("operator torchvision::nms does not exist")."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
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
            return _Unavailable(f"{_m}.{name}")
        module.__getattr__ = __getattr__


def install_torchvision_standin() -> bool:
    """Install the stand-in unless a working torchvision is importable. Returns True if installed."""
    if "torchvision" in _INSTALLED:
        return True
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
            return False                    # a real, working torchvision (GPU runners)
        except Exception:
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
    finder = _TorchvisionStandIn()
    sys.meta_path.insert(0, finder)
    _INSTALLED["torchvision"] = finder
    return True


def set_cpu_thread_binding(world_size: int) -> None:
    """sglang's CPU thread binding (numa_utils.init_threads_binding, called from
    bootstrap.init_parallel_runtime) asserts on NUMA layouts unless SGLANG_CPU_OMP_THREADS_BIND names one
    core set per rank: give rank r the core r mod ncores."""
    n = os.cpu_count() or 1
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % n) for r in range(world_size))


# ---------------------------------------------------------------- run time (device == "cpu" only)
def install(device: str) -> list[str]:
    """Apply the run-time shims for `device` (CPU shims only when device is cpu), the gloo transport shims
    when the world's process groups are gloo, and the workarounds of diagnosed SGLang bugs (every device);
    returns the names applied."""
    import torch.distributed as dist
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    done = []
    # DPEP_SGLANG_WORKAROUNDS=off: SGLang as shipped, its diagnosed bugs included (the museum's F3 exhibit)
    fixes = [] if os.environ.get("DPEP_SGLANG_WORKAROUNDS") == "off" else _WORKAROUNDS
    for name, fn in fixes + (_GLOO_SHIMS if gloo else []) + (_SHIMS if device == "cpu" else []):
        if name not in _INSTALLED:
            _INSTALLED[name] = fn()
        done.append(name)
    return done


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


_WORKAROUNDS: list = [
    ("torch_native_seq_len_fill_value", _torch_native_seq_len_fill_value),
]


def _forward_batch_unpinned():
    """Stands in for `is_cpu()` as read by ForwardBatch.prepare_mlp_sync_batch (forward_batch_info._is_cpu):
    it copies global_num_tokens through pinned host memory unless SGLang runs its CPU engine
    (SGLANG_USE_CPU_ENGINE=1, which needs SGLang's CPU kernel build), and torch's CPU build has no pinned
    allocator. The module flag selects only the unpinned copy and the CPU graph seq-len fill value (both
    plain host work); the padding mode, counts and buffer sizes it computes are untouched."""
    from sglang.srt.model_executor import forward_batch_info
    forward_batch_info._is_cpu = True
    return "forward_batch_info._is_cpu"


def _dp_attention_cpu_copy():
    """Stands in for dp_attention.memcpy_triton, the row copy dp_gather / dp_scatter use to place this DP
    rank's rows in (and take them back from) the global DP buffer: dp_attention picks it whenever `is_cpu()`
    is False, and Triton has no CPU driver. The same module's `memcpy_cpu` is the copy SGLang itself uses on
    CPU (same offsets and sizes): select it. Offsets, sizes and the collectives around it are untouched."""
    from sglang.srt.layers import dp_attention
    dp_attention.memcpy_func = dp_attention.memcpy_cpu
    return "dp_attention.memcpy_func = memcpy_cpu"


def _dispatcher_device():
    """Stands in for utils.common.get_device() as called by the standard token dispatcher
    (moe/token_dispatcher/standard.py, StandardDispatcher.dispatch) to place its local_expert_mapping table:
    get_device() knows accelerators only and raises on a CPU host. Answer "cpu" there; the table's
    contents (which global expert maps to which local slot, -1 for non-local ones) are SGLang's."""
    from sglang.srt.layers.moe.token_dispatcher import standard
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
    shutdown."""
    from sglang.srt.distributed import parallel_state
    parallel_state._is_cpu = True
    return "parallel_state._is_cpu"


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

    fused_gate_sigmoid_mul_add.__wrapped__ = qwen2_moe.fused_gate_sigmoid_mul_add
    fused_gate_sigmoid_mul.__wrapped__ = qwen2_moe.fused_gate_sigmoid_mul
    qwen2_moe.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add
    qwen2_moe.fused_gate_sigmoid_mul = fused_gate_sigmoid_mul
    return "qwen2_moe.fused_gate_sigmoid_mul(_add): torch, fp32 like the kernel"


def _rotary_cpu_platform():
    """Stands in for `is_cpu()` as read by the rotary embedding's constructor (rotary_embedding.base._is_cpu):
    on a platform it does not recognise as CPU (off SGLang's CPU engine) it imports the CUDA / vllm rotary
    kernel (`vllm._custom_ops.rotary_embedding`) that no CPU build has. The flag is read only there; with it
    the module keeps SGLang's torch path (the cos / sin cache it computes, applied with torch ops).
    Positions, the cache and the rotation itself stay SGLang's."""
    from sglang.srt.layers.rotary_embedding import base
    base._is_cpu = True
    return "rotary_embedding.base._is_cpu"


_SHIMS: list = [
    ("rotary_cpu_platform", _rotary_cpu_platform),
    ("shared_expert_gate_torch", _shared_expert_gate_torch),
    ("coordinator_cpu_collectives", _coordinator_cpu_collectives),
    ("reduce_scatterv_without_pynccl", _reduce_scatterv_without_pynccl),
    ("native_moe_nonlocal_ids", _native_moe_nonlocal_ids),
    ("dispatcher_device", _dispatcher_device),
    ("dp_attention_cpu_copy", _dp_attention_cpu_copy),
    ("forward_batch_unpinned", _forward_batch_unpinned),
]
