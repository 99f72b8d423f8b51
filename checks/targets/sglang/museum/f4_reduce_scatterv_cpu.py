from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span

EXHIBIT = Exhibit(
    id="F4",
    title="DP attention at tp == dp == ep crashes on SGLang's CPU platform: reduce_scatterv needs PyNccl",
    upstream=("found by this suite, docs/findings.md F4",),
    mechanism="with tp == attn_dp == ep the FFN exit returns the MoE output by GroupCoordinator.reduce_scatterv "
              "(should_use_dp_reduce_scatterv has no platform condition), which forces the group's PyNccl "
              "communicator on (change_state(enable=True)); on a CPU host it was never initialized (no device): "
              "AttributeError on every rank. Only --enable-deterministic-inference takes the all-reduce path "
              "(0.5.21+)",
    kind="crash (every DP step at tp == dp == ep on the CPU engine)",
    shipped=span("0.5.19", "0.5.23"),
    fixed=None,
    evidence="0.5.23 layers/moe/utils.py:730-749 (no platform condition), distributed/parallel_state.py:1253-1286 "
             "(reduce_scatterv -> pynccl_comm.reduce_scatter unless deterministic inference); the path exists "
             "since 0.5.11 (should_use_dp_reduce_scatterv), but before 0.5.19 DP attention on CPU crashes "
             "earlier (M12961): it is observable from 0.5.19",
    status=CAUGHT,
    prop="no-crash",
    env={"DPEP_SGLANG_CPU_PATHS": "own"},
    query="replay: --target sglang --unit decoder --fixture qwen3-moe --layout tp2-dp2-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:0+3 dp1:0+2 seed=1'",
)
