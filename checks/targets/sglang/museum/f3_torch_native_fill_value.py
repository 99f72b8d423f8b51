from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span

EXHIBIT = Exhibit(
    id="F3",
    title="DP attention with the torch-native attention backend crashes on its first step",
    upstream=("found by this suite, docs/findings.md F3",),
    mechanism="ForwardBatch.prepare_mlp_sync_batch asks the attention backend for the padded requests' "
              "sequence length (get_cpu_graph_seq_len_fill_value / get_cuda_graph_seq_len_fill_value); "
              "TorchNativeAttnBackend defines neither",
    kind="crash",
    shipped=span("0.5.8", "0.5.23"),
    fixed=None,
    evidence="layers/attention/torch_native_backend.py has no seq_len_fill_value in 0.5.8 .. 0.5.23; "
             "forward_batch_info.py calls it (1 call site in 0.5.8-0.5.18, 2 from 0.5.19)",
    status=CAUGHT,
    prop="no-crash",
    # SGLang as shipped: the target's F3 workaround off (cpu_shims.install)
    env={"DPEP_SGLANG_WORKAROUNDS": "off"},
    query="replay: --target sglang --unit decoder --fixture qwen3-moe --layout tp2-dp2-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:4+1,2+1 dp1:3+1 seed=5'",
)
