from dpep_parity.checks.targets.sglang.museum import MISS, Exhibit

EXHIBIT = Exhibit(
    id="M39899",
    title="an idle DP rank padded to a 0-length dummy EXTEND: logits index cumsum([0]) - 1 = -1",
    upstream=("sgl-project/sglang#39899", "#40012 (cherry-pick)", "#37191", "#35766"),
    mechanism="the breakable prefill graph forces MAX_LEN, the idle rank is rewritten to EXTEND; when "
              "require_mlp_tp_gather() is false the scheduler keeps only the local count (0), so the dummy "
              "request has length 0 and LogitsProcessor._get_pruned_states indexes hidden_states[-1]",
    kind="crash (IndexError on the idle rank)",
    shipped=("0.5.17", "0.5.18", "0.5.19"),
    fixed="0.5.20",
    evidence="0.5.16 forward_batch_info.py:1212-1219 (MAX_LEN for the prefill graph), :1277-1279 (idle -> "
             "EXTEND), dp_attn.py:199-201, logits_processor.py:517; 0.5.16 server_args.py:3799 still disables "
             "the graph under DP attention, 0.5.17 does not; fixed in 0.5.20 logits_processor.py:311-316",
    status=MISS,
    why="CUDA graphs: the dummy 0-length EXTEND is made only on the breakable prefill-graph path, and the "
        "local-count rule needs an all-to-all backend (DeepEP) with moe_dense_tp_size=1; the target runs "
        "eager on CPU with the standard dispatcher, where every rank's count is gathered (0.5.17 - 0.5.19 run "
        "under the target: the idle-rank examples of the suite pass there)",
)
