"""No input gives a 5xx: schemathesis generates requests, valid and invalid, from `pagedllm serve`'s own OpenAPI
schema; every answer must be below 500, and every 4xx in OpenAI's error format. Two servers: a text model named by
Hub id (a Hub cache on disk) that speculates in every step, and the default embedding model (the pooling runner).
Seeded (derandomized) and bounded, so a failure reproduces and the run stays short in CI;
PAGEDLLM_SCHEMATHESIS_EXAMPLES runs more."""

from __future__ import annotations

import collections
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hub_cache import HUB_REPO, OFFLINE
from schemathesis import GenerationMode
from server_process import ServerProcess

EXAMPLES = int(os.environ.get("PAGEDLLM_SCHEMATHESIS_EXAMPLES", "20"))  # per operation and mode


SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "disable_by_batch_size": 64}'


@pytest.fixture(scope="module", params=["text", "pooling"])
def server(request, tiny_llama_hub_cache, tmp_path_factory):
    # A short context and a small batch bound what a generated request can ask of the model.
    bounds = ["--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4", "--disable-log-requests"]
    log = tmp_path_factory.mktemp("schemathesis") / "server.log"
    if request.param == "text":
        server = ServerProcess([HUB_REPO, *bounds, "--kv-cache-space", "0.01", "--speculative-config", SPECULATIVE],
                               log, env={**OFFLINE, "HF_HUB_CACHE": str(tiny_llama_hub_cache)})
    else:
        server = ServerProcess(["--runner", "pooling", *bounds], log)  # the default embedding model
    yield server
    assert server.stop() == 0, server.log()


# One hypothesis run per operation and mode, inside the test: schemathesis.pytest.from_fixture, which would make
# them pytest items, fails under pytest 9 ('Function' object has no attribute '_nodeid').
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_yields_a_5xx(server, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    statuses: collections.Counter = collections.Counter()
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # they take no input to break
        check_operation(operation, mode, statuses)
    print(f"schemathesis {mode.value}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")


def check_operation(operation, mode: GenerationMode, statuses: collections.Counter) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(timeout=60)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.as_curl_command(), response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text
            assert error["type"] == "invalid_request_error" and error["message"], response.text

    check()
