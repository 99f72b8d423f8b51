from dpep_parity.checks.targets.sglang.museum import MISS, Exhibit

EXHIBIT = Exhibit(
    id="M9107",
    title="num_token_non_padded overestimated when dp < tp",
    upstream=("sgl-project/sglang#9107",),
    mechanism="CUDA-graph replay copied the DP rank's count where DeepEP scatters tokens over attention TP",
    kind="wasted work / wrong masking under DeepEP",
    shipped=("0.4.10.post2",),
    fixed="0.5.1",
    evidence="0.4.10.post2 model_executor/cuda_graph_runner.py:748-749",
    status=MISS,
    why="CUDA graphs and the DeepEP all-to-all backend only; out of the CPU target's reach (<= 0.5.7: vLLM's RMSNorm)",
)
