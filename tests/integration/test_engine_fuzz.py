"""Fuzzing the embedded engine's HTTP API: bad input gets 4xx, never 5xx, and nothing breaks.

One engine process (tiny MoE, context 48 so every accepted request ends within 48 tokens) gets
random bodies on every endpoint: wrong types, missing fields, huge/negative/non-finite numbers,
nested garbage, non-JSON bytes, wrong content types, unknown rids, out-of-vocab ids, prompts
longer than the context, random and mutated migration blobs. After each example the process
must be alive; at the end it must be idle (no leaked KV blocks or queued requests) and produce
the same greedy output as before the fuzzing.

Weight-group endpoints are fuzzed with addresses that cannot reach any store: a port reserved
then closed, invalid ports, syntactically invalid host names (so no DNS lookup happens) and
loopback names. The engine runs with ``--group-connect-timeout 0.2`` so a valid-looking but
unreachable master fails in about a second. Ports of live services are never used: joining
another process's TCPStore on this shared machine could disturb it.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import time
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration

CONTEXT = 48
VOCAB = 128  # tiny presets (dora_megatron.data.tokenizer.VOCAB_SIZE); checked in the engine fixture
VERSION = "1"
PROMPTS = [[3, 17, 29, 41, 5, 6], [100, 2, 2, 7]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
JSON_ENDPOINTS = {
    ("POST", "/generate"), ("PUT", "/generate"), ("POST", "/abort_request"), ("POST", "/pause_generation"),
    ("POST", "/continue_generation"), ("POST", "/flush_cache"), ("GET", "/flush_cache"),
    ("GET", "/get_server_info"), ("GET", "/server_info"), ("GET", "/get_model_info"), ("GET", "/model_info"),
    ("GET", "/get_weight_version"), ("GET", "/health"), ("GET", "/health_generate"),
    ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
    ("POST", "/destroy_weights_update_group"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/dora/export_request"), ("POST", "/dora/import_request"), ("GET", "/dora/weights_checksum"),
}


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(model_dir):
    from dora_megatron.rollout.engine.process import start_engine

    extra = ["--context-length", str(CONTEXT), "--max-waiting", "64", "--group-connect-timeout", "0.2"]
    ep = start_engine(model_dir, max_running=4, num_threads=1, weight_version=VERSION, extra_args=extra)
    yield ep
    ep.stop()


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy outputs before any fuzzing."""
    return [_generate_ok(engine, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bad_model_dirs(tmp_path_factory, model_dir):
    """Directories that look like model directories but are not: corrupt weights, corrupt index."""
    bad = tmp_path_factory.mktemp("bad-weights")
    (bad / "config.json").write_text("{}")
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    idx = tmp_path_factory.mktemp("bad-index")
    (idx / "model.safetensors.index.json").write_text('{"not_weight_map": 1}')
    idx2 = tmp_path_factory.mktemp("bad-index-json")
    (idx2 / "model.safetensors.index.json").write_text("{not json")
    return [str(bad), str(idx), str(idx2), "/", "/nonexistent", "", "/dev/null", "\x00", model_dir]


@pytest.fixture(scope="module")
def real_blob(engine, reference):
    """A genuine export of a request that was mid-generation (the source answers 'migrated')."""
    for attempt in range(5):  # the request may finish before the pause lands; then try again
        blob = _export_mid_generation(engine, f"blob-src-{attempt}")
        if blob is not None:
            return blob
    pytest.fail("could not catch a request mid-generation")


def _export_mid_generation(engine, rid: str) -> bytes | None:
    import threading

    box = {}
    body = {"input_ids": PROMPTS[0], "rid": rid, "sampling_params": {**GREEDY, "max_new_tokens": 40}}
    t = threading.Thread(target=lambda: box.update(r=_post(engine, "/generate", body)), daemon=True)
    t0 = json.loads(_send(engine, "GET", "/get_server_info")[1])["tokens_generated"]
    t.start()
    try:
        for _ in range(2000):
            info = json.loads(_send(engine, "GET", "/get_server_info")[1])
            if info["num_running_reqs"] == 1 and info["tokens_generated"] > t0:
                break
            time.sleep(0.002)
        _post(engine, "/pause_generation", {"mode": "in_place"})
        status, blob = _send(engine, "POST", "/dora/export_request", json.dumps({"rid": rid}).encode())
    finally:
        _post(engine, "/continue_generation", {})
        t.join(30)
    if status != 200:
        return None
    assert box["r"][0] == 200 and json.loads(box["r"][1])["meta_info"]["finish_reason"]["err_type"] == "migrated"
    return blob


# ---- HTTP helpers ---------------------------------------------------------------------------
def _send(engine, method: str, path: str, body: bytes | None = None, ctype: str | None = "application/json",
          timeout: float = 60.0) -> tuple[int, bytes]:
    """One request on a fresh connection; a socket timeout here means the engine hung."""
    u = urlsplit(engine.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        headers = {"Content-Type": ctype} if ctype is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _post(engine, path: str, obj) -> tuple[int, bytes]:
    return _send(engine, "POST", path, json.dumps(obj).encode())


def _generate_ok(engine, prompt: list[int]) -> list[int]:
    status, data = _post(engine, "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
    assert status == 200, data[:300]
    return json.loads(data)["output_ids"]


def _check(engine, method: str, path: str, status: int, data: bytes) -> None:
    assert status < 500, f"{method} {path} -> {status}: {data[:500]!r}"
    assert engine.proc.poll() is None, "engine died:\n" + "\n".join(engine.log_lines[-30:])
    if 400 <= status and (method, path) in JSON_ENDPOINTS:
        err = json.loads(data)
        assert err["success"] is False and err["message"], err


def _fire(engine, method: str, path: str, payload: tuple[bytes | None, str | None]) -> tuple[int, bytes]:
    status, data = _send(engine, method, path, payload[0], payload[1])
    _check(engine, method, path, status, data)
    # pytest --hypothesis-show-statistics shows how often each outcome was hit
    event(f"{path} -> {status} {json.loads(data).get('message', '')[:40] if status >= 400 and data[:1] == b'{' else ''}")
    return status, data


# ---- strategies -----------------------------------------------------------------------------
HUGE = st.integers(min_value=-(2**80), max_value=2**80)
scalars = st.one_of(st.none(), st.booleans(), HUGE, st.floats(), st.text(max_size=12))
garbage = st.recursive(
    scalars, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=10,
)
CTYPES = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                          "multipart/form-data; boundary=zz", "application/octet-stream", "", None])


def maybe(strategy):
    """Mostly the plausible value, sometimes garbage of any type."""
    return st.one_of(strategy, strategy, garbage)


def envelope(structured):
    """(body bytes, content type): the structured JSON, garbage JSON, raw bytes, odd content types."""
    as_json = structured.map(lambda b: json.dumps(b).encode())  # NaN/Infinity tokens included
    return st.one_of(
        st.tuples(as_json, st.just("application/json")),
        st.tuples(as_json, st.just("application/json")),
        st.tuples(as_json, CTYPES),
        st.tuples(garbage.map(lambda b: json.dumps(b).encode()), CTYPES),
        st.tuples(st.binary(max_size=64), CTYPES),
        st.tuples(st.just(None), CTYPES),
    )


token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=CONTEXT + 8)
odd_ids = st.lists(st.one_of(HUGE, st.integers(-3, VOCAB + 3)), max_size=8)
sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": maybe(st.one_of(st.integers(-3, 6), HUGE)),
    "temperature": maybe(st.one_of(st.floats(0, 2), st.floats(allow_nan=True, allow_infinity=True), HUGE)),
    "top_p": maybe(st.one_of(st.floats(0, 1), st.floats())),
    "top_k": maybe(st.one_of(st.integers(-3, 200), HUGE)),
    "stop_token_ids": maybe(st.lists(st.one_of(st.integers(0, VOCAB), HUGE), max_size=4)),
    "ignore_eos": maybe(st.booleans()),
    "sampling_seed": maybe(HUGE),
})
extreme_sampling = st.fixed_dictionaries({}, optional={  # right types, extreme values
    "max_new_tokens": st.one_of(st.integers(0, 6), st.integers(-(2**70), 2**70)),
    "temperature": st.one_of(st.floats(0, 2), st.floats(allow_nan=True, allow_infinity=True)),
    "top_p": st.one_of(st.floats(0, 1), st.floats(allow_nan=True, allow_infinity=True)),
    "top_k": st.one_of(st.integers(-2, 200), st.integers(-(2**70), 2**70)),
    "stop_token_ids": st.lists(st.integers(-(2**70), 2**70), max_size=4),
    "ignore_eos": st.booleans(),
    "sampling_seed": st.one_of(st.integers(-(2**64), 2**65), st.integers(0, 10)),
})
plausible_generate = st.fixed_dictionaries({"input_ids": token_ids}, optional={
    "sampling_params": extreme_sampling, "rid": st.text(max_size=8), "return_logprob": st.booleans(),
    "dora_version": st.sampled_from([VERSION, int(VERSION), "2"]),
})
generate_body = st.fixed_dictionaries({}, optional={
    "input_ids": maybe(st.one_of(token_ids, odd_ids, st.just([[1, 2], [3]]))),
    "sampling_params": maybe(sampling),
    "rid": maybe(st.text(max_size=8)),
    "return_logprob": maybe(st.booleans()),
    "dora_version": maybe(st.sampled_from([VERSION, int(VERSION), "2", 2])),
    "stream": maybe(st.booleans()),
})
rids = st.one_of(st.text(max_size=12), st.just(""), st.just("blob-src-0"))


def _json(structured):
    return st.tuples(structured.map(lambda b: json.dumps(b).encode()), st.just("application/json"))


def _j(obj) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), "application/json"


# ---- fuzz tests ------------------------------------------------------------------------------
@settings(FUZZ, max_examples=200)
@given(method=st.sampled_from(["POST", "PUT"]), payload=st.one_of(envelope(generate_body), _json(plausible_generate)))
@example(method="POST", payload=(b"[" * 100_000, "application/json"))  # RecursionError in json.loads
@example(method="POST", payload=(b'{"input_ids": [1, 2', "application/json"))
@example(method="POST", payload=(b'\xff\xfe{"input_ids": [1]}', "application/json"))
@example(method="POST", payload=_j({"input_ids": [1] * (CONTEXT + 1)}))
@example(method="POST", payload=_j({"input_ids": [VOCAB, -1]}))
@example(method="POST", payload=_j({"input_ids": [2**70]}))
@example(method="POST", payload=_j({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}))
@example(method="POST", payload=_j({"input_ids": [1], "sampling_params": {"sampling_seed": -(2**70)}}))
@example(method="POST", payload=_j({"input_ids": [1], "sampling_params": {"temperature": 1e-300, "max_new_tokens": 3}}))
@example(method="POST", payload=_j({"input_ids": [1], "sampling_params": {"temperature": 1e300, "max_new_tokens": 3}}))
@example(method="POST", payload=_j({"input_ids": [1], "sampling_params": {"temperature": 2**1100}}))
@example(method="POST", payload=(b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "application/json"))
@example(method="POST", payload=(b'{"input_ids": [1], "sampling_params": {"top_p": Infinity}}', "application/json"))
@example(method="POST", payload=_j({"input_ids": [1], "sampling_params": {"top_k": 2**62, "max_new_tokens": 2**62}}))
def test_fuzz_generate(engine, reference, method, payload):
    status, data = _fire(engine, method, "/generate", payload)
    if status == 200:
        out = json.loads(data)
        body = json.loads(payload[0])
        meta = out["meta_info"]
        assert all(0 <= t < VOCAB for t in out["output_ids"])
        assert meta["prompt_tokens"] == len(body["input_ids"])
        assert meta["prompt_tokens"] + meta["completion_tokens"] <= CONTEXT
        assert meta["finish_reason"].get("err_type") != "internal_error", meta  # no failed step or sample


@settings(FUZZ, max_examples=150)
@given(
    path=st.sampled_from(["/abort_request", "/pause_generation", "/continue_generation", "/flush_cache"]),
    payload=envelope(st.fixed_dictionaries({}, optional={
        "rid": maybe(rids), "abort_all": maybe(st.booleans()),
        "mode": maybe(st.sampled_from(["abort", "retract", "in_place", "sleep", ""])),
    })),
)
def test_fuzz_control(engine, reference, path, payload):
    try:
        _fire(engine, "POST", path, payload)
    finally:
        _send(engine, "POST", "/continue_generation", b"{}")  # a pause must not stall the next example


def _blob_variants(real: bytes):
    """Random bytes, truncations and byte flips of a real export, and re-saved blobs with bad fields."""
    import torch

    good = torch.load(io.BytesIO(real), weights_only=True)
    tensors = st.one_of(
        st.just(torch.zeros(0)), st.just(torch.ones(3, dtype=torch.int64)), st.just(torch.zeros(1, 2, 3, 4, 5)),
        st.just(torch.zeros(2, 2, 2, 2, 2, dtype=torch.float16)), st.just(torch.zeros(3, device="meta")),
        st.just(torch.zeros(2, 2).to_sparse()),
    )
    field_values = st.one_of(garbage, tensors)

    def resave(overrides: dict) -> bytes:
        blob = dict(good)
        for k, v in overrides.items():
            if v is _DROP:
                blob.pop(k, None)
            else:
                blob[k] = v
        buf = io.BytesIO()
        torch.save(blob, buf)
        return buf.getvalue()

    mutated = st.dictionaries(
        st.sampled_from(sorted(good)),
        st.one_of(field_values, st.just(_DROP), *[st.just(v) for v in good.values() if not isinstance(v, torch.Tensor)]),
        min_size=1, max_size=3,
    ).map(resave)
    flipped = st.tuples(st.integers(0, len(real) - 1), st.integers(1, 255)).map(
        lambda t: real[: t[0]] + bytes([real[t[0]] ^ t[1]]) + real[t[0] + 1:]
    )
    truncated = st.integers(0, len(real) - 1).map(lambda n: real[:n])
    return st.one_of(st.binary(max_size=512), truncated, flipped, mutated, mutated, st.just(real))


_DROP = object()


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_fuzz_migration(engine, reference, real_blob, data):
    if data.draw(st.booleans(), label="export"):
        payload = data.draw(envelope(st.fixed_dictionaries({}, optional={"rid": maybe(rids)})), label="payload")
        status, _ = _fire(engine, "POST", "/dora/export_request", payload)
        assert status != 200  # nothing is running, so no rid can match
    else:
        blob = data.draw(_blob_variants(real_blob), label="blob")
        ctype = data.draw(CTYPES, label="ctype")
        status, out = _fire(engine, "POST", "/dora/import_request", (blob, ctype))
        if status == 200:
            meta = json.loads(out)["meta_info"]
            assert meta["finish_reason"].get("err_type") != "internal_error", meta
            assert meta["prompt_tokens"] + meta["completion_tokens"] <= CONTEXT


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_fuzz_weight_endpoints(engine, reference, closed_port, bad_model_dirs, data):
    address = st.one_of(
        st.sampled_from(["127.0.0.1", "localhost", "::1", "", "256.1.1.1", "bad host", "a/b?rank=0", "x" * 300]),
        st.text(max_size=10).map(lambda s: s + "!"),  # never a valid host name: no DNS lookup
    )
    port = st.one_of(st.just(closed_port), st.integers(-5, 0), st.integers(65536, 2**70))
    bodies = {
        "/update_weights_from_disk": st.fixed_dictionaries({}, optional={
            "model_path": maybe(st.sampled_from(bad_model_dirs[:-1]) | st.just(bad_model_dirs[-1])),
            "weight_version": maybe(st.sampled_from([VERSION, "9", 9])), "abort_all_requests": maybe(st.booleans()),
        }),
        "/init_weights_update_group": st.fixed_dictionaries({}, optional={
            "master_address": maybe(address), "master_port": maybe(port),
            "rank_offset": maybe(st.one_of(st.integers(-1, 3), HUGE)),
            "world_size": maybe(st.one_of(st.integers(-1, 4), HUGE)),
            "group_name": maybe(st.text(max_size=6)), "backend": maybe(st.sampled_from(["gloo", "nccl", "mpi"])),
        }),
        "/update_weights_from_distributed": st.fixed_dictionaries({}, optional={
            "names": maybe(st.lists(st.sampled_from(["model.norm.weight", "lm_head.weight", "nope"]), max_size=3)),
            "dtypes": maybe(st.lists(st.sampled_from(["float32", "torch.bfloat16", "int8", "nope", "Tensor"]), max_size=3)),
            "shapes": maybe(st.lists(st.lists(st.one_of(st.integers(-2, 300), HUGE), max_size=3), max_size=3)),
            "group_name": maybe(st.text(max_size=6)), "weight_version": maybe(st.text(max_size=3)),
        }),
        "/destroy_weights_update_group": st.fixed_dictionaries({}, optional={"group_name": maybe(st.text(max_size=6))}),
    }
    plausible = {  # required fields present with the right types: these reach the deeper checks
        "/update_weights_from_disk": st.fixed_dictionaries(
            {"model_path": st.sampled_from(bad_model_dirs)}, optional={"weight_version": st.sampled_from([VERSION, "9"])}
        ),
        "/init_weights_update_group": st.fixed_dictionaries(
            {"master_address": address, "master_port": port, "rank_offset": st.integers(1, 3),
             "world_size": st.integers(2, 4)},
            optional={"group_name": st.text(max_size=6), "backend": st.sampled_from(["gloo", "nccl"])},
        ),
        "/update_weights_from_distributed": bodies["/update_weights_from_distributed"].map(
            lambda b: {"names": [], "dtypes": [], "shapes": [], **b}
        ),
        "/destroy_weights_update_group": bodies["/destroy_weights_update_group"],
    }
    path = data.draw(st.sampled_from(sorted(bodies)), label="path")
    payload = data.draw(st.one_of(envelope(bodies[path]), _json(plausible[path])), label="payload")
    status, out = _fire(engine, "POST", path, payload)
    if path == "/init_weights_update_group":
        assert status != 200, out  # no store is reachable: joining must fail (fast, or this test hangs)


@settings(FUZZ, max_examples=150)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    path=st.one_of(st.sampled_from(sorted({p for _, p in JSON_ENDPOINTS} - {"/generate", "/dora/import_request",
                                                                          "/init_weights_update_group"})),
                   st.text(alphabet="abcdefghij/_%?=&.", max_size=20).map(lambda s: "/" + s)),
    query=st.one_of(st.just(""), st.text(alphabet="abc=&%;", max_size=12).map(lambda s: "?" + s)),
    payload=envelope(garbage),
)
def test_fuzz_any_route(engine, reference, method, path, query, payload):
    """Any method, path, query and body; unknown routes and methods get 404/405, never 5xx."""
    try:
        _fire(engine, method, path + query if "?" not in path else path, payload)
    finally:
        _send(engine, "POST", "/continue_generation", b"{}")


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "::1", "silent"])
def test_init_group_with_unreachable_master_fails_with_400(engine, reference, closed_port, address):
    """A well-formed join request towards a master that is not there: 400 after the connect timeout.

    ``silent``: a port that accepts connections but never answers (torch's TCPStore client would
    wait for it forever); the engine gives up on its own bound.
    """
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        host, port = ("127.0.0.1", silent.getsockname()[1]) if address == "silent" else (address, closed_port)
        body = {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "g-" + address}
        status, data = _send(engine, "POST", "/init_weights_update_group", json.dumps(body).encode(), timeout=30)
    _check(engine, "POST", "/init_weights_update_group", status, data)
    assert status == 400 and "failed to join weight update group" in json.loads(data)["message"]


def test_engine_correct_and_idle_after_fuzzing(engine, reference, model_dir):
    """Run last: the engine is alive, idle, leaks nothing, and still generates the same tokens."""
    _post(engine, "/continue_generation", {})
    _post(engine, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": VERSION})
    assert _send(engine, "GET", "/health")[0] == 200
    after = [_generate_ok(engine, p) for p in PROMPTS]
    info = json.loads(_send(engine, "GET", "/get_server_info")[1])
    assert after == reference
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_blocks_used"] == 0
    assert info["paused"] is None and info["last_error"] is None
    assert info["weight_update_groups"] == []
    assert engine.proc.poll() is None
