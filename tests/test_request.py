"""The typed request at the edge: the OpenAI layer, the web app and CachedRAG build one checked
``AnswerRequest`` (with its ``SamplingParams``) once, and what is below takes it as it is."""

from types import SimpleNamespace

import pytest

from pcache_rag.request import MAX_K, MAX_PROMPT_CHARS, MAX_QUESTION_CHARS, AnswerRequest, RequestError, SamplingParams
from pcache_rag.serve.openai_api import parse_completion, parse_request

SERVICE = SimpleNamespace(max_new_tokens=77, model_id="smol")


def test_a_request_holds_exactly_one_input_and_is_checked_when_built():
    q = AnswerRequest(question="  Where is the gate?  ", k=3, history=[("system", "Be brief.")])
    assert q.question == "Where is the gate?" and not q.plain and q.history == (("system", "Be brief."),)
    assert AnswerRequest(prompt="Context: x\nQ: y").plain
    assert AnswerRequest(messages=[("user", "hi")]).messages == (("user", "hi"),)
    with pytest.raises(RequestError, match="exactly one"):
        AnswerRequest()
    with pytest.raises(RequestError, match="exactly one.*question, prompt"):
        AnswerRequest(question="a", prompt="b")
    with pytest.raises(RequestError, match="empty"):
        AnswerRequest(question="   ")
    with pytest.raises(RequestError, match="must be a string"):
        AnswerRequest(question=5)  # type: ignore[arg-type]
    for k in (0, MAX_K + 1, True, 2.0):
        with pytest.raises(RequestError, match="k must be"):
            AnswerRequest(question="q", k=k)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="belong to a question") as e:
        AnswerRequest(prompt="p", k=2)
    assert e.value.status == 400
    with pytest.raises(RequestError, match="limit") as e:  # a server's limit, set where it builds the request
        AnswerRequest(prompt="x" * (MAX_PROMPT_CHARS + 1), max_chars=MAX_PROMPT_CHARS)
    assert e.value.status == 413
    with pytest.raises(RequestError, match="the limit is 10"):
        AnswerRequest(question="y" * 11, max_chars=10)
    assert len(AnswerRequest(question="why " * 9000).question) > MAX_QUESTION_CHARS  # the library leaves it to the model
    with pytest.raises(TypeError, match="SamplingParams"):
        AnswerRequest(question="q", sampling={"max_new_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(AttributeError):  # frozen: nothing below changes it
        q.k = 5  # type: ignore[misc]


def test_sampling_params_are_checked_once_and_passed_on_as_they_are():
    sp = SamplingParams(max_new_tokens=5, stop=("", "\n"))
    assert sp.stop == ("\n",)
    assert SamplingParams.of(sp) is sp  # no keywords: the same record, not checked again
    assert SamplingParams.of(sp, seed=3) == SamplingParams(max_new_tokens=5, stop=("\n",), seed=3)
    with pytest.raises(TypeError, match="unexpected arguments: top_k"):
        SamplingParams.of(sp, top_k=3)
    with pytest.raises(ValueError, match="at least 1"):
        SamplingParams(max_new_tokens=0)
    greedy = SamplingParams.from_frameworks(8, temperature=0, top_p=0.5, stop=["x"])
    assert (greedy.do_sample, greedy.temperature, greedy.stop) == (False, 1.0, ("x",))
    hot = SamplingParams.from_frameworks(8, temperature=0.7)
    assert hot.do_sample and hot.temperature == 0.7


def test_the_openai_edge_builds_the_request_once():
    body = {"model": "pcache-rag", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 4, "stop": "\n", "k": 2,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Old?"},
                         {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And the gate?"}]}
    req, notes, read_calls = parse_request(body, SERVICE, tenant="t1")
    assert isinstance(req, AnswerRequest) and not req.plain and not read_calls and notes == []
    assert req.question == "And the gate?" and req.k == 2 and req.tenant == "t1"
    assert req.history == (("system", "Be brief."), ("user", "Old?"), ("assistant", "Yes."))
    assert req.sampling == SamplingParams(max_new_tokens=9, do_sample=True, temperature=0.5, top_p=0.9, seed=4,
                                          stop=("\n",))
    # no limit in the body: the service's default answer length
    plain, _, _ = parse_request({"model": "pcache-rag-plain", "messages": [{"role": "user", "content": "hi"}]}, SERVICE)
    assert plain.plain and plain.messages == (("user", "hi"),) and plain.sampling.max_new_tokens == 77
    with pytest.raises(RequestError, match="k is for the RAG model") as e:
        parse_request({"model": "pcache-rag-plain", "k": 2, "messages": [{"role": "user", "content": "hi"}]}, SERVICE)
    assert e.value.param == "k"
    with pytest.raises(RequestError, match="limit") as e:  # the server's own limit on a question
        parse_request({"model": "pcache-rag", "messages": [{"role": "user", "content": "x" * 20000}]}, SERVICE)
    assert e.value.status == 413
    text, _ = parse_completion({"model": "pcache-rag", "prompt": "What is it?", "max_tokens": 3}, SERVICE)
    assert text.question == "What is it?" and text.sampling.max_new_tokens == 3
    raw, _ = parse_completion({"model": "pcache-rag-plain", "prompt": "Q: x\nA:"}, SERVICE)
    assert raw.prompt == "Q: x\nA:" and raw.plain


def test_the_service_still_takes_the_old_loose_arguments_for_one_release_with_a_warning():
    from pcache_rag.serve.service import legacy_request

    service = SimpleNamespace(sampling=lambda: SamplingParams(max_new_tokens=77))
    with pytest.warns(DeprecationWarning, match="build an AnswerRequest"):
        req = legacy_request(service, "submit", " Where? ", 2, history=[("user", "Hi")], max_new_tokens=5, seed=1)
    assert (req.question, req.k, req.history, req.sampling) == ("Where?", 2, (("user", "Hi"),),
                                                                SamplingParams(max_new_tokens=5, seed=1))
    with pytest.warns(DeprecationWarning, match="submit_plain"):
        plain = legacy_request(service, "submit_plain", messages=[("user", "hi")])
    assert plain.plain and plain.sampling.max_new_tokens == 77
    with pytest.warns(DeprecationWarning), pytest.raises(RequestError, match="limit is 16000"):
        legacy_request(service, "submit", "x" * 16001)
