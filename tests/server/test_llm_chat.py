"""LLM.chat (the offline API): the checkpoint's chat template applied straight to token ids, as
transformers' `apply_chat_template` gives them, one BOS; the same replies as generate() on those ids."""
import pytest
from transformers import AutoTokenizer

from hybridkv import LLM, SamplingParams

from .conftest import LLM_KW

CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
         [{"role": "user", "content": "What is a state slot?"}]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoints):
    return AutoTokenizer.from_pretrained(str(checkpoints["chat"]))


def _hf_ids(tok, messages, **kw):
    out = tok.apply_chat_template(messages, add_generation_prompt=kw.pop("add_generation_prompt", True),
                                  tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_ids_equal_apply_chat_template_with_one_bos(oracle, hf_tokenizer):
    for messages in CHATS:
        ids = oracle.chat_prompt_ids(messages)
        assert ids == _hf_ids(hf_tokenizer, messages)
        assert ids.count(hf_tokenizer.bos_token_id) == 1 and ids[0] == hf_tokenizer.bos_token_id
        # the doubled-BOS trap: the template as text, tokenized again, starts with two
        text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert hf_tokenizer(text)["input_ids"][:2] == [hf_tokenizer.bos_token_id] * 2
    no_prompt = oracle.chat_prompt_ids(CHATS[1], add_generation_prompt=False)
    assert no_prompt == _hf_ids(hf_tokenizer, CHATS[1], add_generation_prompt=False)
    assert len(no_prompt) < len(oracle.chat_prompt_ids(CHATS[1]))


def test_chat_one_and_many_equal_generate_on_template_ids(oracle, hf_tokenizer):
    one = oracle.chat(CHATS[0], GREEDY, use_tqdm=False)
    many = oracle.chat(CHATS, GREEDY, use_tqdm=False)
    assert len(one) == 1 and len(many) == 2
    for messages, out in zip(CHATS, many):
        ref = oracle.generate([_hf_ids(hf_tokenizer, messages)], GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and len(ref.outputs[0].token_ids) > 0
    assert one[0].outputs[0].token_ids == many[0].outputs[0].token_ids


def test_chat_template_and_its_kwargs(oracle, hf_tokenizer):
    template = "{% for m in messages %}[{{ m['role'] }}{{ suffix }}]{{ m['content'] }}{% endfor %}"
    ids = oracle.chat_prompt_ids(CHATS[1], chat_template=template, chat_template_kwargs={"suffix": "!"})
    assert ids == _hf_ids(hf_tokenizer, CHATS[1], chat_template=template, suffix="!")
    assert hf_tokenizer.decode(ids) == "[user!]What is a state slot?"


def test_chat_without_a_template_or_tokenizer_is_refused(checkpoints):
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    plain = LLM(str(checkpoints["plain"]), **LLM_KW)
    with pytest.raises(ValueError, match="has no chat template.*chat_template="):
        plain.chat(CHATS[0], greedy, use_tqdm=False)
    bare = LLM(str(checkpoints["bare"]), **LLM_KW)
    with pytest.raises(ValueError, match="has no tokenizer"):
        bare.chat(CHATS[0], greedy, use_tqdm=False)
    for llm in (plain, bare):
        assert not llm.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0


def test_bad_conversations_queue_nothing(oracle):
    with pytest.raises(TypeError, match="a conversation must be a list of"):
        oracle.chat(["hello"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="cannot both be True"):
        oracle.chat(CHATS[0], GREEDY, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="the chat template rejected"):
        oracle.chat(CHATS[1], GREEDY, chat_template="{{ raise_exception('no') }}", use_tqdm=False)
    assert not oracle.has_unfinished_requests()
