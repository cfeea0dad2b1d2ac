"""`hf-deep-nmt serve` under load, beside `translate` over the same sentences on the same backend.

A closed-loop load generator (a real HTTP client: the standard library's `http.client`, a thread per keep-alive
connection, in processes forked from this one, 32 connections each) keeps `concurrency` requests in flight against a
real server process (`hf-deep-nmt serve`, started here, `--threads` threads): each request is one sentence of the
sample corpus (its lines split into sentences as the server splits them), and a worker sends its next request as soon
as the last one is answered. At each concurrency (1, 8, 32, 128) it
reports requests per second, target tokens per second (wall) and per CPU second of the server process (all its
threads), the p50 / p95 / p99 latency, and the server's resident memory before and after; then one longer run at
concurrency 32 (`--flat-requests`, 10,000) says whether the memory stays flat. The reference is `translate` (in this
process, before the server starts, at the same threads and batch budget) over the same sentences: target tokens per
wall and per CPU second, and whether every answer of the server equals its translation (fp32 decoding is the same
whatever the batch). Target tokens are the translations tokenized again by the model's tokenizer, on both sides alike.

Without `--model` it serves a model with random weights (`--family`, `--size` as in `inference.py`; with random
weights every sentence decodes to its output cap, so the work is fixed), saved with a tokenizer trained on the
sample; `--export-onnx` adds its ONNX graphs so that `--backend onnxruntime` can serve it. The load generator shares
the machine with the server: on a 2-core machine at concurrency 128 its own CPU time is part of what the server
competes with, so run it on an otherwise quiet machine and read the per-CPU-second column beside the wall one.

    python benchmarks/serving.py --size reduced --json benchmarks/results/serving_reduced.json   # the table
    python benchmarks/serving.py --model runs/sample/export --backend onnxruntime                # a trained model
    python benchmarks/serving.py --quick                                                           # checks it runs
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from hf_deep_nmt.hub import export_hub_folder
from hf_deep_nmt.serving.backends import choose_backend, make_decoder
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.serving.server.sentences import split_sentences
from hf_deep_nmt.serving.threads import set_threads
from hf_deep_nmt.serving.translate import translate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference import FAMILIES, SIZES, family_model, sample_lines, tokenizer_for  # noqa: E402

RUNS = {
    # sentences, requests per concurrency, the concurrencies, requests of the memory run
    "quick": dict(sentences=16, requests=32, concurrency=(1, 8), flat_requests=64),
    "full": dict(sentences=300, requests=600, concurrency=(1, 8, 32, 128), flat_requests=10_000),
}
FLAT_CONCURRENCY = 32
OFFLINE_RUNS = 3  # timed passes of `translate` over the sentences, after a warm-up pass; the median is the reference
BATCH_TOKENS, BATCH_SENTENCES = 4096, 64  # the server's defaults, and translate's batches here


def sample_sentences(count: int) -> list[str]:
    """The first `count` sentences of the sample's source lines, split as the server splits a paragraph."""
    sentences = []
    for line in sample_lines(count):
        sentences.extend(split_sentences(line)[0])
    return sentences[:count]


def random_model_folder(family: str, size_name: str, folder: Path, onnx: bool) -> Path:
    size = SIZES[size_name]
    tokenizer = tokenizer_for(size)
    model = family_model(family, size, len(tokenizer))
    export_hub_folder(model, tokenizer, folder, repo_id="bench/serving")  # the tokenizer's fingerprint, es -> en
    if onnx:
        from hf_deep_nmt.serving.onnx_export import export_into_model

        export_into_model(model, tokenizer, folder, quantize=True)
    return folder


def offline(model: str, backend: str, int8: bool, threads: int, sentences: list[str], num_beams) -> dict:
    """`translate` over `sentences`: wall and CPU seconds of the decoding alone (the model is loaded first), medians of
    `OFFLINE_RUNS` passes after a warm-up pass."""
    set_threads(threads)
    decoder, tokenizer = make_decoder(backend, model, int8=int8, threads=threads)
    saved = decoder.generation_config  # what the server decodes with, as `serve` reads it
    beams = num_beams or getattr(saved, "num_beams", None) or 1
    penalty = getattr(saved, "length_penalty", None)
    options = DecodingOptions(
        num_beams=beams, length_penalty=1.0 if penalty is None else penalty, batch_size=BATCH_SENTENCES,
        max_tokens=BATCH_TOKENS,
    )  # fmt: skip
    # a whole pass to warm up (the decoder's buffers grow to the largest batch, the pages are mapped), then the median
    # of three: one pass takes a few seconds, and single passes differed by up to a third on an idle machine
    translate(decoder, tokenizer, sentences, options)
    runs = []
    for _ in range(OFFLINE_RUNS):
        cpu, wall = time.process_time(), time.perf_counter()
        outputs = translate(decoder, tokenizer, sentences, options)
        runs.append((time.process_time() - cpu, time.perf_counter() - wall))
    cpu, wall = statistics.median(cpu for cpu, _ in runs), statistics.median(wall for _, wall in runs)
    tokens = sum(len(ids) for ids in tokenizer(outputs)["input_ids"])
    figures = dict(sentences=len(sentences), wall_seconds=wall, cpu_seconds=cpu, target_tokens=tokens)
    figures.update(tokens_per_second=tokens / wall, tokens_per_cpu_second=tokens / cpu)
    return dict(figures, outputs=outputs, num_beams=beams, tokenizer=tokenizer)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: str, backend: str, int8: bool, threads: int, num_beams, log: Path) -> tuple:
    """(process, base address) of `hf-deep-nmt serve`, once its health says ready."""
    port = free_port()
    command = [sys.executable, "-m", "hf_deep_nmt_cli", "serve", "--model", model, "--port", str(port)]
    command += ["--backend", backend, "--threads", str(threads), "--max-batch-tokens", str(BATCH_TOKENS)]
    command += ["--max-batch-sentences", str(BATCH_SENTENCES), "--max-queue", "100000"]
    command += ["--int8"] * int8 + (["--num-beams", str(num_beams)] if num_beams else [])
    environment = dict(os.environ, OMP_NUM_THREADS=str(threads))
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=environment)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    with httpx.Client(base_url=base, timeout=5) as client:
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; its log:\n{log.read_text()}")
            try:
                if client.get("/health").status_code == 200:
                    return server, base
            except httpx.TransportError:
                pass
            time.sleep(0.2)


# Connections per load-generator process: concurrency 128 is spread over processes of 32 connections each. The load
# generator shares the machine's cores with the server, so its own CPU time is taken from the server's: httpx's async
# client cost 2.7-2.9 ms of CPU a request at 32 connections against the sample model (20 ms at 128, in one process),
# the standard library's `http.client`, one thread per connection, 0.2 ms; on two cores the lighter client let the
# same server answer the same 300 requests at concurrency 32 in 3.6-3.7 s instead of 4.7 s.
CLIENT_CONNECTIONS = 32


def closed_loop(base: str, sentences: list[str], concurrency: int, indexes: list[int]) -> tuple:
    """(wall seconds, latencies, {request index: answer}) of the requests `indexes` (request i sends sentence
    i mod len(sentences)), `concurrency` in flight: a thread per keep-alive connection, each sending its next
    request as soon as its last is answered. Raises the first failed request's status and body."""
    address = httpx.URL(base)
    latencies, answers, failures, queue, lock = [], {}, [], list(reversed(indexes)), threading.Lock()

    def worker():
        connection = http.client.HTTPConnection(address.host, address.port, timeout=600)
        try:
            while not failures:
                with lock:
                    if not queue:
                        return
                    index = queue.pop()
                body = json.dumps({"q": sentences[index % len(sentences)], "source": "auto", "target": "en"})
                started = time.perf_counter()
                connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                latencies.append(time.perf_counter() - started)
                if response.status != 200:
                    failures.append(f"HTTP {response.status}: {data.decode(errors='replace')}")
                    return
                answers[index] = json.loads(data)["translatedText"]
        except Exception as error:  # raised again by the thread that waits for the workers
            failures.append(f"{type(error).__name__}: {error}")
        finally:
            connection.close()

    started = time.perf_counter()
    workers = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(indexes)) or 1)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    if failures:
        raise RuntimeError(f"a request failed: {failures[0]}")
    return time.perf_counter() - started, latencies, answers


def _client(base: str, sentences: list[str], concurrency: int, indexes: list[int], go, results) -> None:
    """One load-generator process: its share of the requests once `go` is set; (latencies, answers, its CPU
    seconds) into `results`."""
    go.wait()
    cpu = time.process_time()
    _, latencies, answers = closed_loop(base, sentences, concurrency, indexes)
    results.put((latencies, answers, time.process_time() - cpu))


def run_clients(base: str, sentences: list[str], concurrency: int, total: int) -> tuple:
    """(wall seconds, latencies, answers in request order, the load generators' CPU seconds) of `total` requests,
    `concurrency` in flight, spread over processes of at most `CLIENT_CONNECTIONS` connections each (forked: they
    import nothing again), every one started before the clock."""
    import multiprocessing

    shares = -(-concurrency // CLIENT_CONNECTIONS)
    context = multiprocessing.get_context("fork")
    go, results = context.Event(), context.Queue()
    clients = [
        context.Process(
            target=_client,
            args=(
                base,
                sentences,
                concurrency // shares + (share < concurrency % shares),
                list(range(total))[share::shares],
                go,
                results,
            ),
        )
        for share in range(shares)
    ]
    for process in clients:
        process.start()
    started = time.perf_counter()
    go.set()
    latencies, answers, cpu = [], [None] * total, 0.0
    for _ in clients:
        own_latencies, own_answers, own_cpu = results.get()
        latencies += own_latencies
        cpu += own_cpu
        for index, answer in own_answers.items():
            answers[index] = answer
    wall = time.perf_counter() - started
    for process in clients:
        process.join()
        if process.exitcode:
            raise RuntimeError(f"a load-generator process failed (exit code {process.exitcode})")
    return wall, latencies, answers, cpu


def batch_totals(base: str) -> dict:
    """The server's batch counters from `/metrics` (prometheus_client's parser): batches, their sentences and padded
    source tokens, the sentences' queue wait (s), and the decoding thread's seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "batch_sentences": ("batch_sentences_count", "batch_sentences_sum"),
        "batch_tokens": ("batch_tokens_sum",),
        "queue_wait_seconds": ("queue_wait_seconds_sum", "queue_wait_seconds_count"),
        "batch_seconds": ("batch_seconds_sum",),
    }
    totals = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for sample in family.samples:
            for suffix in (name for names in wanted.values() for name in names):
                if sample.name.endswith(suffix):
                    totals[suffix] = sample.value
    return totals


def load_level(base: str, server: psutil.Process, sentences: list[str], concurrency: int, total: int, reference):
    """The figures of one closed-loop run against the server."""
    rss_before, cpu_before, batches_before = server.memory_info().rss, server.cpu_times(), batch_totals(base)
    wall, latencies, answers, client_cpu = run_clients(base, sentences, concurrency, total)
    cpu_after, rss_after = server.cpu_times(), server.memory_info().rss
    batches = {name: value - batches_before.get(name, 0.0) for name, value in batch_totals(base).items()}
    count = max(batches.get("batch_sentences_count", 0.0), 1.0)
    cpu = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    tokens = sum(len(ids) for ids in reference["tokenizer"](answers)["input_ids"])
    percentiles = statistics.quantiles(latencies, n=100, method="inclusive")
    expected = reference["outputs"]
    return dict(
        concurrency=concurrency,
        requests=total,
        requests_per_second=total / wall,
        tokens_per_second=tokens / wall,
        tokens_per_cpu_second=tokens / cpu,
        server_cpu_seconds=cpu,
        p50_ms=1000 * percentiles[49],
        p95_ms=1000 * percentiles[94],
        p99_ms=1000 * percentiles[98],
        rss_before_mib=rss_before / 2**20,
        rss_after_mib=rss_after / 2**20,
        same_as_translate=all(answer == expected[index % len(expected)] for index, answer in enumerate(answers)),
        throughput_vs_translate=(tokens / wall) / reference["tokens_per_second"],
        cpu_efficiency_vs_translate=(tokens / cpu) / reference["tokens_per_cpu_second"],
        batches=int(batches.get("batch_sentences_count", 0)),
        sentences_per_batch=batches.get("batch_sentences_sum", 0.0) / count,
        padded_tokens_per_batch=batches.get("batch_tokens_sum", 0.0) / count,
        queue_wait_ms=1000
        * batches.get("queue_wait_seconds_sum", 0.0)
        / max(batches.get("queue_wait_seconds_count", 0.0), 1.0),
        decoding_busy=batches.get("batch_seconds_sum", 0.0) / wall,
        client_cpu_ms_per_request=1000 * client_cpu / total,
    )


def stop_server(server: subprocess.Popen) -> int:
    server.send_signal(signal.SIGTERM)
    return server.wait(120)


def print_table(results: dict) -> None:
    reference = results["translate"]
    print(
        f"\nbackend {results['backend']}{' int8' * results['int8']}, {results['threads']} thread(s), beams "
        f"{results['num_beams']}, {reference['sentences']} sentences; load average {results['load_before']} -> "
        f"{results['load_after']}"
    )
    print(
        f"translate: {reference['tokens_per_second']:,.0f} target tokens/s, {reference['tokens_per_cpu_second']:,.0f} "
        "per CPU s\n"
    )
    columns = ["concurrency", "requests/s", "tokens/s", "tokens per server CPU s", "p50 ms", "p95 ms", "p99 ms"]
    columns += ["RSS MiB before -> after", "x translate (wall, CPU)", "same output"]
    columns += ["sentences per batch", "queue wait ms", "decoder busy"]
    print("| " + " | ".join(columns) + " |\n|" + "---:|" * 7 + "---|" * 3 + "---:|" * 3)
    for row in results["levels"] + [results["flat"]] * (results["flat"] is not None):
        print(
            f"| {row['concurrency']}{' (flat)' * (row is results['flat'])} | {row['requests_per_second']:,.1f} | "
            f"{row['tokens_per_second']:,.0f} | {row['tokens_per_cpu_second']:,.0f} | {row['p50_ms']:,.0f} | "
            f"{row['p95_ms']:,.0f} | {row['p99_ms']:,.0f} | {row['rss_before_mib']:,.0f} -> "
            f"{row['rss_after_mib']:,.0f} | {row['throughput_vs_translate']:.2f}, "
            f"{row['cpu_efficiency_vs_translate']:.2f} | {row['same_as_translate']} | "
            f"{row['sentences_per_batch']:.1f} | {row['queue_wait_ms']:,.0f} | {row['decoding_busy']:.0%} |"
        )


def run(args: argparse.Namespace, workdir: Path) -> dict:
    plan = RUNS["quick" if args.quick else "full"]
    size = "quick" if args.quick else args.size
    model = args.model or str(random_model_folder(args.family, size, workdir / "model", args.export_onnx))
    backend = choose_backend(model, int8=args.int8, backend=args.backend)
    sentences = sample_sentences(plan["sentences"])
    load_before = os.getloadavg()[0]
    reference = offline(model, backend, args.int8, args.threads, sentences, args.num_beams)
    server, base = start_server(model, backend, args.int8, args.threads, args.num_beams, workdir / "server.log")
    try:
        process = psutil.Process(server.pid)
        closed_loop(base, sentences, 8, list(range(8)))  # warm-up
        levels = [
            load_level(base, process, sentences, concurrency, args.requests or plan["requests"], reference)
            for concurrency in args.concurrency or plan["concurrency"]
        ]
        flat_requests = plan["flat_requests"] if args.flat_requests is None else args.flat_requests
        flat = None
        if flat_requests:
            flat = load_level(base, process, sentences, FLAT_CONCURRENCY, flat_requests, reference)
    finally:
        exit_code = stop_server(server)
    return dict(
        model=model if args.model else f"random {args.family}, size {size}",
        backend=backend,
        int8=args.int8,
        threads=args.threads,
        num_beams=reference.pop("num_beams"),
        translate={key: value for key, value in reference.items() if key not in ("outputs", "tokenizer")},
        levels=levels,
        flat=flat,
        server_exit_code=exit_code,
        load_before=round(load_before, 2),
        load_after=round(os.getloadavg()[0], 2),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version()),
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or Hub id (default: random weights)")
    parser.add_argument("--family", choices=FAMILIES, default="plain", help="of the random model")
    parser.add_argument("--size", choices=("reduced", "base"), default="reduced", help="of the random model")
    parser.add_argument("--export-onnx", action="store_true", help="give the random model its ONNX graphs")
    parser.add_argument("--backend", default=None, help="default: the one `serve` would choose")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="of the server, and of translate")
    parser.add_argument("--num-beams", type=int, default=None, help="default: the model's generation config")
    parser.add_argument("--requests", type=int, default=None, help="per concurrency (default 600; quick: 32)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 8 32 128 (quick: 1 8)")
    parser.add_argument(
        "--flat-requests", type=int, default=None, help="of the memory run (default 10,000; quick: 64; 0: no such run)"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, concurrency 1 and 8: checks it runs")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as workdir:
        results = run(args, Path(workdir))
    print_table(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
