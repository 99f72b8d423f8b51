from dpep_parity.checks.targets.sglang.museum import MISS, Exhibit

EXHIBIT = Exhibit(
    id="M10352",
    title="Qwen2-MoE: the shared expert on a second CUDA stream reads its input after the in-place routed "
          "MoE overwrote it (catalog B10)",
    upstream=("sgl-project/sglang#10352", "#10252 (introduced)"),
    mechanism="dual-stream shared expert (<= 1024 MoE tokens) races the in-place fused MoE on the same buffer",
    kind="wrong numbers (intermittent)",
    shipped=("0.5.2",),
    fixed="0.5.3",
    evidence="0.5.2 models/qwen2_moe.py dual-stream path from #10252; 0.5.3 reads the input before the "
             "in-place MoE",
    status=MISS,
    why="a CUDA-stream race: the CPU target has no streams, and 0.5.2 is out of the CPU target's reach (<= 0.5.7: vLLM's RMSNorm)",
)
