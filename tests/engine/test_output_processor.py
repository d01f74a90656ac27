"""OutputProcessor: incremental detokenization, stop strings, logprobs, n > 1 fan-out."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rackserve.engine.detokenizer import Detokenizer, special_token_ids
from rackserve.engine.output_processor import OutputProcessor
from rackserve.engine.outputs import EngineCoreOutput, EngineCoreOutputs, Logprob
from rackserve.engine.request_output import RequestOutputKind
from rackserve.model.tokenizer import EOS_TOKEN_ID, write_tokenizer
from rackserve.request import SamplingParams

TEXT = "Hello world, héllo 日本! The quick brown fox."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, 4096)
    return AutoTokenizer.from_pretrained(path)


def _out(request_id: str, *token_ids: int, **kw) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, list(token_ids), **kw)])


def _feed(proc: OutputProcessor, request_id: str, token_ids: list[int], last: dict | None = None):
    """One token per step; `last` adds finish fields to the final output."""
    results = []
    for i, token_id in enumerate(token_ids):
        kw = last if (last and i == len(token_ids) - 1) else {}
        results.append(proc.process_outputs(_out(request_id, token_id, **kw)))
    return results


def test_detokenizer_matches_full_decode(tokenizer) -> None:
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(tokenizer, prompt, True, special_token_ids(tokenizer))
    pieces = [detok.append(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    # multi-byte characters are split over tokens: some tokens complete no text
    assert "" in pieces


def test_skip_special_tokens(tokenizer) -> None:
    ids = [*tokenizer.encode("a b", add_special_tokens=False), 2, 3]
    special = special_token_ids(tokenizer)
    skip = Detokenizer(tokenizer, [0], True, special)
    keep = Detokenizer(tokenizer, [0], False, special)
    assert "".join(skip.append(t) for t in ids) == "a b"
    assert "".join(keep.append(t) for t in ids) == "a b<｜User｜><｜Assistant｜>"


def test_final_only_and_eos_not_in_text(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    sent = proc.add_request("r", [0, 5, 6], SamplingParams(max_tokens=100), prompt="p")
    assert [r.request_id for r in sent] == ["r"]
    results = _feed(proc, "r", [*ids, EOS_TOKEN_ID], {"finish_reason": "stop"})
    assert all(not r.request_outputs for r in results[:-1])
    (final,) = results[-1].request_outputs
    assert final.finished and final.prompt == "p"
    (completion,) = final.outputs
    assert completion.text == TEXT
    assert completion.token_ids == [*ids, EOS_TOKEN_ID]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert not proc.has_unfinished_requests()
    assert results[-1].stats.finished[0].num_generation_tokens == len(ids) + 1


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_and_aborts(tokenizer, include: bool) -> None:
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=100, stop=["brown", "zzz"], include_stop_str_in_output=include
    )
    proc.add_request("r", [0], params)
    results = _feed(proc, "r", ids)
    aborted = [r.abort_ids for r in results if r.abort_ids]
    assert aborted == [["r"]]
    (final,) = [o for r in results for o in r.request_outputs]
    expected = TEXT[: TEXT.index("brown") + (len("brown") if include else 0)]
    assert final.outputs[0].text == expected
    assert final.outputs[0].stop_reason == "brown"
    assert final.outputs[0].finish_reason == "stop"
    # tokens after the stop are dropped; late outputs for the request are ignored
    assert proc.process_outputs(_out("r", ids[0])).request_outputs == []


def test_streaming_deltas_hold_back_stop_prefix(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=["quick brown"])
    proc.add_request("r", [0], params, kind=RequestOutputKind.DELTA)
    streamed = ""
    for result in _feed(proc, "r", ids):
        for output in result.request_outputs:
            streamed += output.outputs[0].text
            # never sends a piece of the stop string
            assert "quick" not in streamed
    assert streamed == TEXT[: TEXT.index("quick brown")]


def test_streaming_deltas_concatenate(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    proc.add_request("r", [0], SamplingParams(max_tokens=len(ids)), kind=RequestOutputKind.DELTA)
    results = _feed(proc, "r", ids, {"finish_reason": "length"})
    deltas = [o.outputs[0] for r in results for o in r.request_outputs]
    assert "".join(d.text for d in deltas) == TEXT
    assert [t for d in deltas for t in d.token_ids] == ids
    assert deltas[-1].finish_reason == "length" and all(not d.finished for d in deltas[:-1])


def test_min_tokens_delays_stop_strings(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode("ab ab ab", add_special_tokens=False)
    proc.add_request("r", [0], SamplingParams(max_tokens=10, min_tokens=len(ids), stop=["ab"]))
    results = _feed(proc, "r", ids)
    # only the last token may stop the request; the text is cut at the earliest new match
    assert sum(bool(r.abort_ids) for r in results) == 1 and results[-1].abort_ids == ["r"]


def test_logprobs(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", [0], SamplingParams(max_tokens=2, logprobs=1))
    lp1 = Logprob([300, 301], [-0.5, -1.0], 1)
    lp2 = Logprob([302, 300], [-2.0, -0.1], 2)
    proc.process_outputs(_out("r", 300, new_logprobs=[lp1]))
    result = proc.process_outputs(
        _out("r", 302, new_logprobs=[lp2], finish_reason="length", num_cached_tokens=0)
    )
    (completion,) = result.request_outputs[0].outputs
    assert completion.cumulative_logprob == pytest.approx(-2.5)
    first, second = completion.logprobs
    assert (first.token_id, first.logprob, first.rank) == (300, -0.5, 1)
    assert first.token == tokenizer.decode([300])
    assert second.top == [(300, tokenizer.decode([300]), -0.1)]


def test_n_fan_out_sends_siblings_after_first_token(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=3, seed=7, max_tokens=2)
    sent = proc.add_request("p", [0, 9, 9], params, kind=RequestOutputKind.DELTA)
    assert [r.request_id for r in sent] == ["0_p"]
    assert sent[0].sampling_params.n == 1 and sent[0].sampling_params.seed == 7
    first = proc.process_outputs(_out("0_p", 300, num_cached_tokens=0))
    assert [r.request_id for r in first.to_send] == ["1_p", "2_p"]
    assert [r.sampling_params.seed for r in first.to_send] == [8, 9]
    outs = proc.process_outputs(
        EngineCoreOutputs(
            outputs=[
                EngineCoreOutput("1_p", [301], num_cached_tokens=2),
                EngineCoreOutput("0_p", [302], finish_reason="length"),
            ]
        )
    )
    (delta,) = outs.request_outputs
    assert [c.index for c in delta.outputs] == [0, 1] and not delta.finished
    proc.process_outputs(_out("1_p", 303, finish_reason="length"))
    last = proc.process_outputs(_out("2_p", 304, 305, finish_reason="length"))
    assert last.request_outputs[0].finished and not proc.has_unfinished_requests()


def test_abort_returns_only_sent_children(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add_request("p", [0], SamplingParams(n=2, max_tokens=4))
    assert proc.abort_request("p") == ["0_p"]
    assert proc.abort_request("p") == []
    assert proc.process_outputs(_out("0_p", 300)).request_outputs == []


def test_queue_time_uses_the_engines_first_scheduled_time(tokenizer) -> None:
    proc = OutputProcessor(tokenizer)
    proc.add_request("q", [5, 6, 7], SamplingParams(max_tokens=2), arrival_time=100.0)
    first = EngineCoreOutput("q", [40], first_scheduled_time=100.25)
    # the step that produced the token started later (a prefill of several steps)
    stats = proc.process_outputs([first], now=101.0, step_start=100.9).stats
    assert stats.queue_times_s == [pytest.approx(0.25)]
    assert stats.time_to_first_tokens_s == [pytest.approx(1.0)]


def test_ids_past_the_tokenizer_decode_as_nothing(tokenizer) -> None:
    """The model's vocabulary may be padded past the tokenizer's (DeepSeek's is; a random
    checkpoint samples those ids): they add no text and later tokens still decode."""
    past = len(tokenizer) + 7
    ids = tokenizer.encode("a b", add_special_tokens=False)
    detok = Detokenizer(tokenizer, [0, past], True, special_token_ids(tokenizer))
    assert detok.append(past) == ""
    assert "".join(detok.append(t) for t in ids) == "a b"


def test_one_failing_request_leaves_the_others(tokenizer, monkeypatch) -> None:
    """A request whose output cannot be processed is reported in ``failed`` and forgotten,
    its engine requests (n = 2: both children) aborted; a request in the same batch goes on."""
    proc = OutputProcessor(tokenizer)
    proc.add_request("bad", [0], SamplingParams(max_tokens=8, n=2, seed=1))
    proc.add_request("good", [0], SamplingParams(max_tokens=8))
    append = Detokenizer.append

    def flaky(self, token_id):
        if token_id == 999:
            raise RuntimeError("boom")
        return append(self, token_id)

    monkeypatch.setattr(Detokenizer, "append", flaky)
    ids = tokenizer.encode("a b c", add_special_tokens=False)
    (bad_0, bad_1) = [c.request_id for c in proc._parents["bad"].children]
    batch = EngineCoreOutputs(
        outputs=[EngineCoreOutput(bad_0, [999]), EngineCoreOutput("good", [ids[0]])]
    )
    processed = proc.process_outputs(batch)
    assert [r for r, _ in processed.failed] == ["bad"] and "boom" in processed.failed[0][1]
    # child 1 was held back until child 0's first token: never sent, so not aborted
    assert processed.abort_ids == [bad_0] and not processed.to_send, bad_1
    assert proc.parent_id(bad_0) is None and proc.get_num_unfinished_requests() == 1
    for t in ids[1:]:
        proc.process_outputs(_out("good", t))
    (final,) = proc.process_outputs(
        _out("good", EOS_TOKEN_ID, finish_reason="stop")
    ).request_outputs
    assert final.finished and final.outputs[0].text == "a b c"
    # later outputs of the failed request (in flight) are ignored
    assert not proc.process_outputs(_out(bad_0, ids[0])).request_outputs
