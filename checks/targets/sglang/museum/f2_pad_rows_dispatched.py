from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit

EXHIBIT = Exhibit(
    id="F2",
    title="padded rows routed and dispatched to experts under DP attention (B11 class)",
    upstream=("catalog B11 (sgl-project/sglang#6820); found by this suite, docs/findings.md F2",),
    mechanism="ForwardBatch.moe_num_token_non_padded() returns None whenever attn_dp_size != 1, and the "
              "standard dispatcher masks MAX_LEN pad rows only under SGLANG_OPT_MASK_DP_PAD_MOE (default "
              "off): SUM_LEN alignment rows and MAX_LEN pad rows reach the experts",
    kind="wasted work, polluted expert statistics (numbers right)",
    shipped=("0.5.21", "0.5.22", "0.5.23"),
    fixed=None,
    evidence="model_executor/forward_batch_info.py `def moe_num_token_non_padded` (0.5.21 :1257-1283, "
             "None under attention DP) and its successor in 0.5.23; the suite's dispatch check on each release",
    status=CAUGHT,
    prop="dispatch",
    query="replay: --target sglang --unit decoder --fixture qwen3-moe --layout tp2-dp2-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:4+1,2+1 dp1:3+1 seed=5'",
)
