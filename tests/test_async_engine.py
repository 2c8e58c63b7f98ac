"""AsyncLLMEngine: streaming deltas, abort, cancellation, concurrent requests (tiny pair with the
shared LLM_KW engine shapes)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from conftest import LLM_KW
from jspec.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# long enough that an abort sent after the first outputs lands before the end
LONG = SamplingParams(max_tokens=LLM_KW["max_model_len"] - 16, temperature=0, ignore_eos=True)
TIMEOUT = 120.0  # seconds; only guards against hangs


@pytest.fixture(scope="module")
def async_engine(tiny_pair):
    from jspec.async_engine import AsyncLLMEngine

    target, draft = tiny_pair
    engine = AsyncLLMEngine.from_pretrained(target, draft, **LLM_KW)
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_idle(engine):
    """Until the engine thread has processed everything and holds no KV blocks."""
    deadline = time.monotonic() + TIMEOUT
    while engine.num_unfinished or engine.engine.block_manager.num_used_blocks:
        assert time.monotonic() < deadline, "the engine did not become idle"
        await asyncio.sleep(0.01)


def check_stream(outs):
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == final.text
    assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
    # text and tokens only grow
    for before, after in zip(outs, outs[1:]):
        assert after.text.startswith(before.text)
        assert after.token_ids[:len(before.token_ids)] == before.token_ids


def test_stream_deltas_concatenate_to_the_final_text(async_engine, tiny_llm):
    outs = asyncio.run(collect(async_engine, "def fibonacci(n):", GREEDY, "stream-1"))
    assert len(outs) > 1, "expected several streamed outputs"
    check_stream(outs)
    final = outs[-1]
    assert final.finish_reason == "length" and len(final.token_ids) == GREEDY.max_tokens
    (expected,) = tiny_llm.generate("def fibonacci(n):", GREEDY, use_tqdm=False)
    assert final.token_ids == expected.token_ids and final.text == expected.text
    assert final.spec.num_drafted > 0


def test_stream_with_stop_string_never_retracts_text(async_engine, tiny_llm):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (full,) = tiny_llm.generate("def fibonacci(n):", params, use_tqdm=False)
    text = full.text.rstrip("\ufffd")
    stop = next(text[k:k + 4] for k in range(len(text) // 2, len(text) - 4)
                if "\ufffd" not in text[k:k + 4] and text[k:k + 4].strip())
    stopped = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    outs = asyncio.run(collect(async_engine, "def fibonacci(n):", stopped, "stream-stop"))
    assert outs[-1].finish_reason == "stop" and outs[-1].text == text[:text.index(stop)]
    check_stream(outs)


def test_abort_mid_stream_frees_blocks(async_engine):
    async def main():
        outs = []
        async for out in async_engine.generate("Hello, world!", LONG, "abort-1"):
            outs.append(out)
            if len(outs) == 2:
                async_engine.abort("abort-1")
        await wait_idle(async_engine)
        return outs

    aborted_before = async_engine.engine.metrics.num_requests_aborted
    outs = asyncio.run(main())
    final = outs[-1]
    assert final.finished and final.finish_reason == "abort"
    assert len(final.token_ids) < LONG.max_tokens
    assert async_engine.engine.metrics.num_requests_aborted == aborted_before + 1
    assert async_engine.engine.block_manager.num_used_blocks == 0
    async_engine.engine.block_manager.check_invariants()


def test_cancelling_the_consumer_aborts(async_engine):
    async def main():
        first = asyncio.Event()
        seen = []

        async def consume():
            async for out in async_engine.generate("The engine serves", LONG, "cancel-1"):
                seen.append(out)
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(async_engine)
        return seen

    aborted_before = async_engine.engine.metrics.num_requests_aborted
    seen = asyncio.run(main())
    assert seen and not seen[-1].finished
    assert async_engine.engine.metrics.num_requests_aborted == aborted_before + 1
    assert async_engine.engine.block_manager.num_used_blocks == 0


def test_concurrent_requests(async_engine, tiny_llm):
    prompts = ["def fibonacci(n):", "Hello, world! How are you", "x", "The quick brown fox"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (20, 5, 13, 1)]
    expected = tiny_llm.generate(prompts, params, use_tqdm=False)

    async def main():
        tasks = [asyncio.create_task(collect(async_engine, p, sp, f"conc-{i}"))
                 for i, (p, sp) in enumerate(zip(prompts, params))]
        # a bad request among them fails on its own, before it is queued
        with pytest.raises(ValueError, match="prompt is empty"):
            await collect(async_engine, "", GREEDY, "conc-bad")
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for outs, want, i in zip(results, expected, range(len(prompts))):
        check_stream(outs)
        assert outs[-1].request_id == f"conc-{i}"
        assert outs[-1].token_ids == want.token_ids and outs[-1].text == want.text
    assert async_engine.engine.block_manager.num_used_blocks == 0


def test_duplicate_request_id_is_refused(async_engine):
    async def main():
        gen = async_engine.generate("Hello", LONG, "dup-1")
        first = await gen.__anext__()  # dup-1 is now in flight
        with pytest.raises(ValueError, match="request id 'dup-1' is already in use"):
            await collect(async_engine, "Hello", GREEDY, "dup-1")
        await gen.aclose()  # closing the stream early aborts it
        await wait_idle(async_engine)
        return first

    first = asyncio.run(main())
    assert first.request_id == "dup-1"
    assert async_engine.engine.block_manager.num_used_blocks == 0


def test_accessors_and_step_listener(async_engine, tmp_path):
    """The server's view of the engine: limits, tokenizer, validation, stats(), policy state
    and a step listener that sees every step that ran."""
    limits = async_engine.limits
    assert limits == async_engine.engine.limits
    assert async_engine.tokenizer is async_engine.engine.tokenizer
    assert async_engine.validate_request("Hello", GREEDY) == async_engine.tokenizer.encode("Hello")
    with pytest.raises(ValueError, match="max_model_len"):
        async_engine.validate_request([1] * limits.context_limit, GREEDY)
    asyncio.run(wait_idle(async_engine))
    outcomes = []
    listener = outcomes.append
    async_engine.add_step_listener(listener)
    try:
        before = async_engine.stats()
        outs = asyncio.run(collect(async_engine, "def fibonacci(n):", GREEDY, "listener-1"))
    finally:
        async_engine.remove_step_listener(listener)
    after = async_engine.stats()
    assert (after.num_running, after.num_waiting, after.kv_blocks_used) == (0, 0, 0)
    assert after.num_steps - before.num_steps == len(outcomes) > 1
    assert outcomes[0].num_decode == 0 and outcomes[0].num_prefill_tokens > 0  # the prefill
    # the prefill step samples the first token; the decoding steps emit the rest
    emitted = sum(int(o.num_emitted.sum()) for o in outcomes)
    assert emitted == len(outs[-1].token_ids) - 1
    assert (after.metrics["spec_decode_num_draft_tokens"]
            - before.metrics["spec_decode_num_draft_tokens"]
            == sum(int(o.num_verified.sum()) for o in outcomes))
    async_engine.save_policy_state(str(tmp_path / "policy.json"))  # what `jspec serve` saves
    saved = json.loads((tmp_path / "policy.json").read_text())
    assert saved["policy"] == limits.policy and saved["max_gamma"] == limits.max_gamma
