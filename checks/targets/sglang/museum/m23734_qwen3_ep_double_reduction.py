from dpep_parity.checks.core.batches import MAX_LEN, padding_mode
from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit
from dpep_parity.fixtures.specs import FIXTURES


def _explains(res, fixture: str) -> bool:
    """A Qwen3-MoE layout with EP and DP attention, in a step the engine pads to MAX_LEN (where the layer
    reduce-scatters), failing only by numbers (or what wrong numbers cause downstream: the router's choice
    at later layers, the greedy token, a later layer's dispatch)."""
    spec, lay = FIXTURES.get(fixture), res.layout
    return (spec is not None and spec.arch == "qwen3_moe" and lay.ep > 1 and lay.dp > 1
            and padding_mode(res.batch) == MAX_LEN and bool(res.failures())
            and {c.prop for c in res.failures()} <= {"parity", "greedy", "routing", "dispatch"})


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
    clean_before="0.5.9",
    evidence="0.5.9 models/qwen3_moe.py:305-312 (one tensor_model_parallel_all_reduce, skipped under "
             "use_reduce_scatter); 0.5.10 / 0.5.10.post1 :328-329 (`if self.ep_size > 1 and not "
             "should_allreduce_fusion:` moe_expert_parallel_all_reduce, no use_reduce_scatter guard), "
             "communicator.py dp_reduce_scatter_tensor on MAX_LEN; 0.5.11 :334-339 "
             "should_skip_post_experts_all_reduce(is_tp_path=False, use_reduce_scatter=...)",
    status=CAUGHT,
    prop="parity",
    # a decode step on both DP ranks: MAX_LEN padding, the layer reduce-scatters; |sut|/|truth| = 2.0000
    query="replay: --target sglang --unit moe --fixture qwen3-moe --layout tp2-dp2-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:4+1 dp1:3+1 seed=5'",
    explains=_explains,
)
