from dpep_parity.checks.targets.sglang.museum import MISS, Exhibit

EXHIBIT = Exhibit(
    id="M12115",
    title="the logits stage's DP gather sized by a wrong num_tokens_for_logprob",
    upstream=("sgl-project/sglang#12052", "#12115"),
    mechanism="the scheduler counted every extend token for logprobs even with return_logprob=False, while "
              "the logits processor keeps one row per request: an over-sized gather buffer and an "
              "out-of-bounds read",
    kind="crash (illegal memory access on GPU)",
    shipped=("0.4.6.post5", "0.4.10.post2", "0.5.2", "0.5.4"),
    fixed="0.5.4.post1",
    evidence="0.5.2 managers/scheduler.py:1936-1945, 0.5.4 :2074-2084; 0.5.4.post1 :2076-2087 "
             "(`if local_batch.return_logprob`)",
    status=MISS,
    why="memory safety only: real-row logits stay right (the copy is capped at the source size) and the "
        "trigger is a retracted request re-prefilled by the scheduler, which the target does not run; "
        "the releases are out of the CPU target's reach (<= 0.5.7: vLLM's RMSNorm)",
)
