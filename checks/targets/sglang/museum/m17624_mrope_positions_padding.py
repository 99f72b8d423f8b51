from dpep_parity.checks.targets.sglang.museum import CAUGHT, Exhibit

EXHIBIT = Exhibit(
    id="M17624",
    title="M-RoPE positions padded along the request axis under DP attention (Qwen3-VL-MoE's text stack)",
    upstream=("sgl-project/sglang#17624 ('Fix dp size > 1 for qwen3 vl model': 'fixing the mrope_positions "
              "padding issue', merged between the 0.5.8.post1 and 0.5.9 wheels)",),
    mechanism="ForwardBatch._pad_inputs_to_size pads the [3, tokens] mrope_positions like a per-request "
              "tensor, along dim 0 to the padded batch size: a DP rank with 1 or 2 requests asks for a tensor "
              "of negative size; with more, the token axis is never padded to the DP-padded token count "
              "(positions shorter than q/k: out-of-bounds reads on GPU)",
    kind="crash (RuntimeError: negative dimension) / wrong positions",
    shipped=("0.5.8", "0.5.8.post1"),
    fixed="0.5.9",
    evidence="0.5.8 model_executor/forward_batch_info.py:862-863 (`self.mrope_positions = "
             "self._pad_tensor_to_size(self.mrope_positions, bs)`; :721-726 pads dim 0); 0.5.9 :865-874 "
             "(zeros appended along dim 1 up to num_tokens); older releases ship it too (outside the reach "
             "of the CPU target, docs/sglang.md)",
    status=CAUGHT,
    prop="no-crash",
    # qwen3-moe-mrope: Qwen3-MoE layers under multimodal RoPE sections, text-only requests; one request per
    # DP rank in an extend step
    query="replay: --target sglang --unit moe --fixture qwen3-moe-mrope --layout tp2-dp2-ep2 --dtype float32 "
          "--layer 1 --batch 'dp0:0+3 dp1:0+2 seed=1'",
)
