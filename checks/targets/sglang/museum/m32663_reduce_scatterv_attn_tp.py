from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span


def _explains(res, fixture: str) -> bool:
    """ep == dp < tp, and every failure is the crash of reduce_scatterv's size assertion."""
    lay = res.layout
    return (lay.ep == lay.dp < lay.tp and bool(res.failures())
            and all(c.prop == "no-crash" and "assert len(sizes) == self.world_size" in c.message
                    for c in res.failures()))


EXHIBIT = Exhibit(
    id="M32663",
    title="reduce_scatterv chosen when attention TP > 1: a size per DP rank on the whole TP group",
    upstream=("sgl-project/sglang#32663",),
    mechanism="should_use_dp_reduce_scatterv() requires ep == dp but not tp == attn_dp; with ep == dp < tp "
              "both Qwen models skip their all-reduce and the communicator calls "
              "tp_group.reduce_scatterv(sizes=get_dp_global_num_tokens()): dp sizes for tp ranks",
    kind="crash (AssertionError len(sizes) == world_size, every rank)",
    shipped=span("0.5.11", "0.5.16"),
    fixed="0.5.17",
    clean_before="0.5.10",
    evidence="0.5.16 layers/moe/utils.py:439-451 (no tp_size == attn_dp_size), communicator.py:1334-1339, "
             "distributed/parallel_state.py:1031 assert; 0.5.17 layers/moe/utils.py:465 adds "
             "`get_parallel().tp_size == get_parallel().attn_dp_size`",
    status=CAUGHT,
    prop="no-crash",
    # an extend step at tp4-dp2-ep2 (attention TP 2): the MoE exit takes reduce_scatterv on every release
    # that ships the bug
    query="replay: --target sglang --unit moe --fixture qwen3-moe --layout tp4-dp2-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:0+2 dp1:0+2 seed=1'",
    explains=_explains,
)
