from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit, span

EXHIBIT = Exhibit(
    id="F1",
    title="dense layers of Qwen3-MoE / Qwen2-MoE built as MoE blocks, their weights dropped (B09 class)",
    upstream=("latent since sgl-project/sglang#6581 (catalog B09); found by this suite, docs/findings.md F1",),
    mechanism="Qwen3MoeDecoderLayer / Qwen2MoeDecoderLayer hard-code is_layer_sparse = True, ignoring "
              "mlp_only_layers and decoder_sparse_step; load_weights skips the dense MLP's tensors silently, "
              "the block runs on unloaded parameters",
    kind="wrong numbers (silent)",
    shipped=span("0.5.8", "0.5.23"),
    fixed=None,
    evidence="models/qwen3_moe.py `is_layer_sparse = True` in every release 0.5.8 .. 0.5.23 (grep of each "
             "wheel); no release has transformers' rule",
    status=CAUGHT,
    prop="parity",
    query="replay: --target sglang --unit decoder --fixture qwen3-moe-dense --layout tp1-dp1-ep1 "
          "--dtype float32 --layer 0 --batch 'dp0:0+3 seed=1'",
)
