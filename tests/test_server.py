"""`hf-deep-nmt serve`: the application through an in-process ASGI client (LibreTranslate's `/translate`, paragraphs
split and put back, batches across requests off the event loop, every refusal as JSON, `/metrics` as Prometheus text,
`/health`), the choice of backend, and one real server process: 64 concurrent HTTP requests answered exactly as
`translate` answers the same lines, then SIGTERM answers every accepted request and exits 0. The page at `/` is
driven by a real headless browser where Debian's chromium and its driver are installed (skipped elsewhere)."""

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import threading
import time
from pathlib import Path

import fault_worker
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hf_deep_nmt.cli import main  # noqa: E402
from hf_deep_nmt.serving import backends  # noqa: E402
from hf_deep_nmt.serving.decoder import Decoder  # noqa: E402
from hf_deep_nmt.serving.onnx import OnnxDecoder  # noqa: E402
from hf_deep_nmt.serving.options import DecodingOptions  # noqa: E402
from hf_deep_nmt.serving.server.app import Service, build_app  # noqa: E402
from hf_deep_nmt.serving.server.batching import pick_batch, wait_left  # noqa: E402
from hf_deep_nmt.serving.server.limits import ServerLimits  # noqa: E402
from hf_deep_nmt.serving.server.sentences import join_sentences, split_sentences  # noqa: E402
from hf_deep_nmt.serving.torch_decoder import TorchDecoder  # noqa: E402
from hf_deep_nmt.serving.translate import translate  # noqa: E402

PAIR = {"source": "es", "target": "en"}


class WordTokenizer:
    """One id per word (its length), `</s>` = 0; a list of texts gives a list of id lists."""

    def __call__(self, text, verbose=False):
        if isinstance(text, list):
            return {"input_ids": [self(one)["input_ids"] for one in text]}
        return {"input_ids": [len(word) for word in text.split()] + [0]}


class Spelling(Decoder):
    """Translates a sentence into its ids ("4-6/1": two words, one beam) and records each batch and the thread that
    decoded it; a sentence with a word of 13 letters fails to decode, 3 beams are refused by `check`, and `gate`
    holds every batch until it is set."""

    def __init__(self):
        self.batches, self.threads, self.gate = [], set(), threading.Event()
        self.gate.set()

    def check(self, tokenizer, options):
        if options.num_beams == 3:
            raise ValueError("this decoder refuses `num_beams` 3")

    def translate_batch(self, tokenizer, sources, options):
        assert self.gate.wait(10)
        self.threads.add(threading.current_thread().name)
        if any(13 in ids for ids in sources):
            raise RuntimeError("no word may have 13 letters")
        self.batches.append([len(ids) for ids in sources])
        return ["-".join(map(str, ids[:-1])) + f"/{options.num_beams}" for ids in sources]


@contextlib.asynccontextmanager
async def serving(decoder=None, limits=None, ready=True, **settings):
    """(client, service) of an application serving `decoder` (a `Spelling`) in this event loop."""
    limits = limits or ServerLimits(max_wait_ms=5)
    settings.setdefault("languages", ("es", "en"))
    service = Service(decoder or Spelling(), WordTokenizer(), DecodingOptions(num_beams=1), limits, **settings)
    app = build_app(service)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            if ready:
                await wait_until_ready(client)
            yield client, service


async def wait_until_ready(client, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while (await client.get("/health")).status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        await asyncio.sleep(0.01)


def metric_values(text: str) -> dict:
    """{(sample name, labels): value} of Prometheus text, parsed by prometheus_client's own parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# ---- sentences --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("Hola mundo. ¿Qué tal?  Bien, gracias!", ["Hola mundo.", "¿Qué tal?", "Bien, gracias!"]),
        ("  Uno.\n\n  Dos sin punto\nTres", ["Uno.", "Dos sin punto", "Tres"]),
        ('He said "stop." Then he left.', ['He said "stop."', "Then he left."]),
        ("Dr. Smith came, e.g. today. The U.S. army left.", ["Dr. Smith came, e.g. today.", "The U.S. army left."]),
        ("wait... and see. 3 more", ["wait... and see.", "3 more"]),
        ("no end punctuation at all", ["no end punctuation at all"]),
        ("", []),
        (" \n\t ", []),
    ],
)
def test_paragraphs_are_split_into_sentences_and_put_back_with_their_whitespace(text, sentences):
    found, gaps = split_sentences(text)
    assert found == sentences and len(gaps) == len(found) + 1
    assert join_sentences(found, gaps) == text
    assert join_sentences([sentence.upper() for sentence in found], gaps) == text.upper()


def test_a_batch_holds_the_oldest_sentence_and_its_neighbours_in_length_within_the_budget():
    lengths = [10, 3, 11, 40, 9, 10, 2]
    assert sorted(pick_batch(lengths, budget=44, most=8)) == [0, 2, 4, 5]  # 4 x 11 tokens
    assert sorted(pick_batch(lengths, budget=1000, most=3)) == [0, 4, 5]
    assert pick_batch([50, 1, 1], budget=10, most=8) == [0]  # over the budget alone: alone
    assert sorted(pick_batch([5] * 4, budget=20, most=8)) == [0, 1, 2, 3]


def test_a_batch_leaves_out_a_sentence_that_would_make_most_of_it_padding():
    lengths = [10, 3, 11, 40, 9, 10, 2]
    # within 1.3 x (real tokens + 4 a sentence): 10, 10, 11, 9 (44 padded, 40 + 16), then 3 (55, 43 + 20) and 2 (66,
    # 45 + 24: 1.3 x 69 = 89.7); 40 would make 280 padded for 85 + 28 (1.3 x 113 = 146.9)
    assert sorted(pick_batch(lengths, budget=1000, most=8)) == [0, 1, 2, 4, 5, 6]
    # 40, 41, then 12 (123 padded for 93 + 12: 1.3 x 105 = 136.5); 2 would make 164 for 95 + 16 (144.3)
    assert sorted(pick_batch([40, 2, 41, 12], budget=1000, most=8)) == [0, 2, 3]


def test_after_a_batch_the_next_waits_only_until_as_many_sentences_came_back_as_it_answered():
    limits = ServerLimits(max_wait_ms=100, max_batch_sentences=64, max_batch_tokens=4096)
    # the first sentence arrived at 1.0 s, before the last batch (8 sentences) ended at 2.0 s; now is 2.01 s
    after = dict(oldest=1.0, now=2.01, limits=limits, freed=2.0, answered=8)
    assert wait_left(10, 50, **after, back=7) == pytest.approx(0.09)  # from the end of the batch
    assert wait_left(10, 50, **after, back=8) <= 0  # all came back: at once
    # from an idle decoder the wait counts from the first arrival
    assert wait_left(3, 50, oldest=2.0, now=2.01, limits=limits) == pytest.approx(0.09)
    assert wait_left(3, 50, oldest=2.0, now=2.01, limits=limits, freed=1.0, answered=8) == pytest.approx(0.09)
    # a full batch goes at once, by sentences or by tokens
    assert wait_left(64, 50, oldest=2.0, now=2.0, limits=limits) == 0
    assert wait_left(2, 4096, oldest=2.0, now=2.0, limits=limits) == 0


def test_a_batch_goes_as_soon_as_the_requests_the_last_one_answered_have_sent_their_next():
    async def scenario():
        decoder = Spelling()
        async with serving(decoder, ServerLimits(max_wait_ms=250)) as (client, _):
            decoder.gate.clear()  # the decoder is busy with the first request's batch
            decoder.batches.clear()
            first = asyncio.create_task(client.post("/translate", json={"q": "uno", **PAIR}))
            await asyncio.sleep(0.35)  # its batch taken (past its wait) and held at the gate
            second = asyncio.create_task(client.post("/translate", json={"q": "dos dos", **PAIR}))
            await asyncio.sleep(0.3)  # queued while the decoder works, past the wait since its arrival
            decoder.gate.set()
            assert (await first).status_code == 200
            sent = time.perf_counter()  # the answered client sends its next request
            third = await client.post("/translate", json={"q": "tres tres", **PAIR})
            assert third.status_code == 200 and (await second).status_code == 200
            assert time.perf_counter() - sent < 0.15  # no 250 ms wait after the batch: its one sentence came back
            assert decoder.batches == [[2], [3, 3]]

    asyncio.run(scenario())


# ---- the application in this process -----------------------------------------------------------------------------


def test_translate_speaks_libretranslate_and_batches_across_requests_off_the_event_loop():
    async def scenario():
        decoder = Spelling()
        async with serving(decoder, ServerLimits(max_wait_ms=5)) as (client, service):
            answer = await client.post("/translate", json={"q": "Hola mundo.  ¿Qué tal?\n\nBien", **PAIR})
            assert answer.status_code == 200 and answer.json() == {"translatedText": "4-6/1  4-4/1\n\n4/1"}
            listed = await client.post(
                "/translate", json={"q": ["a bb", "", "ccc. Dd"], "source": "auto", "target": "en"}
            )
            assert listed.json() == {
                "translatedText": ["1-2/1", "", "4/1 2/1"],
                "detectedLanguage": {"confidence": 100.0, "language": "es"},
            }
            form = await client.post("/translate", data={"q": "uno dos", **PAIR, "num_beams": "2"})
            assert form.json() == {"translatedText": "3-3/2"}
            decoder.batches.clear()
            service.batcher.limits = dataclasses.replace(service.limits, max_wait_ms=2000)  # all 64 join one batch
            texts = [" ".join(["w"] * (1 + index % 7)) for index in range(64)]
            answers = await asyncio.gather(*(client.post("/translate", json={"q": text, **PAIR}) for text in texts))
            assert [item.json()["translatedText"] for item in answers] == [
                "-".join(["1"] * (1 + index % 7)) + "/1" for index in range(64)
            ]
            assert sum(map(len, decoder.batches)) == 64 and len(decoder.batches) <= 2, decoder.batches
            assert all(batch == sorted(batch) for batch in decoder.batches)  # sorted by length inside a batch
            assert threading.current_thread().name not in decoder.threads and len(decoder.threads) == 1
            languages = await client.get("/languages")
            assert languages.json() == [{"code": "es", "name": "es", "targets": ["en"]}]
            page = await client.get("/")
            assert (
                page.status_code == 200
                and "<textarea" in page.text
                and page.headers["content-type"].startswith("text/html")
            )

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "request_kwargs, status, message",
    [
        (dict(content=b"{", headers={"content-type": "application/json"}), 422, "The body is not JSON"),
        (dict(json=["a"]), 422, "must be a JSON object"),
        (dict(json={**PAIR}), 422, "`q` is required"),
        (dict(json={"q": 3, **PAIR}), 422, "`q` must be a string or a list of strings, got int"),
        (dict(json={"q": "a", "target": "en"}), 422, "`source` is required"),
        (dict(json={"q": "a", **PAIR, "format": "html"}), 422, "`format` 'html' is not served"),
        (dict(json={"q": "a", **PAIR, "num_beams": 9}), 422, "`num_beams` must be a whole number from 1 to 8"),
        (dict(json={"q": "a", **PAIR, "num_beams": 3}), 422, "this decoder refuses `num_beams` 3"),
        (dict(json={"q": "a", **PAIR, "max_length": 0}), 422, "`max_length` must be a whole number from 1 to 1024"),
        (dict(json={"q": "a", "source": "de", "target": "en"}), 400, "This server translates es to en"),
        (dict(json={"q": "a", "source": "es", "target": "fr"}), 400, "the request asks es to fr"),
        (dict(json={"q": "x" * 2000, **PAIR}), 413, "limit of 1000 bytes (--max-body-bytes)"),
        (dict(json={"q": ["One. Two. Three."] * 2, **PAIR}), 413, "6 sentences, over this server's limit of 5"),
        (dict(json={"q": "a " * 40, **PAIR}), 413, "longer than 32 tokens"),
    ],
)
def test_each_refusal_is_json_with_its_status_and_counted_by_kind(request_kwargs, status, message):
    limits = ServerLimits(max_body_bytes=1000, max_sentences=5)
    kind = {422: "malformed", 400: "language_pair"}.get(status)

    async def scenario():
        async with serving(limits=limits, ready=False) as (client, service):
            service.options = DecodingOptions(num_beams=1, max_source_tokens=32)
            answer = await client.post("/translate", **request_kwargs)
            assert answer.status_code == status and message in answer.json()["error"], answer.text
            counted = metric_values((await client.get("/metrics")).text)
            kinds = {labels[0][1]: value for (name, labels), value in counted.items() if name.endswith("errors_total")}
            assert sum(kinds.values()) == 1 and (kind is None or kinds[kind] == 1)
            assert counted[("hf_deep_nmt_serve_requests_total", (("status", str(status)),))] == 1

    asyncio.run(scenario())


def test_a_full_queue_a_deadline_and_a_failing_sentence_each_fail_only_their_own_request():
    async def scenario():
        decoder = Spelling()
        limits = ServerLimits(max_queue=3, timeout_s=0.5, max_wait_ms=0)
        async with serving(decoder, limits) as (client, _):
            decoder.gate.clear()  # the decoder is busy: batches wait
            first = asyncio.create_task(client.post("/translate", json={"q": "uno", **PAIR}))
            await asyncio.sleep(0.05)  # taken into a batch, held at the gate
            queued = asyncio.create_task(client.post("/translate", json={"q": ["dos", "tres. Cuatro"], **PAIR}))
            await asyncio.sleep(0.05)
            full = await client.post("/translate", json={"q": "cinco seis", **PAIR})
            assert full.status_code == 503 and int(full.headers["retry-after"]) >= 1
            assert "The queue is full (3 sentences wait, --max-queue 3)" in full.json()["error"]
            health = await client.get("/health")  # the event loop answers while the decoder works
            assert health.status_code == 200
            late = await queued
            assert late.status_code == 504 and "--timeout-s" in late.json()["error"]
            decoder.gate.set()
            assert (await first).status_code == 504  # its batch finished past its deadline
            mixed = [{"q": "uno dos", **PAIR}, {"q": "abcdefghijklm", **PAIR}, {"q": "tres", **PAIR}]
            answers = await asyncio.gather(*(client.post("/translate", json=body) for body in mixed))
            assert [answer.status_code for answer in answers] == [200, 500, 200]
            assert "no word may have 13 letters" in answers[1].json()["error"]
            assert [answers[0].json(), answers[2].json()] == [{"translatedText": "3-3/1"}, {"translatedText": "4/1"}]
            counted = metric_values((await client.get("/metrics")).text)
            for kind, count in (("queue_full", 1), ("deadline", 2), ("decoding", 1)):
                assert counted[("hf_deep_nmt_serve_errors_total", (("kind", kind),))] == count

    asyncio.run(scenario())


def test_health_waits_for_the_warm_up_and_draining_refuses_new_requests():
    async def scenario():
        decoder = Spelling()
        decoder.gate.clear()
        async with serving(decoder, ready=False) as (client, service):
            loading = await client.get("/health")
            assert loading.status_code == 503 and loading.json()["status"] == "loading"
            accepted = asyncio.create_task(client.post("/translate", json={"q": "hola", **PAIR}))
            decoder.gate.set()
            await wait_until_ready(client)
            assert (await accepted).json() == {"translatedText": "4/1"}  # queued while loading, answered after
            metrics = metric_values((await client.get("/metrics")).text)
            assert metrics[("hf_deep_nmt_serve_ready", ())] == 1
            assert metrics[("hf_deep_nmt_serve_sentences_total", ())] == 1  # the warm-up batch is not counted
            service.begin_drain()
            draining = await client.post("/translate", json={"q": "hola", **PAIR})
            assert draining.status_code == 503 and "shutting down" in draining.json()["error"]
            assert (await client.get("/health")).json()["status"] == "draining"

    asyncio.run(scenario())


def test_a_failed_warm_up_fails_what_was_queued_and_stops_the_server():
    class Broken(Spelling):
        def translate_batch(self, tokenizer, sources, options):
            assert self.gate.wait(10)
            raise RuntimeError("the decoder is broken")

    async def scenario():
        decoder, stopped = Broken(), []
        decoder.gate.clear()
        async with serving(decoder, ready=False) as (client, service):
            service.on_failure = stopped.append
            queued = asyncio.create_task(client.post("/translate", json={"q": "hola", **PAIR}))
            await asyncio.sleep(0.05)
            decoder.gate.set()
            answer = await queued
            assert answer.status_code == 500 and "the decoder is broken" in answer.json()["error"]
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert [str(error) for error in stopped] == ["the decoder is broken"] and service.failure is stopped[0]
            assert (await client.post("/translate", json={"q": "hola", **PAIR})).status_code == 503

    asyncio.run(scenario())


def test_an_api_key_guards_translate_and_metrics_but_not_health_or_the_page():
    async def scenario():
        async with serving(api_key="s3cret") as (client, _):
            refused = await client.post("/translate", json={"q": "hola", **PAIR})
            assert refused.status_code == 403 and "API key" in refused.json()["error"]
            wrong = await client.post("/translate", json={"q": "hola", **PAIR, "api_key": "guess"})
            assert wrong.status_code == 403
            body_key = await client.post("/translate", json={"q": "hola", **PAIR, "api_key": "s3cret"})
            assert body_key.json() == {"translatedText": "4/1"}
            bearer = {"Authorization": "Bearer s3cret"}
            assert (await client.post("/translate", json={"q": "hola", **PAIR}, headers=bearer)).status_code == 200
            assert (await client.get("/metrics")).status_code == 403
            assert (await client.get("/metrics", headers=bearer)).status_code == 200
            assert (await client.get("/")).status_code == 200
            missing = await client.get("/nowhere")
            assert missing.status_code == 404 and missing.json() == {"error": "Not Found"}

    asyncio.run(scenario())


# ---- the backend, chosen fastest first ----------------------------------------------------------------------------


class Unavailable(Decoder):
    @classmethod
    def unavailable_reason(cls, model, *, int8=False):
        return "not here"


def test_the_fastest_available_backend_is_chosen_and_a_named_one_says_why_it_cannot_run(monkeypatch, tiny_export):
    folder = str(tiny_export[0])
    assert "holds no ONNX graphs" in OnnxDecoder.unavailable_reason(folder)
    assert TorchDecoder.unavailable_reason(folder) is None and "fp32" in TorchDecoder.unavailable_reason(
        folder, int8=1
    )
    monkeypatch.setattr(backends, "DECODERS", {"torch": TorchDecoder, "onnxruntime": Unavailable})
    assert backends.choose_backend(folder) == "torch"  # ctranslate2 has no decoder registered here: passed over
    assert backends.backend_choice(folder) == ("torch", {"onnxruntime": "not here"})
    with pytest.raises(ValueError, match="--backend onnxruntime cannot decode .*: not here"):
        backends.choose_backend(folder, backend="onnxruntime")
    with pytest.raises(ValueError, match="No backend can decode .*torch: it decodes in fp32 only"):
        backends.choose_backend(folder, int8=True)
    decoder, tokenizer = backends.make_decoder("torch", folder, threads=1)
    assert isinstance(decoder, TorchDecoder) and tokenizer.pad_token_id == tiny_export[2].pad_token_id


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-wait-ms", "-1"], "--max-wait-ms must be a number >= 0"),
        (["--max-queue", "0"], "argument --max-queue: must be an integer >= 1"),
        (["--port", "70000"], "must be a port number from 0 to 65535"),
        (["--max-length-a", "11"], "--max-length-a must be a number in [0, 10]"),
        (["--backend", "onnxruntime"], "--backend onnxruntime cannot decode"),
    ],
)
def test_serve_refuses_its_flags_before_listening(tiny_export, capsys, flags, message):
    assert main(["serve", "--model", str(tiny_export[0]), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("model", ["./no-such-model", "runs/a/b"])
def test_a_model_that_names_nothing_is_refused_before_any_backend_is_weighed(model, capsys):
    assert main(["serve", "--model", model]) == 2
    captured = capsys.readouterr()
    assert "does not exist" in captured.err or "is neither a local folder" in captured.err
    assert "passed over" not in captured.out + captured.err


def test_an_empty_api_key_file_is_refused(tmp_path, capsys):
    (tmp_path / "key").write_text("\n")
    assert main(["serve", "--model", "m", "--api-key-file", str(tmp_path / "key")]) == 2
    assert "is empty; write the key into it" in capsys.readouterr().err


# ---- one real server process ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sample_lines(count: int) -> list[str]:
    """Short sentences of the bundled sample, one sentence each for the splitter."""
    from hf_deep_nmt.data.corpus import sample_corpus_dir

    rows = (sample_corpus_dir() / "valid.tsv").read_text(encoding="utf-8").splitlines()
    lines = [" ".join(row.split("\t")[0].split()[:5]).rstrip(".,;:") for row in rows[:count]]
    assert all(len(split_sentences(line)[0]) == 1 for line in lines)
    return lines


async def post_all(base: str, bodies: list[dict]) -> list:
    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120) as client:
        return await asyncio.gather(*(client.post("/translate", json=body) for body in bodies))


def test_a_real_server_answers_64_concurrent_requests_as_translate_does_and_drains_on_sigterm(tiny_export, tmp_path):
    """The server is a process of its own (forked from `fault_worker`'s fork server, which paid the imports once)
    running the real command line; the client speaks real HTTP to it."""
    folder, model, tokenizer = tiny_export
    lines = sample_lines(64)
    expected = translate(model, tokenizer, lines, num_beams=2)  # the saved generation config's beams
    port, log = free_port(), tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    arguments = ["serve", "--model", str(folder), "--port", str(port), "--backend", "torch", "--max-wait-ms", "3000"]
    server = fault_worker.start(arguments, dict(os.environ, OMP_NUM_THREADS="1"), log)
    try:
        wait_for_health(base, server)
        answers = asyncio.run(post_all(base, [{"q": line, **PAIR} for line in lines]))
        assert [answer.status_code for answer in answers] == [200] * 64
        assert [answer.json()["translatedText"] for answer in answers] == expected
        drained = asyncio.run(sigterm_while_answering(base, server.pid, lines[:16]))
        assert [answer.status_code for answer in drained] == [200] * 16
        assert [answer.json()["translatedText"] for answer in drained] == expected[:16]
        server.join(60)
    finally:
        if server.exitcode is None:
            server.kill()
            server.join()
    output = log.read_text()
    assert server.exitcode == 0, output
    assert f"hf-deep-nmt serve: backend torch for {folder}" in output and "Finished server process" in output


def wait_for_health(base: str, server, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=2) as client:
        while True:
            assert server.exitcode is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.TransportError):
                if client.get("/health").status_code == 200:
                    return
            time.sleep(0.2)


async def sigterm_while_answering(base: str, pid: int, lines: list[str]) -> list:
    """Send one request per line (they wait up to --max-wait-ms in the queue), SIGTERM once the server has accepted
    all of them, check that a new request is refused meanwhile, and return the answers."""
    sending = asyncio.create_task(post_all(base, [{"q": line, **PAIR} for line in lines]))
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(base_url=base) as probe:
        while not sending.done():
            counted = metric_values((await probe.get("/metrics")).text)
            if counted[("hf_deep_nmt_serve_requests_in_progress", ())] == len(lines):
                break
            assert time.monotonic() < deadline, "the requests were never all in progress"
            await asyncio.sleep(0.01)
    os.kill(pid, signal.SIGTERM)
    await asyncio.sleep(1.0)
    try:
        async with httpx.AsyncClient(base_url=base) as late:
            refused = await late.post("/translate", json={"q": "hola", **PAIR})
    except httpx.TransportError:  # nothing listens any more
        pass
    else:  # a connection uvicorn had not closed yet: refused by the draining server
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
    assert not sending.done()  # the accepted requests are still waiting for their batch
    return await sending


# ---- the page, in a real browser ---------------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def test_the_page_translates_what_is_typed_in_a_headless_browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"no browser to drive: Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    import uvicorn
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    service = Service(Spelling(), WordTokenizer(), DecodingOptions(num_beams=1), languages=("es", "en"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    try:
        while not server.started:
            time.sleep(0.05)
        browser.get(f"http://127.0.0.1:{port}/")
        WebDriverWait(browser, 10).until(lambda _: browser.find_element(By.ID, "target").get_attribute("value"))
        browser.find_element(By.ID, "text").send_keys("Hola mundo. Adiós")
        browser.find_element(By.ID, "go").click()
        translation = browser.find_element(By.ID, "translation")
        WebDriverWait(browser, 10).until(lambda _: translation.text)
        assert translation.text == "4-6/1 5/1"
    finally:
        browser.quit()
        server.should_exit = True
        thread.join(10)
