"""Schema-driven fuzzing of the live API (hypothesis, from our own /openapi.json).

Three kinds of body, mixed: whole bodies generated from a route's request schema, a valid
request with a few fields replaced by schema-generated values (so many requests run), and
arbitrary JSON. Every answer must be JSON with the error envelope or a valid completion
(or a well-formed SSE stream), never a 5xx; afterwards the server is healthy and a greedy
reference request gives the same text as before. The server runs with small per-request
limits so generated requests stay cheap on CPU.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliability_harness import MODEL_NAME, Server, greedy_text, run_server

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
BASES = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 4},
    "/v1/chat/completions": {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
    },
    "/tokenize": {"model": MODEL_NAME, "prompt": "hello"},
    "/detokenize": {"model": MODEL_NAME, "tokens": [7, 8, 9]},
}  # fmt: skip
LIMITS = ("--max-tokens-per-request", "8", "--max-sequences-per-request", "8")
ENVELOPE_KEYS = {"message", "type", "param", "code"}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values for the JSON-schema subset pydantic emits (type, anyOf, enum, const, object
    properties, array items, numeric bounds). Bounds are honoured most of the time and
    overstepped by one now and then, so edges on both sides get tried."""
    if "anyOf" in schema:
        return st.one_of([from_schema(option) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties")
        if properties is None:  # free-form: dict[str, Any]
            return st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=4)
        required = set(schema.get("required", ()))
        strategies = {key: from_schema(prop) for key, prop in properties.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in strategies.items() if k in required},
            optional={k: v for k, v in strategies.items() if k not in required},
        )
    if kind == "array":
        items = from_schema(schema.get("items", {}))
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=6)
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        edges = [v + d for v in (low, high) if v is not None for d in (-1, 0, 1)]
        edges += [0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1]
        return st.integers(low, high) | st.sampled_from(edges) | st.integers()
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
            [schema.get("minimum", 0.0), schema.get("maximum", 1.0), -0.0, 1e308]
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(max_size=40)
    if kind == "null":
        return st.none()
    return JSON_VALUES


def inline_refs(schema: object, components: dict) -> object:
    """``schema`` with every ``$ref`` to ``#/components/schemas/X`` replaced by X (our
    request schemas are not recursive)."""
    if isinstance(schema, list):
        return [inline_refs(item, components) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        return inline_refs(components[schema["$ref"].rsplit("/", 1)[1]], components)
    return {key: inline_refs(value, components) for key, value in schema.items()}


def body_strategies(openapi: dict) -> st.SearchStrategy[tuple[str, object]]:
    """(route, body) pairs of the three kinds described in the module docstring."""
    components = openapi["components"]["schemas"]
    kinds = []
    for route in ROUTES:
        ref = openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        schema = inline_refs(ref["schema"], components)
        kinds.append(st.tuples(st.just(route), from_schema(schema)))
        fields = {key: from_schema(prop) for key, prop in schema["properties"].items()}
        patch = st.fixed_dictionaries({}, optional=fields)
        kinds.append(st.tuples(st.just(route), patch.map(lambda p, r=route: {**BASES[r], **p})))
        kinds.append(st.tuples(st.just(route), JSON_VALUES))
    return st.one_of(kinds)


def check_response(response: httpx.Response, route: str) -> None:
    """A valid completion / token list, or the error envelope; never a 5xx."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            payload = json.loads(event)
            assert "choices" in payload or set(payload.get("error", {})) == ENVELOPE_KEYS
        return
    payload = response.json()
    if response.status_code != 200:
        assert set(payload["error"]) == ENVELOPE_KEYS, payload
        assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
        return
    if route in ("/v1/completions", "/v1/chat/completions"):
        assert payload["choices"] and payload["usage"]["total_tokens"] >= 1
    elif route == "/tokenize":
        assert payload["count"] == len(payload["tokens"])
    else:
        assert isinstance(payload["prompt"], str)


def fuzz(server: Server, num_cases: int) -> Counter:
    openapi = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    statuses: Counter = Counter()
    http = httpx.Client(base_url=server.base_url, timeout=120)

    @settings(
        max_examples=num_cases,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body_strategies(openapi))
    def one_case(case: tuple[str, object]) -> None:
        route, body = case
        response = http.post(
            route, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        statuses[(route, response.status_code)] += 1
        check_response(response, route)

    with http:
        one_case()
    return statuses


def check_fuzz(tiny_model: Path, tmp_path: Path, num_cases: int) -> Counter:
    with run_server(tiny_model, tmp_path, *LIMITS) as server:
        reference = greedy_text(server)
        statuses = fuzz(server, num_cases)
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        assert greedy_text(server) == reference
        assert server.process.poll() is None
        print(sorted(statuses.items()))
        return statuses


def test_fuzz_short(tiny_model: Path, tmp_path: Path) -> None:
    statuses = check_fuzz(tiny_model, tmp_path, int(os.environ.get("RACKSERVE_FUZZ_CASES", 300)))
    assert sum(n for (_, status), n in statuses.items() if status == 200) > 0


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 15 min on 2 busy cores
def test_fuzz_10000(tiny_model: Path, tmp_path: Path) -> None:
    check_fuzz(tiny_model, tmp_path, 10_000)
