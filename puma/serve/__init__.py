"""The online search service: Ray Serve over the sharded index at ``index.uri`` (jobs/serve.py).

    plan.py         checked on the driver before Ray starts: the index, the checkpoint, their model ids
    requests.py     what a request may hold; one-line 4xx reasons for everything else (no Ray)
    live_index.py   the served index: hits, thumbnails, new shards loaded without a restart
    selection.py    what a query's datasets, catalogues and metadata filter select among its items
    versions.py     following the location's alias: the versions a replica serves, the ingress's pin
    partitions.py   which shards a partition holds, how many partitions, the exact merge (no Ray)
    http.py         body limits, parameters, the bearer token, refusals as JSON errors
    ingress.py      the HTTP ingress deployment: the routes
    query_model.py  the model deployment: query images embedded in batches
    holders.py      the replicas holding shards: the ingress's LocalIndex, the IndexPartition deployment
    fanout.py       a query asked of every partition and their answers merged
    channel*.py     the partitions' direct TCP channel: its frames, server and client
    app.py          the app builder: the deployments, their options (``puma.serve.app:build``)
    run.py          start from a driver, wait for a signal, stop
    page.html       the web page served at ``/``

Importing this package imports nothing; ``puma.serve.app`` imports Ray Serve and FastAPI.
"""
