from dpep_parity.checks.targets.sglang.museum import PENDING, Exhibit

EXHIBIT = Exhibit(
    id="M9101",
    title="Qwen2-MoE: the MoE all-reduce nested under `if shared expert` (catalog B08)",
    upstream=("sgl-project/sglang#9101",),
    mechanism="Qwen2MoeSparseMoeBlock reduces the routed partials only inside the shared-expert branch: a "
              "config without a shared expert returns per-rank partial sums at tp > 1",
    kind="wrong numbers",
    shipped=("0.4.6.post5", "0.4.10.post2"),
    fixed="0.5.1",
    evidence="0.4.6.post5 and 0.4.10.post2 models/qwen2_moe.py (all-reduce inside the shared-expert branch); "
             "0.5.1 reduces unconditionally",
    status=PENDING,
    why="0.4.x releases are out of the CPU target's reach (<= 0.5.7 replace SGLang's RMSNorm with vLLM's on "
        "CPUs without AMX: releases.py); expected catch: parity of the moe unit on qwen2-moe-noshared at tp2",
)
