from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span

EXHIBIT = Exhibit(
    id="M36861",
    title="Qwen MoE normal path ignores the expert placement: tokens computed with the experts in the "
          "router's slot numbers (--init-expert-location / EPLB)",
    upstream=("sgl-project/sglang#36861 (diagnosis and patch for Qwen3, Qwen3-30B-A3B EP4 collapsing to a "
              "repeated token; open in the tracker)", "#38609 (0.5.23's init_new without metadata)",
              "#39580 (named by an earlier note, not found in the tracker)"),
    mechanism="FusedMoE.weight_loader puts logical expert e in the physical slots the placement names, but "
              "Qwen3MoeSparseMoeBlock.forward_normal / Qwen2MoeSparseMoeBlock call self.topk(hidden, "
              "router_logits) without ExpertLocationDispatchInfo, and TopK maps logical ids to physical ones "
              "only when given it (and on CPU not at all: _post_process_topk_ids has CUDA / HIP branches "
              "only): a token routed to e is computed with the weights of physical slot e",
    kind="wrong numbers (silent; generation collapse on a real model)",
    shipped=span("0.5.8", "0.5.22"),
    fixed="0.5.23",
    evidence="0.5.22 models/qwen3_moe.py:344 and qwen2_moe.py:719 `self.topk(hidden_states, router_logits)`, "
             "layers/moe/topk.py:2307-2386 (no CPU branch), fused_moe_triton/layer.py:1037-1080 "
             "(logical_to_all_physical weight load); the same calls in 0.5.8 .. 0.5.21; 0.5.23 "
             "layers/moe/topk.py:656-671 (resolve_routing_inputs: ExpertLocationDispatchInfo.init_new when "
             "the caller passes none) and :2697-2709 (the CPU branch: topk_ids_logical_to_physical)",
    status=CAUGHT,
    prop="parity",
    # SGLang serving with every expert in another slot (checks.targets.sglang:ROTATED_EXPERTS): the router's
    # logical choice must still pick the same weights
    query="replay: --target checks.targets.sglang:ROTATED_EXPERTS --unit decoder --fixture qwen3-moe "
          "--layout tp2-dp1-ep2 --dtype float32 --layer 1 --batch 'dp0:0+3,2+2 seed=5'",
)
