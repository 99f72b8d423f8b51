from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span
from dpep_parity.fixtures.specs import FIXTURES


def _explains(res, fixture: str) -> bool:
    """GPT-OSS at tp == dp == ep (attention TP 1, where SGLang picks reduce_scatterv), failing only by numbers
    (or what wrong numbers cause downstream: later routing, the greedy token, a later layer's dispatch)."""
    spec, lay = FIXTURES.get(fixture), res.layout
    return (spec is not None and spec.arch == "gpt_oss" and lay.ep == lay.dp == lay.tp > 1
            and bool(res.failures())
            and {c.prop for c in res.failures()} <= {"parity", "greedy", "routing", "dispatch"})


EXHIBIT = Exhibit(
    id="M37187",
    title="GPT-OSS under DP attention: the TP all-reduce, then the DP reduce_scatterv on the same group: the MoE "
          "output is TP x too large (#37187 / #37199)",
    upstream=("sgl-project/sglang#37187", "#37199"),
    mechanism="GptOssSparseMoeBlock.forward_normal all-reduces its output over TP unless the all-reduce is fused "
              "(no should_use_dp_reduce_scatterv guard), and the communicator then reduce-scatters the same "
              "output over the TP group (should_use_dp_reduce_scatterv: DP attention, ep == dp == tp): every rank "
              "adds tp copies of the full sum (exactly 2x at tp2-dp2-ep2)",
    kind="wrong numbers (fluent garbage: GSM8K 0/128 at TP4/DP4/EP4 in the report)",
    shipped=span("0.5.11", "0.5.19"),
    fixed="0.5.20",
    evidence="0.5.11 - 0.5.19 models/gpt_oss.py forward_normal `if self.tp_size > 1 and not "
             "should_allreduce_fusion` / `not get_forward().fuse_mlp_allreduce` then "
             "tensor_model_parallel_all_reduce; layers/moe/utils.py should_use_dp_reduce_scatterv (new in 0.5.11), "
             "communicator.py _scatter_hidden_states reduce_scatterv; 0.5.20 models/gpt_oss.py "
             "should_skip_post_experts_all_reduce(is_tp_path=True)",
    status=CAUGHT,
    prop="parity",
    # a decode step on both DP ranks at tp2-dp2-ep2 (GPT-OSS's EP loads through the F7 workaround):
    # |sut|/|truth| = 2.0000 on 0.5.11, 0.5.15.post1, 0.5.16, 0.5.19; PASS on 0.5.20
    query="replay: --target sglang --unit moe --fixture gpt-oss --layout tp2-dp2-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:4+1 dp1:3+1 seed=5'",
    explains=_explains,
)
