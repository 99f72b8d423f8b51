from dpep_parity.checks.targets.sglang.museum import MISS, Exhibit, span

EXHIBIT = Exhibit(
    id="M36262",
    title="prefill CUDA-graph capture sizes not aligned to attention TP under DP attention",
    upstream=("sgl-project/sglang#36262 (open)", "#33200 (open, the same alignment)"),
    mechanism="with breakable prefill graphs allowed under DP attention (0.5.17), the prefill graph runner "
              "captures at the raw bucket list and sets global_num_tokens from the bucket, bypassing the eager "
              "ceil_align to attn_tp_size: the MAX_LEN gather's attention-TP reduce_scatter_tensor gets a row "
              "count it cannot split",
    kind="crash (ValueError during graph capture)",
    shipped=span("0.5.17", "0.5.21"),
    fixed="0.5.22",
    evidence="0.5.17 model_executor/runner/prefill_cuda_graph_runner.py:272 (capture_num_tokens = the raw "
             "list), :1213 (global_num_tokens_cpu = [num_tokens] * dp_size); 0.5.22 :166-172, :353 "
             "(ceil_align to get_cuda_graph_batch_size_alignment, which includes attn_tp_size); the eager "
             "prepare_mlp_sync_batch aligns first in every release (0.5.17 forward_batch_info.py:1247)",
    status=MISS,
    why="CUDA-graph capture code only: the eager preparation the target runs aligns the counts in every "
        "release (its examples at attention TP 2 pass on 0.5.17 - 0.5.21)",
)
