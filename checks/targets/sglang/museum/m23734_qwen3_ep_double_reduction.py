from dpep_parity.checks.targets.sglang.museum import PENDING, Exhibit

EXHIBIT = Exhibit(
    id="M23734",
    title="Qwen3-MoE: the EP all-reduce ignores use_reduce_scatter, the MoE output is summed twice (x ep)",
    upstream=("sgl-project/sglang#23729", "#23731", "#23734"),
    mechanism="Qwen3MoeSparseMoeBlock.forward_normal all-reduces over MoE-EP whenever ep > 1, and the "
              "communicator then reduce-scatters the same output (dp_reduce_scatter_tensor) on MAX_LEN steps: "
              "the routed output is ep x the reference (exactly 2x at tp2-dp2-ep2)",
    kind="wrong numbers (fluent text)",
    shipped=("0.5.10", "0.5.10.post1"),
    fixed="0.5.11",
    evidence="0.5.10.post1 models/qwen3_moe.py:328-329 (`if self.ep_size > 1 and not should_allreduce_fusion:` "
             "moe_expert_parallel_all_reduce, no use_reduce_scatter guard), communicator.py:1012 "
             "dp_reduce_scatter_tensor on MAX_LEN; 0.5.11 models/qwen3_moe.py:334-339 "
             "should_skip_post_experts_all_reduce(is_tp_path=False, use_reduce_scatter=...)",
    status=PENDING,
    why="0.5.10 / 0.5.10.post1 are pre-bootstrap releases: no era adapter yet. Expected catch: the moe / "
        "decoder / model units at tp2-dp2-ep2 in a decode step with MAX_LEN padding (|sut|/|truth| = 2.0), "
        "the sweep's decode-only step",
)
