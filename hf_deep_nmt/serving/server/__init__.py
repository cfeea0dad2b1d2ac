"""`hf-deep-nmt serve`: a model behind an HTTP endpoint that batches sentences across requests.

`app` holds the `Service` (the model behind its queue, the limits, the metrics) and the Starlette application;
`batching` the queue and the decoding thread; `limits` the server's bounds and the checks of a request; `metrics` the
Prometheus metrics; `sentences` the splitting of paragraphs into sentences and back; `runner` the uvicorn process that
drains on SIGTERM; `page.html` the page at `/`. All but `limits` and `sentences` need the `serve` extra
(`pip install 'hf-deep-nmt[serve]'`: Starlette, uvicorn with httptools, prometheus_client); this file imports none of
them, so that `hf-deep-nmt serve --help` reads the limits without them (and without torch).
"""
