from dpep_parity.checks.targets.sglang.museum import MISS, Exhibit, span

EXHIBIT = Exhibit(
    id="M31100",
    title="routed-expert capture under DP attention slices by the decode graph's batch size after a prefill "
          "graph ran",
    upstream=("sgl-project/sglang#30712 (closed, inactive)", "#31100 (open)"),
    mechanism="ModelRunner hands the state capturers cuda_graph_batch = the decode graph runner's bs whatever "
              "runner ran; get_dp_local_slice_cpu computes dp_rank * cuda_graph_batch when a graph ran: after a "
              "prefill graph that is None (TypeError on dp_rank > 0)",
    kind="crash (--enable-return-routed-experts with prefill graphs)",
    shipped=span("0.5.17", "0.5.23"),
    fixed=None,
    evidence="0.5.23 model_executor/model_runner.py:1884, :1892 (getattr(self.decode_cuda_graph_runner, 'bs', "
             "None)), layers/dp_attention.py:596-610; the arithmetic since 0.5.7, reachable with prefill graphs "
             "under DP attention from 0.5.17",
    status=MISS,
    why="CUDA graphs only (eager runs slice by the gathered counts, which is right) and it concerns "
        "routed-expert capture, which the target does not request",
)
