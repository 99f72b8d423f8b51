from dpep_parity.checks.targets.sglang.museum import PENDING, Exhibit

EXHIBIT = Exhibit(
    id="M10414",
    title="MAX_LEN padding of extend batches: attention gets padded inputs with unpadded sequence lengths",
    upstream=("sgl-project/sglang#9806", "#10414", "#8616 (bisected to)"),
    mechanism="get_dp_padding_mode picked MAX_LEN for batches with an extend; inputs padded to the largest "
              "count while extend_seq_lens / seq_lens were not",
    kind="accuracy drop (flashinfer / fa3 / triton backends)",
    shipped=("0.4.9.post4", "0.4.10.post2", "0.5.1", "0.5.2"),
    fixed="0.5.3",
    evidence="0.5.2 layers/dp_attention.py:54-61, forward_batch_info.py:689-767; 0.5.3 dp_attention.py:58-62 "
             "(`if is_extend_in_batch: return SUM_LEN`)",
    status=PENDING,
    why="every release that shipped it is out of the CPU target's reach (<= 0.5.7 replace SGLang's RMSNorm "
        "with vLLM's on CPUs without AMX: releases.py). Expected catch: the padding-rule property (SGLang "
        "choosing MAX_LEN for a step with an extend, where the rule gives SUM_LEN) at any DP layout, extend step "
        "with uneven counts; the torch-native backend keeps the real rows right, so parity alone would not",
)
