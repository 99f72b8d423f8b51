from dpep_parity.checks.targets.sglang.museum import PENDING, Exhibit

EXHIBIT = Exhibit(
    id="M32663",
    title="reduce_scatterv chosen when attention TP > 1: a size per DP rank on the whole TP group",
    upstream=("sgl-project/sglang#32663",),
    mechanism="should_use_dp_reduce_scatterv() requires ep == dp but not tp == attn_dp; with ep == dp < tp "
              "both Qwen models skip their all-reduce and the communicator calls "
              "tp_group.reduce_scatterv(sizes=get_dp_global_num_tokens()): dp sizes for tp ranks",
    kind="crash (AssertionError len(sizes) == world_size, every rank)",
    shipped=("0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15",
             "0.5.15.post1", "0.5.16"),
    fixed="0.5.17",
    evidence="0.5.16 layers/moe/utils.py:439-451 (no tp_size == attn_dp_size), communicator.py:1334-1339, "
             "distributed/parallel_state.py:1031 assert; 0.5.17 layers/moe/utils.py:465 adds "
             "`get_parallel().tp_size == get_parallel().attn_dp_size`",
    status=PENDING,
    why="0.5.11-0.5.16 have no era adapter yet (pre-bootstrap 0.5.11-0.5.15; 0.5.16 communicator). Expected "
        "catch: no-crash at tp4-dp2-ep2, any unit that reaches the MoE, any step",
)
