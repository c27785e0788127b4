"""Structured outputs in the engine, on the real SmolLM2: JSON schema, json_object, regex, choice, grammar; n > 1 and
seeds; unconstrained rows untouched by constrained ones in the same batch; compiled once per distinct constraint;
max_tokens before the grammar's end; preemption mid-grammar (a KV cache of 40 blocks)."""

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow
BLOCKS = 20  # blocks of 16 tokens: five ~60-token sequences do not fit at once
SMOLLM2_BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 4  # K and V, 30 layers, 3 KV heads, head size 64, 16 tokens, float32
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
CITIES = {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string"},
                                                      "minItems": 3, "maxItems": 3}}, "required": ["cities"]}


@pytest.fixture(scope="module")
def llm():
    # prefix caching off: the preemption test needs its prompts' shared system prompt to cost blocks of each
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_space=BLOCKS * SMOLLM2_BLOCK_BYTES / 2**30,
              enable_prefix_caching=False)
    assert llm.engine.num_blocks == BLOCKS
    yield llm
    llm.shutdown()


def chat(llm, text: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return llm.apply_chat_template(messages + [{"role": "user", "content": text}])


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=7),
                                      dict(temperature=0.8, top_k=20, n=2, seed=3)])
def test_json_schema_output_validates(llm, sampling):
    out = generate(llm, chat(llm, "Give me a person as JSON."),
                   SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(json=PERSON), **sampling))
    assert len(out[0].outputs) == sampling.get("n", 1)
    for completion in out[0].outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_json_object_regex_choice_and_grammar(llm):
    kinds = [{"json_object": True}, {"regex": r"\d{3}-\d{4}"}, {"choice": ["yes", "no", "maybe"]},
             {"grammar": 'root ::= ("red" | "green") " " [a-z]+ "."'}]
    prompts = [chat(llm, "Describe Paris as JSON."), chat(llm, "A phone number:"), chat(llm, "Is Paris in France?"),
               chat(llm, "Name a color and a fruit.")]
    outs = generate(llm, prompts, [SamplingParams(temperature=0, max_tokens=40, structured_outputs=k) for k in kinds])
    texts = [o.outputs[0].text for o in outs]
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"\d{3}-\d{4}", texts[1])
    assert texts[2] in ("yes", "no", "maybe")
    assert re.fullmatch(r"(red|green) [a-z]+\.", texts[3])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_unconstrained_rows_are_untouched_by_constrained_ones(llm):
    free = [chat(llm, "Tell me about Paris"), chat(llm, "Write a haiku about the sea.")]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in generate(llm, free, plain)]
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": PERSON})
    mixed = generate(llm, [free[0], chat(llm, "A person as JSON"), free[1], chat(llm, "Another person")],
                     [plain, constrained, plain, constrained])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    for out in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_each_distinct_constraint_is_compiled_once(llm):
    manager = llm.engine.structured_outputs
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    before = manager.num_compiled
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs={"json": s})
              for s in (schema, json.dumps(schema), dict(schema))]  # the same schema three ways
    generate(llm, [chat(llm, "x as JSON")] * 3, params)
    generate(llm, chat(llm, "x again"), params[0])
    assert manager.num_compiled == before + 1


def test_a_grammar_cut_by_max_tokens_ends_with_length_and_the_text_so_far(llm):
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs={"json": PERSON})
    completion = generate(llm, chat(llm, "A person as JSON"), params)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert completion.text.startswith('{"name": "')


def test_ignore_eos_ends_where_the_grammar_does(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, structured_outputs={"choice": ["yes", "no"]})
    completion = generate(llm, chat(llm, "Is Paris in France?"), params)[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "objekt"}}, 'the JSON schema is invalid: Unsupported type "objekt"'),
    ({"json": "{not json"}, "the JSON schema is not valid JSON"),
    ({"regex": "(ab"}, "the regex is invalid: Regex parsing error"),
    ({"grammar": "root ::= "}, "the grammar is invalid: EBNF parser error"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"json": PERSON, "regex": "a"}, "exactly one of"),
])
def test_bad_constraints_are_refused_naming_the_problem(llm, spec, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        generate(llm, "x", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


def test_preemption_mid_grammar_resumes_the_grammar_exactly(llm):
    """Six prompts of ~58 tokens in 20 blocks of 16: five run at once, and as their decodes run out of blocks the
    newest are preempted after some output tokens, then recomputed. Their output is the same as alone, and valid."""
    system = ("You are a helpful geography assistant. You answer every question about countries and their cities "
              "with one JSON object and nothing else: no explanations, no greetings, and no text around it.")
    prompts = [chat(llm, f"List three cities of {country} as JSON.", system)
               for country in ("France", "Germany", "Italy", "Spain", "Japan", "Brazil")]
    assert all(50 < len(p["prompt_token_ids"]) <= 64 for p in prompts)  # 4 blocks each, 5 fit at once
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": CITIES})
    alone = [generate(llm, p, params)[0].outputs[0].token_ids for p in prompts]
    preemptions = llm.engine.scheduler.num_preemptions
    outs = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > preemptions
    assert [o.outputs[0].token_ids for o in outs] == alone
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), CITIES)
