"""The online search service: Ray Serve over the sharded index at ``index.uri`` (jobs/serve.py).

    plan.py         checked on the driver before Ray starts: the index, the checkpoint, their model ids
    requests.py     what a request may hold; one-line 4xx reasons for everything else (no Ray)
    live_index.py   the served index: filters, hits, thumbnails, new shards loaded without a restart
    app.py          the Ray Serve deployments (ingress, batched model, index) and the app builder
    run.py          start from a driver, wait for a signal, stop
    page.html       the web page served at ``/``

Importing this package imports nothing; ``puma.serve.app`` imports Ray Serve and FastAPI.
"""
