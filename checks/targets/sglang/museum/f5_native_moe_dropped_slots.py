from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span

EXHIBIT = Exhibit(
    id="F5",
    title="EP on SGLang's CPU platform without AMX: the native MoE forward indexes the dispatcher's -1 slots",
    upstream=("found by this suite, docs/findings.md F5",),
    mechanism="under EP the standard dispatcher maps experts another rank owns to -1 (the GPU runners skip such "
              "slots); UnquantizedFusedMoEMethod.forward_cpu without the AMX backend calls moe_forward_native, "
              "whose cnts.scatter_(1, topk_ids, 1) takes -1 as an index: every EP step fails",
    kind="crash (every EP step on the CPU engine without AMX)",
    shipped=span("0.5.10", "0.5.23"),
    fixed=None,
    evidence="0.5.23 layers/moe/fused_moe_native.py:71-81 (`cnts.scatter_(1, topk_ids.to(torch.int64), 1)`), "
             "token_dispatcher/standard.py:94-101 (-1 for non-local experts), quantization/unquant.py "
             "forward_cpu (native forward unless use_intel_amx_backend); before 0.5.10 the dispatcher's table "
             "on 'cuda' (EPMAP) fails first",
    status=CAUGHT,
    prop="no-crash",
    # SGLang's own CPU paths, and the target's stand-in for the -1 slots off (cpu_shims._native_moe_nonlocal_ids)
    env={"DPEP_SGLANG_CPU_PATHS": "own", "DPEP_SGLANG_SHIMS_OFF": "native_moe_nonlocal_ids"},
    query="replay: --target sglang --unit moe --fixture qwen3-moe --layout tp2-dp1-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:0+3,2+2 seed=5'",
)
