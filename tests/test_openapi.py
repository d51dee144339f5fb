"""The server's OpenAPI document tells the truth: schemathesis generates requests from it (valid
and invalid) against the app in-process and checks every answer against the document: declared
status codes, the error body's schema, content types, no 5xx. Plus what a fuzzer does not reach:
405 with `Allow`, and a missing body that names what is missing."""

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra: pip install -e '.[dev]'")

from conftest import tiny_model  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.tokenizer import get_tokenizer  # noqa: E402

NAME = "tiny-byte"


def make_app():
    """A tiny byte-level model behind the server, small limits so the fuzzer meets them."""
    model = tiny_model(0, vocab_size=257, block_size=32)
    return create_app(model, get_tokenizer("byte"), name=NAME, max_batch=4, max_queue=4, max_body_bytes=4096)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for tiny models


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app()) as client:  # runs the lifespan: the scheduler's thread
        yield client


@pytest.fixture(scope="module")
def api_schema():
    """The document of an app of its own: schemathesis runs that app's lifespan itself (once per process)."""
    return schemathesis.openapi.from_asgi("/openapi.json", make_app())


def served_model(case):
    """The case naming the served model, so that it reaches generation rather than ending in 404."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = NAME
    return case


# (method, path, whether it takes input that can be invalid: a body or a path parameter)
OPERATIONS = [
    ("POST", "/v1/completions", True),
    ("POST", "/v1/chat/completions", True),
    ("GET", "/v1/models", False),
    ("GET", "/v1/models/{model_id}", False),  # any string is a valid model id (404 if not served)
    ("GET", "/health", False),
    ("GET", "/api/info", False),
    ("POST", "/api/next", True),
    ("POST", "/api/tokens", True),
    ("POST", "/api/attention", True),
]
CASES = [(m, p, "positive") for m, p, _ in OPERATIONS] + [(m, p, "negative") for m, p, inputs in OPERATIONS if inputs]


@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_every_answer_matches_the_openapi_document(api_schema, method, path, mode):
    """Requests generated from the document (valid ones, and invalid ones in the negative mode),
    each answer checked by schemathesis' default checks: no 5xx, a declared status code, the error
    body and content type as documented, invalid data rejected. Not positive_data_acceptance: a
    request valid by the schema can still exceed this model's context or name another model
    (400 and 404, both documented). Seeded (derandomize): the same cases on every run. An invalid
    body over the body limit is rejected too, with 413."""
    from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

    def rejected(ctx, response, case):
        """negative_data_rejection, with 413 among the rejections: an invalid body can also be
        one over this app's small limit (a deeply nested prompt), and 413 is what it gets."""
        return None if response.status_code == 413 else negative_data_rejection(ctx, response, case)

    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    if mode == "positive":  # half name the served model (to reach generation), half any model (404)
        strategy = st.tuples(strategy, st.booleans()).map(lambda pair: served_model(pair[0]) if pair[1] else pair[0])

    @given(case=strategy)
    @settings(max_examples=12, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        case.call_and_validate(
            excluded_checks=[positive_data_acceptance, negative_data_rejection], additional_checks=[rejected]
        )

    check()


def test_every_operation_declares_its_errors_with_the_error_body(client):
    document = client.get("/openapi.json").json()
    assert "ErrorBody" in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert "422" not in codes, f"{method} {path} documents 422, which this server never sends"
            assert {"413", "500"} <= codes, f"{method} {path}"
            if "requestBody" in operation:
                assert "400" in codes, f"{method} {path}"
            for code in codes - {"200"}:
                ref = operation["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorBody"
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"400", "404", "429"} <= set(document["paths"][path]["post"]["responses"]), path


@pytest.mark.parametrize(
    "extra",
    [
        dict(repetition_penalty=1e-245),  # overflowed float32 to inf, NaN after softmax: fixed in sampling.py
        dict(temperature=1e-300),
        dict(temperature=1e-30),
        dict(repetition_penalty=1e300),
    ],
    ids=["penalty=1e-245", "temperature=1e-300", "temperature=1e-30", "penalty=1e300"],
)
def test_tiny_temperature_or_penalty_is_not_a_server_error(client, extra):
    body = dict(model=NAME, prompt="ab", max_tokens=3, **extra)
    response = client.post("/v1/completions", json=body)
    assert response.status_code in (200, 400), response.text


@pytest.mark.parametrize("field, value", [("n", True), ("max_tokens", True), ("echo", 1), ("prompt", [True])])
def test_completions_take_the_json_types_they_document(client, field, value):
    body = {"model": NAME, "prompt": "ab", "max_tokens": 2, field: value}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


@pytest.mark.parametrize("field, value", [("layer", True), ("head", "1"), ("prompt", 3)])
def test_explorer_bodies_take_the_json_types_they_document(client, field, value):
    response = client.post("/api/attention", json={"prompt": "ab", field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_405_says_which_methods_are_allowed(client):
    document = client.get("/openapi.json").json()
    for path, operations in document["paths"].items():
        allowed = {m.upper() for m in operations}
        url = path.replace("{model_id}", NAME)
        for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - allowed:
            response = client.request(method, url)
            assert response.status_code == 405, f"{method} {url}"
            assert set(response.headers["allow"].replace(" ", "").split(",")) >= allowed, f"{method} {url}"
            assert response.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    "path, param",
    [
        ("/v1/completions", "model"),
        ("/v1/chat/completions", "model"),
        ("/api/next", "body"),
        ("/api/attention", "body"),
    ],
)
def test_a_missing_body_names_what_is_missing(client, path, param):
    response = client.post(path)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "missing_body"
    assert "body is missing" in error["message"]
    if param == "model":
        assert "model" in error["message"]
    if path == "/v1/chat/completions":
        assert "messages" in error["message"]


def test_a_missing_field_is_named(client):
    error = client.post("/v1/completions", json={"prompt": "hi"}).json()["error"]
    assert error["param"] == "model" and "Field required" in error["message"]
