"""The registered lm-eval LM over a ForwardEngine (HFForwardEngine on the tiny model)."""
from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from dpep_parity.evals.engines.base import ForwardEngine
from dpep_parity.evals.engines.hf_local import HFForwardEngine
from dpep_parity.evals.lm_adapter import ForwardEngineLM


@pytest.fixture(scope="module")
def lm(tiny_model):
    engine = HFForwardEngine(str(tiny_model), "float32")
    assert isinstance(engine, ForwardEngine)
    return ForwardEngineLM(engine=engine, tokenizer=str(tiny_model), max_gen_toks=6, batch_size=3)


def _inst(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i, metadata=("t", i, 1))


def test_loglikelihood_matches_transformers(lm):
    ctx, conts = "Question: what is 2+2?\nAnswer:", [" A", " B", " four apples"]
    got = lm.loglikelihood([_inst("loglikelihood", (ctx, c), i) for i, c in enumerate(conts)])
    model = lm.engine.model
    for (ll, greedy), c in zip(got, conts):
        ids = lm.tokenizer.encode(ctx + c)
        n_ctx = len(lm.tokenizer.encode(ctx))
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        want = sum(float(logp[p - 1, ids[p]]) for p in range(n_ctx, len(ids)))
        assert ll == pytest.approx(want, abs=1e-4)
        assert isinstance(greedy, bool)


def test_mmlu_answers_share_one_forward(lm):
    """" A".." D" (one or two tokens each) cost one forward: shorter inputs are prefixes."""
    reqs = [_inst("loglikelihood", ("Q: x\nAnswer:", f" {x}"), i) for i, x in enumerate("ABCD")]
    before = lm.forward_calls
    shared = lm.loglikelihood(reqs)
    assert lm.forward_calls - before == 1
    alone = [lm.loglikelihood([r])[0] for r in reqs]
    assert [g for _, g in shared] == [g for _, g in alone]
    assert [ll for ll, _ in shared] == pytest.approx([ll for ll, _ in alone], abs=1e-5)


def test_greedy_generation_matches_transformers_generate(lm):
    ctx = "Question: Natalia sold clips to 48 of her friends.\nAnswer:"
    (text,) = lm.generate_until([_inst("generate_until", (ctx, {"until": ["\n\n"], "max_gen_toks": 6}))])
    ids = torch.tensor([lm.tokenizer.encode(ctx)])
    with torch.no_grad():
        out = lm.engine.model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False,
                                       pad_token_id=lm.tokenizer.eos_token_id)
    ref = lm.tokenizer.decode(out[0, ids.shape[1]:])
    assert ref.startswith(text) and text == ref.split("\n\n")[0].split(lm.tokenizer.eos_token)[0]


def test_stop_sequences_cut_the_output(lm):
    ctx = "Question: Natalia sold clips to 48 of her friends.\nAnswer:"
    (full,) = lm.generate_until([_inst("generate_until", (ctx, {"until": ["@@"], "max_gen_toks": 6}))])
    stop = full[len(full) // 2:][:2] or full
    (cut,) = lm.generate_until([_inst("generate_until", (ctx, {"until": [stop], "max_gen_toks": 6}))])
    assert stop not in cut and full.startswith(cut)
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([_inst("generate_until", (ctx, {"do_sample": True}))])


def test_registered_with_lm_eval_and_simple_evaluate(lm, taskset):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    assert get_model("dpep-forward") is ForwardEngineLM
    from lm_eval.tasks import TaskManager

    from dpep_parity.evals.tasks import HERE

    # our YAML directory is a valid lm-eval include path (indexing only it is fast)
    tm = TaskManager(include_defaults=False, include_path=str(HERE))
    assert "dpep_gsm8k" in tm.all_tasks
    task = taskset.lm_task("gsm8k")
    res = simple_evaluate(model=lm, tasks=[task], limit=1, log_samples=True, bootstrap_iters=0,
                          task_manager=tm)
    (sample,) = res["samples"]["dpep_gsm8k"][:1]
    assert sample["doc"]["question"].startswith("Janet’s ducks")
    assert "exact_match,flexible-extract" in res["results"]["dpep_gsm8k"]


def test_encoding_memo_is_exact_and_keyed_by_tokenizer(lm, tiny_model):
    """The shared encoding memo returns the tokenizer's own ids, a fresh list each call, and a second
    instance over the same folder reuses it; a different tokenizer object never gets another one's ids."""
    from dpep_parity.evals import lm_adapter

    text = "Question: which layer reduces twice?\nAnswer:"
    first = lm.tok_encode(text)
    assert first == lm.tokenizer.encode(text, add_special_tokens=False)
    first.append(-1)
    assert lm.tok_encode(text) == lm.tokenizer.encode(text, add_special_tokens=False)
    assert lm.tok_encode(text, add_special_tokens=True) == lm.tokenizer.encode(text, add_special_tokens=True)
    again = ForwardEngineLM(engine=lm.engine, tokenizer=str(tiny_model))
    assert again._tokenizer_key == lm._tokenizer_key
    assert (lm._tokenizer_key, False, text) in lm_adapter._ENCODED

    class Shifted:
        """A different tokenizer (every id + 1): it must not be served the memo's ids of the same text."""
        eos_token_id = bos_token_id = 0
        name_or_path = lm.tokenizer.name_or_path

        def encode(self, s, add_special_tokens=False):
            return [i + 1 for i in lm.tokenizer.encode(s, add_special_tokens=add_special_tokens)]

    other = ForwardEngineLM(engine=lm.engine, tokenizer=Shifted())
    assert other.tok_encode(text) == [i + 1 for i in lm.tokenizer.encode(text, add_special_tokens=False)]


def test_compiled_templates_render_as_lm_eval_and_compile_once():
    """lm-eval's template rendering after the sign-off's compiled-template swap: the same text as a fresh
    environment with lm-eval's settings, one compile per template source, filters kept."""
    import jinja2
    from lm_eval import utils

    from dpep_parity.evals.tasks.base import compiled_templates

    template = "{{question.strip()}}\n{{ choices[1] | regex_replace('b', 'B') }}\nAnswer:"
    doc = {"question": "  Which rank hangs? ", "choices": ["a", "bb"]}
    fresh = jinja2.Environment(loader=jinja2.BaseLoader, undefined=jinja2.StrictUndefined,
                               keep_trailing_newline=True)
    fresh.filters["regex_replace"] = utils.regex_replace
    compiled_templates()
    compiled_templates()  # idempotent
    assert utils.apply_template(template, doc) == fresh.from_string(template).render(**doc)
    assert utils.env.from_string(template) is utils.env.from_string(template)
    with pytest.raises(jinja2.UndefinedError):  # StrictUndefined kept: a missing field is an error
        utils.apply_template("{{ missing }}", doc)
