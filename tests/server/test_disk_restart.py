"""Issue 26's restart goal through the OpenAI API: a server whose engine has a disk tier
(`disk_cache_dir`, the CLI's `--disk-cache DIR`) answers a prompt, is stopped, and a NEW server
on the same directory answers the repeated prompt with `usage.prompt_tokens_details.cached_tokens`
> 0 and the same text and tokens as the first (greedy), the official `openai` client asking."""
import pytest

from .conftest import LLM_KW, ServerThread

MODEL = "tiny-disk"


def serve(path, cache_dir):
    from hybridkv import LLM

    return ServerThread(LLM(str(path), disk_cache_dir=str(cache_dir), **LLM_KW), MODEL)


def complete(server, prompt):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, logprobs=1,
                                     extra_body={"ignore_eos": True})


def stop(server):
    server.stop()
    server.llm.close()  # what `hybridkv serve` does at exit: the disk tier's queued writes finish


@pytest.mark.slow  # two servers in turn
def test_a_restarted_server_answers_from_disk(checkpoints, tmp_path):
    prompt = [5 + (i * 7) % 100 for i in range(70)]  # 4 full blocks of 16 before the last token
    first = serve(checkpoints["plain"], tmp_path)
    try:
        a = complete(first, prompt)
    finally:
        stop(first)
    assert a.usage.prompt_tokens == 70 and a.usage.prompt_tokens_details.cached_tokens == 0
    second = serve(checkpoints["plain"], tmp_path)
    try:
        b = complete(second, prompt)
        disk = second.stats()["checkpoint_tiers"]["disk"]
    finally:
        stop(second)
    assert b.usage.prompt_tokens_details.cached_tokens == 64, b.usage
    assert b.choices[0].text == a.choices[0].text
    assert b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens
    assert disk["hits"] == 1 and disk["refused_corrupt"] == 0, disk
