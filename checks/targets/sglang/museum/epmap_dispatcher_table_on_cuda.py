from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit

EXHIBIT = Exhibit(
    id="EPMAP",
    title="EP on SGLang's CPU platform: the token dispatcher builds its expert table on the literal device "
          "'cuda'",
    upstream=("no upstream number found; the fix is 0.5.10's get_device() in the standard dispatcher",),
    mechanism="StandardDispatcher.dispatch makes local_expert_mapping with torch.full(..., device='cuda') and "
              "torch.arange(..., device='cuda') whenever moe_ep_size > 1: every EP step fails on a host "
              "without CUDA (SGLang's CPU engine); 0.5.10 asks get_device(), which answers 'cpu' there",
    kind="crash (every EP step on the CPU engine)",
    shipped=("0.5.8", "0.5.8.post1", "0.5.9"),
    fixed="0.5.10",
    evidence="0.5.9 layers/moe/token_dispatcher/standard.py:148-157 (device=\"cuda\" twice); 0.5.10 :35 "
             "imports get_device, :157 `device = get_device()` (utils/common.py:1805-1813: 'cpu' under the CPU "
             "engine); older releases ship it too (0.5.3.post3 in FusedMoE.forward), outside the target's reach",
    status=CAUGHT,
    prop="no-crash",
    # the CPU shims select SGLang's own CPU paths only (cpu_shims.own_cpu_paths_only); no DP attention, so the
    # DP path's own CPU gaps (M12961) stay out of the example
    env={"DPEP_SGLANG_CPU_PATHS": "own"},
    query="replay: --target sglang --unit moe --fixture qwen3-moe --layout tp2-dp1-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:0+3,2+2 seed=5'",
)
