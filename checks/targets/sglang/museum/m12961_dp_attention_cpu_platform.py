from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span

EXHIBIT = Exhibit(
    id="M12961",
    title="DP attention crashes on SGLang's CPU platform: pinned host copies, a Triton row copy and CUDA-only "
          "collective ops on the DP path",
    upstream=("sgl-project/sglang#12961 ('Fix DP attention on CPU': its change is 0.5.19's, word for word in "
              "the TODO comments; the tracker dates it 2025-11, before the 0.5.19 wheel: the PR that landed it "
              "in the release is not identified)",),
    mechanism="prepare_mlp_sync_batch copies the DP token counts through pinned host memory, dp_gather / "
              "dp_scatter place rows with memcpy_triton, and GroupCoordinator.all_gather_into_tensor / "
              "reduce_scatter_tensor call custom ops registered for CUDA only: every DP-attention step fails on "
              "a CPU host; 0.5.19 adds the CPU branches (unpinned copy, memcpy_cpu, torch.distributed)",
    kind="crash (every DP-attention step on the CPU engine)",
    shipped=span("0.5.8", "0.5.18"),
    fixed="0.5.19",
    evidence="0.5.18 model_executor/forward_batch_info.py:1460 (`torch.tensor(global_num_tokens, "
             "pin_memory=True)`), layers/dp_attention.py:473 / :830 (memcpy_triton), "
             "distributed/parallel_state.py all_gather_into_tensor (reg_all_gather_into_tensor unless NPU); "
             "0.5.19 forward_batch_info.py:1491 (`use_pin_memory = not _is_cpu`), dp_attention.py:467-497 "
             "(memcpy_cpu, `memcpy_func = memcpy_cpu if _is_cpu`), parallel_state.py:1090 / :1271 "
             "(`if _is_npu or _is_cpu`)",
    status=CAUGHT,
    prop="no-crash",
    # the CPU shims select SGLang's own CPU paths where a release has them and stand in for none it lacks
    # (cpu_shims.own_cpu_paths_only); ep1: the uneven reduce-scatter, which no release can run on gloo, stays out
    env={"DPEP_SGLANG_CPU_PATHS": "own"},
    query="replay: --target sglang --unit moe --fixture qwen3-moe --layout tp2-dp2-ep1 --dtype float32 "
          "--layer 1 --batch 'dp0:0+3 dp1:0+2 seed=1'",
)
